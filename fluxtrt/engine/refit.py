"""Refit: fill a refittable (weight-stripped) TensorRT engine with weights from the user's checkpoint."""

from __future__ import annotations

from ..dtypes import np_dtype
from ..errors import FluxtrtError


def refit_engine(engine, trt, logger, weights: dict) -> None:
    """Fill a refittable (weight-stripped) TensorRT engine with `weights` (name -> array, from `materialize`).
    Every refittable weight the engine lists must be given; TensorRT checks shapes and types."""
    import numpy as np

    refitter = trt.Refitter(engine, logger)
    wanted = set(refitter.get_all_weights())
    missing = sorted(wanted - set(weights))
    if missing:
        raise FluxtrtError(f"the engine wants weights the weight map does not provide: {', '.join(missing[:5])}"
                           + (" ..." if len(missing) > 5 else "") + "; rebuild the engine and its map together")
    keep = []  # TensorRT reads the host arrays during refit_cuda_engine
    for name in sorted(wanted):
        arr = np.ascontiguousarray(weights[name])
        keep.append(arr)
        if arr.dtype == np_dtype("bfloat16"):  # numpy has no bf16: hand TensorRT the buffer and its type
            w = trt.Weights(trt.DataType.BF16, arr.ctypes.data, arr.size)
        else:
            w = trt.Weights(arr)
        if not refitter.set_named_weights(name, w):
            raise FluxtrtError(f"TensorRT refused weight {name} {list(arr.shape)} {arr.dtype} from your checkpoint")
    if not refitter.refit_cuda_engine():
        raise FluxtrtError("TensorRT could not refit the engine with your checkpoint's weights")
