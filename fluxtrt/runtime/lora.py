"""LoRA for the transformer, merged into the user's checkpoint tensors as they are read (`run --lora`)."""

from __future__ import annotations

from ..checkpoint import check_finite, read_header, read_stored
from ..dtypes import cast
from ..errors import FluxtrtError


class Lora:
    """A LoRA for the transformer in diffusers/peft format (`transformer.<module>.lora_A.weight` [r, in],
    `.lora_B.weight` [out, r], optional `<module>.alpha`), applied to checkpoint tensors as they are read:
    W' = W + scale * (alpha / r) * B @ A, before the weight map's recipes (so fused q/k/v get it too)."""

    def __init__(self, path, scale: float = 1.0):
        stored = read_header(path)
        self.path, self.deltas, self.used = path, {}, set()
        pairs: dict[str, dict] = {}
        for key, t in stored.items():
            name = key[len("transformer."):] if key.startswith("transformer.") else key
            for part in ("lora_A", "lora_B"):
                if name.endswith(f".{part}.weight"):
                    pairs.setdefault(name[: -len(f".{part}.weight")], {})[part] = t
            if name.endswith(".alpha"):
                pairs.setdefault(name[: -len(".alpha")], {})["alpha"] = t
        if not pairs or any(key.startswith(("text_encoder", "lora_te")) for key in stored):
            raise FluxtrtError(f"{path} is not a transformer LoRA in diffusers/peft format "
                               "(transformer.<module>.lora_A.weight / lora_B.weight)")
        for module, p in pairs.items():
            if "lora_A" not in p or "lora_B" not in p:
                raise FluxtrtError(f"{path}: {module} lacks lora_A or lora_B")
            a, b = (check_finite(read_stored(p[part]), path, f"{module}.{part}.weight").astype("float32")
                    for part in ("lora_A", "lora_B"))
            rank = a.shape[0]
            alpha = float(check_finite(read_stored(p["alpha"]), path, f"{module}.alpha").reshape(-1)[0]) \
                if "alpha" in p else rank
            self.deltas[f"{module}.weight"] = (b @ a) * (scale * alpha / rank)

    def wrap(self, get):
        def read(key):
            w = get(key)
            delta = self.deltas.get(key)
            if delta is None:
                return w
            if delta.shape != w.shape:
                raise FluxtrtError(f"LoRA {self.path}: {key} has shape {list(delta.shape)}, the checkpoint's is "
                                   f"{list(w.shape)}; the LoRA is for another model")
            self.used.add(key)
            return cast(w.astype("float32") + delta, str(w.dtype))
        return read

    def check_all_used(self, elsewhere=()) -> None:
        """Every delta met its weight; `elsewhere`: checkpoint keys another part of the transformer reads (a First-
        Block Cache part reads some blocks only)."""
        unused = sorted(set(self.deltas) - self.used - set(elsewhere))
        if unused:
            raise FluxtrtError(f"LoRA {self.path} targets weights the transformer does not have: "
                               f"{', '.join(unused[:3])}" + (" ..." if len(unused) > 3 else ""))
