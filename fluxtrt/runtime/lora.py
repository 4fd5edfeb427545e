"""LoRA for the transformer (`--lora FILE[:SCALE]`, repeatable: stacked). A LoRA file holds, per linear layer,
`lora_A` [r, in] and `lora_B` [out, r] (diffusers/peft format, optional `alpha`); its delta is
scale * (alpha / r) * B @ A. Where the weights come from a checkpoint (engines and ONNX, `--weights`) the deltas
are merged into the checkpoint's tensors as they are read (`Lora`). On the PyTorch transformer they are merged into
a bf16/fp32 module's weights before its projections are joined (`merge_into`), or, on an fp8 module, added as a
low-rank term beside each quantized GEMM (`add_side_paths`: the base stays E4M3 and its scales stay valid)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import check_finite, read_header, read_stored
from ..dtypes import cast
from ..errors import FluxtrtError

MAX_SCALE = 10.0


@dataclass(frozen=True)
class LoraRef:
    """One `--lora FILE[:SCALE]`: a LoRA file and its strength."""

    path: Path
    scale: float = 1.0

    @classmethod
    def parse(cls, value) -> "LoraRef":
        """FILE or FILE:SCALE (the scale after the last colon, where it is a number), a (file, scale) pair, or a
        LoraRef; the scale finite and within +-10."""
        if isinstance(value, LoraRef):
            ref = value
        elif isinstance(value, (tuple, list)) and len(value) == 2:
            ref = cls(Path(value[0]), value[1])
        else:
            text = str(value)
            head, sep, tail = text.rpartition(":")
            try:
                ref = cls(Path(head), float(tail)) if sep and head else cls(Path(text))
            except ValueError:
                ref = cls(Path(text))
        scale = ref.scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                or abs(scale) > MAX_SCALE:
            raise FluxtrtError(f"--lora {ref.path}: the scale after ':' is a number within +-{MAX_SCALE:g}, got {scale!r}")
        return cls(Path(ref.path), float(scale))

    def __str__(self) -> str:
        return f"{self.path}:{self.scale:g}"


class LoraFile:
    """A transformer LoRA's factors as stored: {module: (A [r, in], B [out, r], alpha / r)} in fp32, every tensor
    checked finite. The file is untrusted: anything that is not a transformer LoRA is one line."""

    def __init__(self, path):
        stored = read_header(path)
        self.path, self.factors = Path(path), {}
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
            if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
                raise FluxtrtError(f"{path}: {module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} are not "
                                   "[r, in] and [out, r]")
            rank = a.shape[0]
            alpha = float(check_finite(read_stored(p["alpha"]), path, f"{module}.alpha").reshape(-1)[0]) \
                if "alpha" in p else rank
            self.factors[module] = (a, b, alpha / rank)


def read_loras(refs) -> list[tuple[LoraFile, float]]:
    """Each LoraRef's file read and checked, with its scale."""
    return [(LoraFile(ref.path), ref.scale) for ref in refs]


class Lora:
    """Stacked LoRAs applied to checkpoint tensors as they are read: W' = W + sum_i scale_i * (alpha_i / r_i) *
    B_i @ A_i, before the weight map's recipes (so fused q/k/v get it too)."""

    def __init__(self, refs):
        self.names = ", ".join(str(r.path) for r in refs)
        self.deltas, self.used = {}, set()
        for lf, scale in read_loras(refs):
            for module, (a, b, s) in lf.factors.items():
                delta = (b @ a) * (scale * s)
                key = f"{module}.weight"
                if key in self.deltas and self.deltas[key].shape != delta.shape:
                    raise FluxtrtError(f"LoRAs {self.names}: {module} has two shapes; they are for different models")
                self.deltas[key] = self.deltas[key] + delta if key in self.deltas else delta

    def wrap(self, get):
        def read(key):
            w = get(key)
            delta = self.deltas.get(key)
            if delta is None:
                return w
            if delta.shape != w.shape:
                raise FluxtrtError(f"LoRA {self.names}: {key} has shape {list(delta.shape)}, the checkpoint's is "
                                   f"{list(w.shape)}; the LoRA is for another model")
            self.used.add(key)
            return cast(w.astype("float32") + delta, str(w.dtype))
        return read

    def check_all_used(self, elsewhere=()) -> None:
        """Every delta met its weight; `elsewhere`: checkpoint keys another part of the transformer reads (a First-
        Block Cache part reads some blocks only)."""
        unused = sorted(set(self.deltas) - self.used - set(elsewhere))
        if unused:
            raise FluxtrtError(f"LoRA {self.names} targets weights the transformer does not have: "
                               f"{', '.join(unused[:3])}" + (" ..." if len(unused) > 3 else ""))


def _target(module, name: str, lf: LoraFile, a, b):
    """The nn.Linear `name` of `module`, checked against the factors' shapes."""
    import torch

    try:
        lin = module.get_submodule(name)
    except AttributeError:
        lin = None
    if not isinstance(lin, torch.nn.Linear):
        raise FluxtrtError(f"LoRA {lf.path} targets {name}, which the transformer does not have as a linear layer")
    if (lin.out_features, lin.in_features) != (b.shape[0], a.shape[1]):
        raise FluxtrtError(f"LoRA {lf.path}: {name} is [{b.shape[0]}, {a.shape[1]}], the transformer's is "
                           f"[{lin.out_features}, {lin.in_features}]; the LoRA is for another model")
    return lin


def merge_into(module, loras) -> int:
    """Add each LoRA's delta to the diffusers transformer `module`'s linear weights, in place (computed in fp32,
    stored in the weight's dtype). Before the projections are joined. Returns the layers changed."""
    import torch

    changed = set()
    with torch.no_grad():
        for lf, scale in loras:
            for name, (a, b, s) in lf.factors.items():
                lin = _target(module, name, lf, a, b)
                w = lin.weight
                delta = torch.from_numpy(b).to(w.device) @ torch.from_numpy(a).to(w.device)
                w.copy_((w.float() + delta * (scale * s)).to(w.dtype))
                changed.add(name)
    return len(changed)


def side_path_plan(module, loras) -> dict:
    """Where each LoRA layer's term goes once the projections are joined: {host module: [(row offset, A, B scaled)]},
    read off the diffusers transformer `module` before fp8_layers.fuse_projections joins them (which records the
    parts it joins on the module)."""
    plan: dict[str, list] = {}
    for lf, scale in loras:
        for name, (a, b, s) in lf.factors.items():
            _target(module, name, lf, a, b)
            plan.setdefault(name, []).append((0, a, b * (scale * s)))
    return plan


def add_side_paths(module, plan: dict, dtype) -> int:
    """Each planned low-rank term beside the layer that now computes it: the layer itself, or the joined GEMM
    that holds it (fp8_layers.JOINED on `module`: its output rows). One LoraSide per host: y = base(x) + (x D^T) U^T
    with D the stacked A's and U the B's at their rows. Returns the hosts."""
    import numpy as np
    import torch

    from ..fp8_layers import JOINED

    where = {}
    for host, parts in getattr(module, JOINED, {}).items():
        offset = 0
        for part, rows in parts:
            where[part] = (host, offset)
            offset += rows
    hosts: dict[str, list] = {}
    for name, terms in plan.items():
        host, offset = where.get(name, (name, 0))
        hosts.setdefault(host, []).extend((offset + o, a, b) for o, a, b in terms)
    for host, terms in hosts.items():
        parent, _, leaf = host.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        base = getattr(owner, leaf)
        out_f = base.out_features
        down = np.concatenate([a for _, a, _ in terms])
        up = np.zeros((out_f, down.shape[0]), np.float32)
        col = 0
        for offset, a, b in terms:
            up[offset:offset + b.shape[0], col:col + a.shape[0]] = b
            col += a.shape[0]
        device = next((t.device for t in base.buffers()), None) or next(base.parameters()).device
        setattr(owner, leaf, lora_side(base, torch.from_numpy(down).to(device, dtype),
                                       torch.from_numpy(up).to(device, dtype)))
    return len(hosts)


def lora_side(base, down, up):
    """`base` (an nn.Linear or an fp8 GEMM) plus the low-rank term (x down^T) up^T."""
    import torch

    class LoraSide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = base
            self.in_features, self.out_features = base.in_features, base.out_features
            self.register_buffer("down", down)
            self.register_buffer("up", up)

        def forward(self, x):
            f = torch.nn.functional
            return self.base(x) + f.linear(f.linear(x, self.down), self.up)

    return LoraSide()
