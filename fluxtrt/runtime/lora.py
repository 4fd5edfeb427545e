"""LoRA for the transformer (`--lora FILE[:SCALE]`, repeatable: stacked). A LoRA file holds, per linear layer,
`lora_A` [r, in] and `lora_B` [out, r] (diffusers/peft format, optional `alpha`); its delta is
scale * (alpha / r) * B @ A. Where the weights come from a checkpoint (engines and ONNX, `--weights`) the deltas
are merged into the checkpoint's tensors as they are read (`Lora`). On the PyTorch transformer they are merged into
a bf16/fp32 module's weights before its projections are joined (`merge_into`), or, on an fp8 module, added as a
low-rank term beside each quantized GEMM (`add_side_paths`: the base stays E4M3 and its scales stay valid)."""

from __future__ import annotations

import math
import re
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
    """A transformer LoRA's factors as stored: {module: (A [r, in], B [out, r], alpha / r)} in fp32 with diffusers'
    module names, every tensor checked finite. Two formats: diffusers/peft (`transformer.<module>.lora_A.weight`,
    `.lora_B.weight`, optional `.alpha`) and kohya's FLUX format (`lora_unet_<BFL module>.lora_down.weight`,
    `.lora_up.weight`, `.alpha`; a joined BFL layer such as `double_blocks_0_img_attn_qkv` or a single block's
    `linear1` splits into the diffusers layers it holds, the rows of its up matrix to each). The file is untrusted:
    anything that is not a transformer LoRA is one line."""

    def __init__(self, path):
        stored = read_header(path)
        self.path, self.factors = Path(path), {}
        pairs: dict[str, dict] = {}
        parts = {"lora_A": "lora_A", "lora_B": "lora_B", "lora_down": "lora_A", "lora_up": "lora_B"}
        for key, t in stored.items():
            name = key[len("transformer."):] if key.startswith("transformer.") else key
            for part, role in parts.items():
                if name.endswith(f".{part}.weight"):
                    pairs.setdefault(name[: -len(f".{part}.weight")], {})[role] = t
                    pairs[name[: -len(f".{part}.weight")]][role + " name"] = name
            if name.endswith(".alpha"):
                pairs.setdefault(name[: -len(".alpha")], {})["alpha"] = t
        if not pairs or any(key.startswith(("text_encoder", "lora_te")) for key in stored):
            raise FluxtrtError(f"{path} is not a transformer LoRA in diffusers/peft format "
                               "(transformer.<module>.lora_A.weight / lora_B.weight) or kohya's "
                               "(lora_unet_<module>.lora_down.weight / lora_up.weight)")
        for module, p in pairs.items():
            if "lora_A" not in p or "lora_B" not in p:
                raise FluxtrtError(f"{path}: {module} lacks lora_A or lora_B")
            a, b = (check_finite(read_stored(p[part]), path, p[part + " name"]).astype("float32")
                    for part in ("lora_A", "lora_B"))
            if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
                raise FluxtrtError(f"{path}: {module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} are not "
                                   "[r, in] and [out, r]")
            rank = a.shape[0]
            alpha = float(check_finite(read_stored(p["alpha"]), path, f"{module}.alpha").reshape(-1)[0]) \
                if "alpha" in p else rank
            if module.startswith("lora_unet_"):
                for target, rows in _kohya_targets(module[len("lora_unet_"):], b.shape[0], a.shape[1], path):
                    self.factors[target] = (a, b[rows], alpha / rank)
            else:
                self.factors[module] = (a, b, alpha / rank)


# kohya's FLUX LoRA layers (BFL's module names, dots as underscores) -> diffusers' layers; a joined BFL layer
# lists its parts, each taking an equal share of the up rows unless sized
_KOHYA_DOUBLE = {"img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn_proj": ("attn.to_out.0",),
                 "img_mlp_0": ("ff.net.0.proj",), "img_mlp_2": ("ff.net.2",), "img_mod_lin": ("norm1.linear",),
                 "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
                 "txt_attn_proj": ("attn.to_add_out",), "txt_mlp_0": ("ff_context.net.0.proj",),
                 "txt_mlp_2": ("ff_context.net.2",), "txt_mod_lin": ("norm1_context.linear",)}
_KOHYA_SINGLE = {"linear2": "proj_out", "modulation_lin": "norm.linear"}
_KOHYA_TOP = {"img_in": "x_embedder", "txt_in": "context_embedder", "final_layer_linear": "proj_out",
              "time_in_in_layer": "time_text_embed.timestep_embedder.linear_1",
              "time_in_out_layer": "time_text_embed.timestep_embedder.linear_2",
              "vector_in_in_layer": "time_text_embed.text_embedder.linear_1",
              "vector_in_out_layer": "time_text_embed.text_embedder.linear_2",
              "guidance_in_in_layer": "time_text_embed.guidance_embedder.linear_1",
              "guidance_in_out_layer": "time_text_embed.guidance_embedder.linear_2"}


def _kohya_targets(name: str, rows: int, in_features: int, path) -> list:
    """[(diffusers layer, rows of the up matrix)] for kohya's FLUX layer `name` (without `lora_unet_`)."""
    m = re.fullmatch(r"double_blocks_(\d+)_(\w+)", name)
    if m and m[2] in _KOHYA_DOUBLE:
        targets = [f"transformer_blocks.{m[1]}.{t}" for t in _KOHYA_DOUBLE[m[2]]]
        share = rows // len(targets)
        if share * len(targets) != rows:
            raise FluxtrtError(f"{path}: {name} has {rows} rows, not {len(targets)} equal parts")
        return [(t, slice(i * share, (i + 1) * share)) for i, t in enumerate(targets)]
    m = re.fullmatch(r"single_blocks_(\d+)_(\w+)", name)
    if m and m[2] == "linear1":  # q, k, v (the hidden size each) and the MLP input (the rest)
        block, h = f"single_transformer_blocks.{m[1]}", in_features
        if rows <= 3 * h:
            raise FluxtrtError(f"{path}: {name} has {rows} rows; a single block's linear1 has 3 x {h} and the MLP's")
        return [(f"{block}.attn.to_q", slice(0, h)), (f"{block}.attn.to_k", slice(h, 2 * h)),
                (f"{block}.attn.to_v", slice(2 * h, 3 * h)), (f"{block}.proj_mlp", slice(3 * h, rows))]
    if m and m[2] in _KOHYA_SINGLE:
        return [(f"single_transformer_blocks.{m[1]}.{_KOHYA_SINGLE[m[2]]}", slice(0, rows))]
    if name in _KOHYA_TOP:
        return [(_KOHYA_TOP[name], slice(0, rows))]
    if name == "final_layer_adaLN_modulation_1":  # BFL's (shift, scale) are diffusers' norm_out (scale, shift)
        half = rows // 2
        return [("norm_out.linear", [*range(half, rows), *range(half)])]
    raise FluxtrtError(f"{path}: lora_unet_{name} is not a FLUX transformer layer kohya's format names")


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


def _add_delta(w, a, b, factor: float) -> None:
    """w += factor * B @ A in place, computed in fp32 and stored in w's dtype."""
    import torch

    delta = torch.from_numpy(b).to(w.device) @ torch.from_numpy(a).to(w.device)
    w.copy_((w.float() + delta * factor).to(w.dtype))


def merge_into(module, loras) -> int:
    """Add each LoRA's delta to the diffusers transformer `module`'s linear weights, in place (computed in fp32,
    stored in the weight's dtype). Before the projections are joined. Returns the layers changed."""
    import torch

    changed = set()
    with torch.no_grad():
        for lf, scale in loras:
            for name, (a, b, s) in lf.factors.items():
                lin = _target(module, name, lf, a, b)
                _add_delta(lin.weight, a, b, scale * s)
                changed.add(name)
    return len(changed)


def _constant_key(keys, layer: str) -> str | None:
    """The constant of a package's weights file that holds `layer`'s weight: the wrapped module's state dict name,
    `model.<layer>.weight` (every wrapper of wrappers.py holds the diffusers module as `.model`); None where this
    file has none (a First-Block Cache part holds some layers only)."""
    key = f"model.{layer}.weight"
    return key if key in keys else None


def check_package_targets(keys, loras, what: str) -> None:
    """Every layer of `loras` is a weight among `keys` (the union of the transformer packages' constants); one line
    naming the first that is not."""
    for lf, _ in loras:
        for name in lf.factors:
            if _constant_key(keys, name) is None:
                raise FluxtrtError(f"LoRA {lf.path} targets {name}, which {what} do not hold as a linear layer's "
                                   "weight; the LoRA is for another model")


def merge_into_constants(weights: dict, loras, component: str) -> int:
    """Each LoRA's delta added to a package's weights {constant name: tensor} as they were read, in place
    (fp32 arithmetic, stored in the weight's dtype), before the package takes them: the same merge as
    `merge_into` on the module. Layers this file does not hold are left to the other parts. E4M3 weights are
    refused in one line (merging would need the recipe's quantization again). Returns the weights changed."""
    import torch

    changed = set()
    with torch.no_grad():
        for lf, scale in loras:
            for name, (a, b, s) in lf.factors.items():
                key = _constant_key(weights, name)
                if key is None:
                    continue
                w = weights[key]
                if w.dtype.is_floating_point and w.element_size() == 1:
                    raise FluxtrtError(f"--lora on {component}'s fp8 package: its weights are E4M3 as the recipe "
                                       "quantized them; run the transformer in PyTorch beside the packages "
                                       "(--fallback transformer), which keeps fp8 and adds the LoRA beside it")
                if tuple(w.shape) != (b.shape[0], a.shape[1]):
                    raise FluxtrtError(f"LoRA {lf.path}: {name} is [{b.shape[0]}, {a.shape[1]}], the package's is "
                                       f"{list(w.shape)}; the LoRA is for another model")
                _add_delta(w, a, b, scale * s)
                changed.add(key)
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

    from ..kernels.lora_add import lora_add_

    class LoraSide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = base
            self.in_features, self.out_features = base.in_features, base.out_features
            self.register_buffer("down", down)
            self.register_buffer("up", up)

        def forward(self, x):
            y = self.base(x)
            h = torch.nn.functional.linear(x, self.down).reshape(1, -1, self.down.shape[0])
            lora_add_(y, h, self.up.T[None], 0, self.out_features)  # in place: kernels/lora_add.py
            return y

    return LoraSide()


MAX_STACK = 4  # LoRAs one request may stack
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class LoraBank:
    """The LoRAs a server serves per request (`fluxtrt serve --lora-dir DIR`) on a PyTorch transformer: the files
    DIR/<name>.safetensors, named by their stem (inside DIR only). An adapter is loaded into a slot of GPU memory
    on first use and kept while the slots (`cache_bytes` in all) hold it, least recently used evicted when a new one
    needs its slot and no running sample uses it. Each layer a LoRA of DIR targets computes base(x) plus, for each
    sample of the batch, the low-rank terms of that sample's adapters (a batched gather-GEMM over the slots: the
    base GEMM runs once for the batch, samples with different adapters share the call). Set per call with
    `use(assignment)`: one [(slot, scale), ...] per sample; empty for a sample without LoRA.
    What a compiled transformer reads of it keeps its shapes from call to call: the slots and scales are written
    into buffers of `rows` x MAX_STACK, and a call uses the first column alone (a LoRA per sample at most) or all
    of them (a sample stacks several). So a compiled transformer has three forms per batch size (no LoRA, one,
    a stack), whatever adapters the samples name (`variants`), and a CUDA graph reads the buffers' current values."""

    mixes = True  # samples with different adapters share a transformer call
    variants = 3  # the forms a compiled transformer takes per batch size: no LoRA, one per sample, a stack

    def __init__(self, folder, cache_bytes: int, rows: int = 8):
        import collections
        import threading

        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FluxtrtError(f"--lora-dir {folder} is not a folder; pass the folder that holds the LoRA files")
        self.cache_bytes = int(cache_bytes)
        self.hosts: dict = {}  # host layer -> its MixedLora module
        self.slots = 0
        self.loaded: collections.OrderedDict = collections.OrderedDict()  # name -> slot (least recent first)
        self.pinned: collections.Counter = collections.Counter()  # slot -> samples using it
        self.files: dict = {}  # name -> LoraFile read and checked (host memory)
        self.rows = max(1, int(rows))  # the largest batch a call pads to (the server's --max-batch)
        self.on, self.k = False, 1  # this call: any LoRA at all; the stack columns it reads (1 or MAX_STACK)
        self.idx = self.scale = None  # [rows, MAX_STACK]: each sample's slots (0: zeros) and their scales
        self._layers: dict | None = None  # layer -> (host, offset, rows) once attached to a PyTorch transformer
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.folder.glob("*.safetensors") if _NAME.fullmatch(p.stem))

    def listing(self) -> list[dict]:
        """GET /v1/loras: every servable name, whether it is in GPU memory, its file size."""
        return [{"name": n, "loaded": n in self.loaded, "bytes": (self.folder / f"{n}.safetensors").stat().st_size}
                for n in self.names()]

    def path(self, name) -> Path:
        """DIR/<name>.safetensors for a request's name; one line (the caller answers 4xx) for any other name."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise FluxtrtError(f"lora name {str(name)[:60]!r} is not a LoRA of this server: a name is a file stem of "
                               "its --lora-dir (letters, digits, . _ -); GET /v1/loras lists them")
        path = self.folder / f"{name}.safetensors"
        if not path.is_file():
            raise FluxtrtError(f"lora {name!r} is not a LoRA of this server; GET /v1/loras lists them")
        return path

    def check(self, name: str) -> LoraFile:
        """The adapter `name` read and checked against the transformer's layers (kept in host memory); one line
        for a missing, damaged or foreign file."""
        with self._lock:
            if name in self.files:
                return self.files[name]
        lf = LoraFile(self.path(name))
        for module, (a, b, _) in (lf.factors.items() if self._layers is not None else ()):
            host, offset, rows = self._layers.get(module, (None, 0, 0))
            if host is None or (rows, self.hosts[host].in_features) != (b.shape[0], a.shape[1]):
                raise FluxtrtError(f"lora {name!r} targets {module}, which this transformer does not have in that shape")
            if module not in self.hosts[host].ranks or a.shape[0] > self.hosts[host].ranks[module]:
                raise FluxtrtError(f"lora {name!r}: {module} has rank {a.shape[0]}, more than the server planned for "
                                   "when it started; restart it to serve this file")
        with self._lock:
            self.files[name] = lf
        return lf

    def attach(self, module, dtype) -> int:
        """Put a MixedLora on every layer a LoRA of DIR targets (after the projections are joined and quantized),
        with room for each layer's largest rank among the files, and as many slots as `cache_bytes` holds.
        Returns the slots."""
        import torch

        from ..fp8_layers import JOINED

        where = {}
        for host, parts in getattr(module, JOINED, {}).items():
            offset = 0
            for part, rows in parts:
                where[part] = (host, offset, rows)
                offset += rows
        ranks: dict = {}  # host -> {layer: largest rank}
        for name in self.names():
            try:
                header = read_header(self.folder / f"{name}.safetensors")
            except FluxtrtError:
                continue  # a damaged file is refused when a request names it; the others are served
            for key, t in header.items():
                layer = key[len("transformer."):] if key.startswith("transformer.") else key
                if layer.endswith(".lora_A.weight") and len(t.shape) == 2:
                    layer = layer[: -len(".lora_A.weight")]
                    host = where.get(layer, (layer, 0, 0))[0]
                    try:
                        base = module.get_submodule(host)
                    except AttributeError:
                        continue  # refused when a request names the file
                    if not hasattr(base, "in_features"):
                        continue
                    where.setdefault(layer, (layer, 0, base.out_features))
                    r = ranks.setdefault(host, {})
                    r[layer] = max(r.get(layer, 0), int(t.shape[0]))
        self._layers = {k: v for k, v in where.items() if v[0] in ranks}
        # the output columns a host's adapters can touch: a joined projection's parts that no file targets (the
        # single blocks' MLP beside their q, k, v) are neither stored nor added to
        spans = {h: (min(where[layer][1] for layer in r), max(where[layer][1] + where[layer][2] for layer in r))
                 for h, r in ranks.items()}
        elem = torch.empty((), dtype=dtype).element_size()
        per_slot = sum(sum(r.values()) * (module.get_submodule(h).in_features + spans[h][1] - spans[h][0])
                       for h, r in ranks.items()) * elem
        # at least a full stack's worth, so every request can run (over cache_bytes only where that is smaller)
        self.slots = max(MAX_STACK, min(256, self.cache_bytes // max(per_slot, 1))) if ranks else 0
        for host, r in ranks.items():
            parent, _, leaf = host.rpartition(".")
            owner = module.get_submodule(parent) if parent else module
            base = getattr(owner, leaf)
            device = next((t.device for t in base.buffers()), None) or next(base.parameters()).device
            mixed = _mixed_lora(base, self, dict(r), span=spans[host], slots=self.slots, dtype=dtype,
                                device=device)
            setattr(owner, leaf, mixed)
            self.hosts[host] = mixed
        return self.slots

    def acquire(self, loras) -> list | None:
        """Slots for a request's [(name, scale)], loading what is not in GPU memory (evicting the least recently
        used adapter no sample uses); pinned until `release`. None when every slot is in use (try again later)."""
        import torch

        with self._lock:
            need = [n for n, _ in loras if n not in self.loaded]
            free = [s for s in range(1, self.slots + 1) if s not in self.loaded.values()]
            idle = [n for n, s in self.loaded.items() if not self.pinned[s] and n not in dict(loras)]
            if len(need) > len(free) + len(idle):
                return None
            for name in need:
                if free:
                    slot = free.pop()
                else:
                    slot = self.loaded.pop(idle.pop(0))
                lf = self.files[name]
                with torch.no_grad():
                    for mixed in self.hosts.values():
                        mixed.clear(slot)
                    for layer, (a, b, s) in lf.factors.items():
                        host, offset, _ = self._layers[layer]
                        self.hosts[host].put(slot, layer, offset, a, b * s)
                self.loaded[name] = slot
            out = []
            for name, scale in loras:
                self.loaded.move_to_end(name)
                self.pinned[self.loaded[name]] += 1
                out.append((self.loaded[name], scale))
            return out

    def release(self, slots) -> None:
        with self._lock:
            for slot, _ in slots:
                self.pinned[slot] -= 1

    def health(self) -> dict:
        return {"mixes_in_a_batch": True, "slots": self.slots, "loaded": list(self.loaded)}

    def use(self, assignment: list | None, device=None) -> None:
        """The next transformer calls' adapters: one [(slot, scale), ...] per sample (None: no LoRA at all),
        written into the buffers in place (`device`: unused; they live with the layers)."""
        import torch

        if not assignment or not any(assignment):
            self.on = False
            return
        if self.idx is None or len(assignment) > self.rows:  # once (the buffers stay where the layers are)
            self.rows = max(self.rows, len(assignment))
            up = next(iter(self.hosts.values())).up
            self.idx = torch.zeros(self.rows, MAX_STACK, dtype=torch.long, device=up.device)
            self.scale = torch.zeros(self.rows, MAX_STACK, dtype=up.dtype, device=up.device)
        pad = [[]] * (self.rows - len(assignment))  # rows past the batch: slot 0 (zeros), scale 0
        idx = [[s for s, _ in a] + [0] * (MAX_STACK - len(a)) for a in (*assignment, *pad)]
        scale = [[c for _, c in a] + [0.0] * (MAX_STACK - len(a)) for a in (*assignment, *pad)]
        self.idx.copy_(torch.tensor(idx, dtype=torch.long), non_blocking=False)
        self.scale.copy_(torch.tensor(scale, dtype=self.scale.dtype), non_blocking=False)
        self.k = 1 if all(len(a) <= 1 for a in assignment) else MAX_STACK
        self.on = True


class EngineAdapters:
    """Per-request LoRAs where the transformer runs from engines or their ONNX (TensorRT, ONNX Runtime), whose
    calls cannot mix adapters: the batcher puts only samples of one LoRA stack in a call (`mixes` False), and
    before the call `use` makes that stack's transformer executors the pipeline's (the transformer and its First-
    Block Cache parts, made by `make(refs)`: the checkpoint's weights with the stack merged as they load, as `run
    --lora --weights` does). Up to `keep` stacks are kept (the request-less stack always), the least recently used
    dropped. Names, files and GET /v1/loras are the bank's (LoraBank, never attached)."""

    mixes = False

    def __init__(self, bank: LoraBank, executors: dict, make, keep: int):
        import collections

        self.bank, self.executors, self.make, self.keep = bank, executors, make, max(1, int(keep))
        from ..components import family

        self.base = {n: ex for n, ex in executors.items() if family(n) == "transformer"}
        self.stacks: collections.OrderedDict = collections.OrderedDict()  # stack -> {name: executor}
        self.slots = 0

    def __getattr__(self, name):  # names, listing, path, check, folder: the bank's
        return getattr(self.__dict__["bank"], name)

    @property
    def loaded(self) -> list:
        return sorted({n for stack in self.stacks for n, _ in stack})

    def acquire(self, loras) -> tuple:
        """A request's stack ((name, scale), ...): it is the batcher's grouping key; nothing waits for a slot."""
        return tuple(loras)

    def release(self, slots) -> None:
        pass

    def use(self, assignment: list | None, device=None) -> None:
        """The next call's stack: every sample of a call has the same one (empty: the engines' own weights)."""
        if assignment is None:
            return  # the last stack stays active: the next call of the same stack needs no change
        stacks = {tuple(a) for a in assignment}
        if len(stacks) > 1:
            raise FluxtrtError("a transformer call on engines got samples with different LoRAs (a batcher bug)")
        stack = stacks.pop()
        if not stack:
            chosen = self.base
        else:
            if stack not in self.stacks:
                refs = [LoraRef(self.bank.path(name), scale) for name, scale in stack]
                while len(self.stacks) >= self.keep:
                    for ex in self.stacks.popitem(last=False)[1].values():
                        ex.deactivate()
                self.stacks[stack] = self.make(refs)
            self.stacks.move_to_end(stack)
            chosen = self.stacks[stack]
        self.executors.update(chosen)

    def health(self) -> dict:
        return {"mixes_in_a_batch": False, "stacks_kept": self.keep, "loaded": self.loaded}


def _mixed_lora(base, bank: LoraBank, ranks: dict, *, span: tuple, slots: int, dtype, device):
    """`base` plus, per sample, the low-rank terms of its adapters' slots (LoraBank), added in place to the output
    columns `span` (lo, hi) that the adapters can touch."""
    import torch

    from ..kernels.lora_add import lora_add_

    rank = sum(ranks.values())
    columns, col = {}, 0
    for layer, r in ranks.items():
        columns[layer] = col
        col += r

    class MixedLora(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base, self.ranks, self.columns, (self.lo, self.hi) = base, ranks, columns, span
            self.in_features, self.out_features = base.in_features, base.out_features
            # slot 0 holds zeros: a sample's unused stack places point there. Both factors are stored rank-major,
            # so a batch's gathered slots are [n, K * rank, features] without a copy
            self.register_buffer("down", torch.zeros(slots + 1, rank, base.in_features, dtype=dtype, device=device))
            self.register_buffer("up", torch.zeros(slots + 1, rank, self.hi - self.lo, dtype=dtype, device=device))

        def clear(self, slot):
            self.down[slot].zero_()
            self.up[slot].zero_()

        def put(self, slot, layer, offset, a, b):
            c, r = self.columns[layer], a.shape[0]
            self.down[slot, c:c + r] = torch.from_numpy(a).to(self.down.device, self.down.dtype)
            at = offset - self.lo
            self.up[slot, c:c + r, at:at + b.shape[0]] = torch.from_numpy(b).to(self.up.device, self.up.dtype).T

        def forward(self, x):
            y = self.base(x)
            if not bank.on:
                return y
            n, k = x.shape[0], bank.k  # a batch padded to its bucket: its padding rows read slot 0 (zeros)
            idx, scale = bank.idx[:n, :k], bank.scale[:n, :k]
            x3 = x.reshape(n, -1, x.shape[-1])
            down = self.down[idx].reshape(n, k * rank, -1)  # [n, K*R, in]
            up = self.up[idx].reshape(n, k * rank, -1)  # [n, K*R, hi - lo]
            h = torch.bmm(x3, down.transpose(1, 2)) * scale.repeat_interleave(rank, dim=1)[:, None, :]
            # in place, on the touched columns only: the product is never materialised (kernels/lora_add.py)
            lora_add_(y, h, up, self.lo, self.hi)
            return y

    return MixedLora()
