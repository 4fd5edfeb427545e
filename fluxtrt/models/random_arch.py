"""`random:flux.1-dev` / `random:flux.1-schnell`: the real full-size FLUX.1 architecture with random weights,
for measuring at true scale without the gated checkpoint. Images from it are noise.

The folder holds the real component configs, the scheduler config and (stand-in) tokenizers, but no weights:
`ModelSource.load_component` instantiates such components from their config with random initialisation,
directly in the requested dtype and device. The tokenizers are the tiny models' (their ids fit the real
vocabularies), so token ids differ from the real ones: irrelevant for random weights, and said here."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .tiny import TINY_RECIPE, cache_root, tiny_model_dir

RANDOM_NAMES = {"random:flux.1-dev": "dev", "random:flux.1-schnell": "schnell", "random:flux.1-fill-dev": "dev",
                "random:flux.1-canny-dev": "dev", "random:flux.1-depth-dev": "dev", "random:flux.1-kontext-dev": "dev"}
# the tiny model of the same workflow: its model_index.json (pipeline class) is copied
TINY_OF = {"random:flux.1-fill-dev": "tiny-fill", "random:flux.1-canny-dev": "tiny-control",
           "random:flux.1-depth-dev": "tiny-control", "random:flux.1-kontext-dev": "tiny-kontext"}
MARKER = "fluxtrt_random.json"
RANDOM_RECIPE = 2  # bump when the folder written below changes (2: a full model_index.json)

TRANSFORMER = {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64, "num_layers": 19,
               "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
               "joint_attention_dim": 4096, "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56]}
CLIP = {"architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "vocab_size": 49408, "hidden_size": 768,
        "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12, "max_position_embeddings": 77,
        "projection_dim": 768, "hidden_act": "quick_gelu", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
T5 = {"architectures": ["T5EncoderModel"], "model_type": "t5", "vocab_size": 32128, "d_model": 4096, "d_kv": 64,
      "d_ff": 10240, "num_layers": 24, "num_heads": 64, "relative_attention_num_buckets": 32,
      "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu", "is_encoder_decoder": False,
      "use_cache": False, "pad_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False}
VAE = {"_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3,
       "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
       "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 16,
       "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
       "use_quant_conv": False, "use_post_quant_conv": False}
SCHEDULER = {"dev": {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
                     "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                     "base_image_seq_len": 256, "max_image_seq_len": 4096},
             "schnell": {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
                         "shift": 1.0, "use_dynamic_shifting": False}}


def random_model_dir(name: str) -> Path:
    variant = RANDOM_NAMES[name]
    folder = cache_root() / "models" / f"{name.replace(':', '-')}-r{TINY_RECIPE}.{RANDOM_RECIPE}"
    if (folder / MARKER).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tiny = tiny_model_dir("tiny")
        index = tiny_model_dir(TINY_OF.get(name, "tiny")) / "model_index.json"
        for tok in ("tokenizer", "tokenizer_2"):
            shutil.copytree(tiny / tok, tmp / tok)
        transformer = dict(TRANSFORMER, guidance_embeds=variant == "dev")
        if name in TINY_OF:  # the workflow's conditioning channels (Fill: 64 + 64 + 256, Control: 64 + 64)
            from ..core.workflows import WORKFLOWS

            model_class = json.loads(index.read_text())["_class_name"]
            wf = next(w for w in WORKFLOWS.values() if w.model_class == model_class)
            transformer.update(in_channels=64 + wf.extra_channels(16, 8), out_channels=64)
        configs = {"transformer": transformer, "text_encoder": CLIP,
                   "text_encoder_2": T5, "vae": VAE}
        for sub, cfg in configs.items():
            (tmp / sub).mkdir()
            (tmp / sub / "config.json").write_text(json.dumps(cfg, indent=1))
        (tmp / "scheduler").mkdir()
        (tmp / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER[variant], indent=1))
        shutil.copy2(index, tmp / "model_index.json")  # diffusers' pipeline classes load from it
        (tmp / MARKER).write_text(json.dumps({"variant": variant, "weights": "random"}))
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def instantiate(subfolder: str, folder: Path, overrides: dict | None = None):
    """A component built from its config file alone (weights as the class initialises them, in the current
    default dtype and device); `overrides` replaces config entries (e.g. fewer blocks)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    sub = Path(folder) / subfolder
    overrides = overrides or {}
    if subfolder in ("transformer", "vae"):
        cls = FluxTransformer2DModel if subfolder == "transformer" else AutoencoderKL
        return cls.from_config({**cls.load_config(sub), **overrides})
    model_cls, config_cls = (CLIPTextModel, CLIPTextConfig) if subfolder == "text_encoder" else (T5EncoderModel, T5Config)
    return model_cls(config_cls.from_pretrained(sub, local_files_only=True, **overrides))


def random_component(subfolder: str, path: Path, dtype, device="cpu", seed: int = 0):
    """Instantiate a component from its config with random weights, in `dtype` on `device`."""
    import torch

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = instantiate(subfolder, path)
    finally:
        torch.set_default_dtype(old)
    return model.to(dtype).eval()
