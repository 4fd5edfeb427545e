"""Resolve a --model argument to a local FLUX.1 diffusers folder and load its parts. Never downloads."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..components import Geometry
from ..errors import FluxtrtError, ModelSourceError
from .random_arch import MARKER as RANDOM_MARKER
from .random_arch import RANDOM_NAMES, random_component, random_model_dir
from .tiny import TINY_MODEL_CLASSES, TINY_NAMES, tiny_model_dir

REQUIRED = ("transformer", "text_encoder", "text_encoder_2", "vae", "tokenizer", "tokenizer_2", "scheduler")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """A local FLUX.1 pipeline folder in diffusers layout."""

    id: str  # what the user passed ("tiny", or the folder)
    path: Path

    @cached_property
    def geometry(self) -> Geometry:
        try:
            return Geometry.from_folder(self.path)
        except FluxtrtError as e:
            raise ModelSourceError(f"{self.path} does not look like a FLUX.1 model: {e}") from None
        except (KeyError, OSError, json.JSONDecodeError) as e:
            raise ModelSourceError(
                f"{self.path} does not look like a FLUX.1 model: its config files lack {e}; "
                "pass a FLUX.1-dev or FLUX.1-schnell folder in diffusers layout"
            ) from None

    @property
    def random_weights(self) -> bool:
        """Architecture-only (`random:...`): components are instantiated from configs, nothing is loaded."""
        return (self.path / RANDOM_MARKER).exists()

    @property
    def embedded(self) -> bool:
        """One of fluxtrt's own random-weight models (tiny..., random:...), written to the cache folder."""
        return self.id in TINY_NAMES or self.id in RANDOM_NAMES

    @property
    def variant(self) -> str:
        return self.geometry.variant

    @cached_property
    def content_hash(self) -> str:
        """sha256 over every file's relative path and content (cached by size and mtime for big files)."""
        h = hashlib.sha256(self.id.encode() if self.random_weights else b"")
        for f in sorted(p for p in self.path.rglob("*") if p.is_file()):
            rel = f.relative_to(self.path).as_posix()
            if rel.startswith(".") or "/." in rel:
                continue
            h.update(rel.encode() + b"\0" + file_sha256(f).encode() + b"\n")
        return h.hexdigest()

    @cached_property
    def layout_hash(self) -> str:
        """sha256 over every file's relative path, size and mtime, the contents of small files (configs,
        tokenizers) and the headers of safetensors files: the model's identity without reading its weights."""
        from ..checkpoint import read_header

        h = hashlib.sha256(b"layout\0")
        for f in sorted(p for p in self.path.rglob("*") if p.is_file()):
            rel = f.relative_to(self.path).as_posix()
            if rel.startswith(".") or "/." in rel:
                continue
            st = f.stat()
            h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            if f.suffix == ".safetensors":
                h.update(repr(sorted((k, t.dtype, t.shape, t.offset) for k, t in read_header(f).items())).encode())
            elif st.st_size < 1 << 20:
                h.update(file_sha256(f).encode())
        return h.hexdigest()

    def load_component(self, subfolder: str, dtype=None, device="cpu"):
        """Load one diffusers/transformers module from the folder (eval mode)."""
        import torch

        if self.random_weights:
            return random_component(subfolder, self.path, dtype or torch.float32, device)
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        classes = {
            "text_encoder": CLIPTextModel, "text_encoder_2": T5EncoderModel,
            "transformer": FluxTransformer2DModel, "vae": AutoencoderKL,
        }
        kwargs = {"torch_dtype": dtype or torch.float32}
        model = classes[subfolder].from_pretrained(self.path / subfolder, local_files_only=True, **kwargs)
        return model.to(device).eval()

    def load_pipeline(self, dtype=None, device="cpu", diffusers_pipeline: str | None = None):
        """The reference diffusers pipeline: the model's own class (model_index.json), or `diffusers_pipeline` (e.g.
        FluxImg2ImgPipeline on a FLUX.1-dev folder)."""
        import diffusers
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.utils import logging as dlog

        dlog.disable_progress_bar()
        dtype = dtype or torch.float32
        cls = getattr(diffusers, diffusers_pipeline or self.geometry.model_class)
        if not self.random_weights:
            return cls.from_pretrained(self.path, local_files_only=True, torch_dtype=dtype).to(device)
        clip_tok, t5_tok = self.load_tokenizers()
        parts = {k: self.load_component(k, dtype, device) for k in ("transformer", "text_encoder", "text_encoder_2", "vae")}
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config())
        return cls(scheduler=scheduler, tokenizer=clip_tok, tokenizer_2=t5_tok, **parts)

    def load_tokenizers(self):
        from transformers import AutoTokenizer

        return (
            AutoTokenizer.from_pretrained(self.path / "tokenizer", local_files_only=True),
            AutoTokenizer.from_pretrained(self.path / "tokenizer_2", local_files_only=True),
        )

    def scheduler_config(self) -> dict:
        return json.loads((self.path / "scheduler" / "scheduler_config.json").read_text())

    def vae_config(self) -> dict:
        return json.loads((self.path / "vae" / "config.json").read_text())


_HASH_CACHE: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASH_CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _HASH_CACHE[key] = h.hexdigest()
    return _HASH_CACHE[key]


def resolve_model(model: str | Path) -> ModelSource:
    """`tiny`, `tiny-schnell`, or a local folder. A hub id is refused with the fix."""
    name = str(model)
    if name in TINY_NAMES:
        return ModelSource(id=name, path=tiny_model_dir(name))
    if name in RANDOM_NAMES:
        return ModelSource(id=name, path=random_model_dir(name))
    if name.startswith("random:"):
        raise ModelSourceError(f"unknown architecture '{name}'; choose {', '.join(RANDOM_NAMES)}")
    path = Path(name).expanduser()
    if not path.exists():
        if _HUB_ID.match(name) and not name.startswith((".", "/")):
            raise ModelSourceError(
                f"'{name}' looks like a Hugging Face hub id; fluxtrt never downloads weights. Download it yourself "
                f"(e.g. `hf download {name} --local-dir ./{name.split('/')[-1]}`) and pass --model ./{name.split('/')[-1]}"
            )
        raise ModelSourceError(f"model folder '{name}' does not exist; pass a local FLUX.1 folder, or --model tiny")
    if not path.is_dir():
        raise ModelSourceError(f"'{name}' is a file; pass the FLUX.1 model folder (the one holding model_index.json)")
    missing = [c for c in REQUIRED if not (path / c).is_dir()]
    if missing:
        raise ModelSourceError(
            f"'{name}' is missing the component folder(s) {', '.join(missing)}; a FLUX.1 folder in diffusers layout "
            f"has {', '.join(REQUIRED)}"
        )
    src = ModelSource(id=name, path=path.resolve())
    _ = src.geometry  # validate configs now, with a clear error
    from ..core.workflows import check_model

    check_model(src.geometry)
    check_safetensors(src.path)
    return src


def check_safetensors(folder: Path) -> None:
    """Every shard's header fits its file: a truncated download is one line now, not a traceback later."""
    from ..checkpoint import read_header

    for shard in sorted(folder.glob("*/*.safetensors")):
        read_header(shard)  # raises naming the file and its size


def check_model_ref(ref, geo: Geometry, workflows) -> None:
    """An engine folder's manifest says which model its engines are of (`model`: id, variant, model class) and what
    they serve (`workflows`); all of it is untrusted (a manifest is a text file anyone can edit). It must agree
    with the model assets copied beside the engines (`geo`, from model/) and, for an embedded model's name, with
    that model. One line naming the field otherwise."""
    from ..core.workflows import for_model

    fix = "rebuild with `fluxtrt build` or unpack the archive again"
    if ref.model_class != geo.model_class or ref.variant != geo.variant:
        raise ModelSourceError(f"the manifest's model is a {ref.variant} {ref.model_class}, but the engines' model assets "
                               f"are a {geo.variant} {geo.model_class} (an edited manifest?); {fix}")
    if ref.id in TINY_NAMES and (TINY_NAMES[ref.id], TINY_MODEL_CLASSES.get(ref.id, "FluxPipeline")) != (
            ref.variant, ref.model_class):
        raise ModelSourceError(f"the manifest names the model {ref.id!r}, whose engines are a "
                               f"{TINY_NAMES[ref.id]} {TINY_MODEL_CLASSES.get(ref.id, 'FluxPipeline')}, but its engines "
                               f"are a {ref.variant} {ref.model_class} (an edited manifest?); {fix}")
    served = sorted(w.name for w in for_model(geo))
    if sorted(workflows) != served:
        raise ModelSourceError(f"the manifest's workflows {sorted(workflows)} are not what a {geo.model_class} serves "
                               f"({', '.join(served)}); {fix}")
