"""fp8-attn's attention through cuDNN's FP8 flash attention (`sdpa_fp8` of NVIDIA's cudnn-frontend, Hopper and
newer): a candidate beside our Triton kernel (kernels/fp8_attention.py), measured by scripts/fp8_attention_bench.py.

The operands are the Triton kernel's (`fp8_attention.operands`: E4M3 codes of q*c/sq and k*c/sk, of v/sv), here
all three [B, H, S, D]. cuDNN computes S = (Q8 sq)(K8 sk)^T (attn_scale 1: c is in the codes), the online softmax
in fp32, P (each block's exp(S - m), in (0, 1]) times scale_s = 448 rounded to E4M3, O = P8 V8 / 448 * sv / l:
the arithmetic of `fp8_attention.kernel_arithmetic`, cuDNN's own block order aside. The output is bf16 where this
cuDNN writes it so (else E4M3 with scale 1/sv and one dequantizing pass; the plan says which: `Plan.output`).

Needs the `cudnn` module (pip `nvidia-cudnn-frontend`; it loads the libcudnn torch already loaded); `available()`
says whether it is here. Imported only where it runs."""

from __future__ import annotations

import threading

from .fp8_attention import P_SCALE

_PLANS: dict = {}
_LOCK = threading.Lock()


def available() -> str | None:
    """None where cuDNN's FP8 attention can run here, else why not (one line)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return "cuDNN's FP8 attention needs a Hopper or newer GPU"
    torch.backends.cudnn.version()  # libcudnn loaded by torch first: the frontend finds it by name
    try:
        import cudnn  # noqa: F401
    except ImportError as e:
        return f"the cudnn module (pip nvidia-cudnn-frontend) is not here ({e})"
    return None


class Plan:
    """One built cuDNN graph for one (q, k, v) shape and stride set, its handle and workspace."""

    def __init__(self, q8, k8, v8, out_dtype):
        import cudnn
        import torch

        self.cudnn, self.device = cudnn, q8.device
        self.handle = cudnn.create_handle()
        self.shape = tuple(q8.shape)
        b, h, s, d = self.shape
        self.stride = (h * s * d, s * d, d, 1)
        self.graph, self.scalars_of = None, {}  # scalars_of: the six scale tensors per recipe's scales
        for out in ("bf16", "e4m3"):
            try:
                self._build(q8, k8, v8, out)
                self.output = out
                break
            except Exception as e:  # cudnn.cudnnGraphNotSupportedError and kin: that output is not built here
                self.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        if self.graph is None:
            raise RuntimeError(f"cuDNN builds no FP8 attention for {self.shape}: {self.error}")
        self.workspace = torch.empty(self.graph.get_workspace_size(), device=self.device, dtype=torch.uint8)
        self.out_dtype = out_dtype

    def _build(self, q8, k8, v8, out: str) -> None:
        cudnn = self.cudnn
        g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        self.inputs = [g.tensor(name=n, dim=list(t.shape), stride=list(t.stride()),
                                data_type=cudnn.data_type.FP8_E4M3) for n, t in zip("qkv", (q8, k8, v8))]
        self.scalars = [g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
                        for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
        o, _, amax_s, amax_o = g.sdpa_fp8(
            q=self.inputs[0], k=self.inputs[1], v=self.inputs[2], descale_q=self.scalars[0],
            descale_k=self.scalars[1], descale_v=self.scalars[2], descale_s=self.scalars[3],
            scale_s=self.scalars[4], scale_o=self.scalars[5], is_inference=True, attn_scale=1.0,
            use_causal_mask=False)
        kind = cudnn.data_type.BFLOAT16 if out == "bf16" else cudnn.data_type.FP8_E4M3
        o.set_output(True).set_dim(list(self.shape)).set_stride(list(self.stride)).set_data_type(kind)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        self.outputs = (o, amax_s, amax_o)
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        self.graph = g

    def __call__(self, q8, k8, v8, scales):
        """[B, H, S, D] in out_dtype from the operands' E4M3 codes and the recipe's (sq, sk, sp, sv)."""
        import torch

        sq, sk, _, sv = (float(s) for s in scales)
        e4m3 = self.output == "e4m3"
        scalars = self.scalars_of.get((sq, sk, sv))
        if scalars is None:  # copied to the GPU once per set of scales (one per attention), not on every call
            values = (sq, sk, sv, 1.0 / P_SCALE, P_SCALE, 1.0 / sv if e4m3 else 1.0)
            scalars = torch.tensor(values, dtype=torch.float32, device=self.device).view(6, 1, 1, 1, 1)
            self.scalars_of[(sq, sk, sv)] = scalars
        out = torch.empty(self.shape, dtype=torch.float8_e4m3fn if e4m3 else torch.bfloat16, device=self.device)
        amax = torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device=self.device)
        pack = dict(zip(self.inputs, (q8, k8, v8)))
        pack.update(zip(self.scalars, scalars))
        pack.update(zip(self.outputs, (out, amax[0], amax[1])))
        self.cudnn.set_stream(self.handle, torch.cuda.current_stream(self.device).cuda_stream)
        self.graph.execute(pack, self.workspace, handle=self.handle)
        return (out.float() * sv).to(self.out_dtype) if e4m3 else out.to(self.out_dtype)


def plan_for(q8, k8, v8, out_dtype) -> Plan:
    """The cached Plan of these operands' shapes and strides (built once; never while a CUDA graph captures)."""
    key = (q8.device, out_dtype, *((tuple(t.shape), t.stride()) for t in (q8, k8, v8)))
    with _LOCK:
        if key not in _PLANS:
            _PLANS[key] = Plan(q8, k8, v8, out_dtype)
        return _PLANS[key]


def attention(q, k, v, scales):
    """fp8-attn's attention by cuDNN: q, k, v [B, S, H, D], scales (sq, sk, sp, sv) -> [B, S, H, D] in q's dtype."""
    from .fp8_attention import operands

    q8, k8, v8 = operands(q, k, v, scales, v_transposed=False)
    return plan_for(q8, k8, v8, q.dtype)(q8, k8, v8, scales).transpose(1, 2)
