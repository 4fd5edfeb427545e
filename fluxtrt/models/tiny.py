"""The embedded tiny FLUX.1 pipelines: `tiny`, `tiny-schnell` (text-to-image, img2img) and one per other
workflow: `tiny-fill` (FluxFillPipeline), `tiny-control` (FluxControlPipeline), `tiny-kontext` (FluxKontextPipeline).

Real diffusers/transformers classes with small dimensions and deterministic random weights, plus
tokenizers trained offline on the prompts shipped in `fluxtrt/data/prompts.txt` (and shipped themselves). They are written in
diffusers' folder layout into the cache on first use, so everything downstream loads them exactly like a
real FLUX.1-dev / FLUX.1-schnell folder. Images from them are noise: they exist to prove the toolchain.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from .. import __version__

TINY_NAMES = {"tiny": "dev", "tiny-schnell": "schnell", "tiny-fill": "dev", "tiny-control": "dev", "tiny-kontext": "dev"}
TINY_MODEL_CLASSES = {"tiny-fill": "FluxFillPipeline", "tiny-control": "FluxControlPipeline",
                  "tiny-kontext": "FluxKontextPipeline"}  # the rest: FluxPipeline

# Bump when the tiny recipe changes, so caches made by older versions are not reused.
TINY_RECIPE = 4

SEED = 20261130
CLIP_HIDDEN = 32
T5_D_MODEL = 32
LATENT_CHANNELS = 4


def cache_root() -> Path:
    """fluxtrt's cache folder (the tiny models, graph templates, compiled kernels), made if missing: FLUXTRT_CACHE
    with `~` expanded (empty or blank means unset), else ~/.cache/fluxtrt. One line naming FLUXTRT_CACHE when it
    cannot be a writable folder."""
    from ..errors import FluxtrtError

    value = os.environ.get("FLUXTRT_CACHE", "").strip()
    folder = Path(value).expanduser().absolute() if value else Path.home() / ".cache" / "fluxtrt"
    where = f"FLUXTRT_CACHE={value}" if value else f"the cache folder {folder}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FluxtrtError(f"cannot make {where} ({e.strerror}); set FLUXTRT_CACHE to a writable folder") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise FluxtrtError(f"{where} is not writable; set FLUXTRT_CACHE to a writable folder")
    return folder


def tiny_model_dir(name: str) -> Path:
    """Return the folder of the tiny model `name`, creating it on first use."""
    variant = TINY_NAMES[name]
    folder = cache_root() / "models" / f"{name}-r{TINY_RECIPE}"
    if not (folder / "model_index.json").exists():
        write_tiny_pipeline(folder, variant, TINY_MODEL_CLASSES.get(name, "FluxPipeline"))
    return folder


def _tokenizers():
    """The tiny models' tokenizers, trained offline on fluxtrt/data/prompts.txt by
    scripts/train_tiny_tokenizers.py (a BPE for CLIP, a unigram model for T5) and shipped with the package."""
    from transformers import AutoTokenizer

    root = resources.files("fluxtrt.data").joinpath("tokenizers")
    with resources.as_file(root) as folder:
        clip = AutoTokenizer.from_pretrained(folder / "clip", local_files_only=True)
        t5 = AutoTokenizer.from_pretrained(folder / "t5", local_files_only=True)
    return clip, t5


def build_tiny_pipeline(variant: str, model_class: str = "FluxPipeline"):
    """Build a tiny FLUX.1 pipeline of diffusers class `model_class` in memory (deterministic: same weights every
    call). Its transformer takes the workflow's extra channels (core/workflows.py: Fill 16 + 16 + 256, Control 16 + 16)."""
    import diffusers
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from ..core.workflows import WORKFLOWS

    if variant not in ("dev", "schnell"):
        raise ValueError(f"unknown tiny variant {variant!r}")
    clip_tok, t5_tok = _tokenizers()

    torch.manual_seed(SEED)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=CLIP_HIDDEN, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, projection_dim=CLIP_HIDDEN, hidden_act="quick_gelu",
            bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id,
        )
    )
    torch.manual_seed(SEED + 1)
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok), d_model=T5_D_MODEL, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
            is_encoder_decoder=False, use_cache=False, pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id,
        )
    )
    workflow = next(w for w in WORKFLOWS.values() if w.model_class == model_class)
    extra = workflow.extra_channels(LATENT_CHANNELS, 2 ** (4 - 1))  # the VAE below: 4 blocks, scale factor 8
    torch.manual_seed(SEED + 2)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=LATENT_CHANNELS * 4 + extra, out_channels=LATENT_CHANNELS * 4 if extra else None,
        num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=T5_D_MODEL, pooled_projection_dim=CLIP_HIDDEN,
        guidance_embeds=(variant == "dev"), axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(SEED + 3)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
        latent_channels=LATENT_CHANNELS, norm_num_groups=4, sample_size=64, scaling_factor=0.3611,
        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )
    if variant == "dev":
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        )
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    return getattr(diffusers, model_class)(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=clip_tok,
        text_encoder_2=text_encoder_2, tokenizer_2=t5_tok, transformer=transformer,
    )


def write_tiny_pipeline(folder: Path, variant: str, model_class: str = "FluxPipeline") -> Path:
    """Write the tiny pipeline in diffusers layout to `folder`, atomically (temp folder + rename)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    pipe = build_tiny_pipeline(variant, model_class)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        (tmp / "fluxtrt_tiny.json").write_text(
            json.dumps({"variant": variant, "recipe": TINY_RECIPE, "fluxtrt": __version__}, indent=1) + "\n"
        )
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "model_index.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
