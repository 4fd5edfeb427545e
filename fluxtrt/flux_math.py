"""FLUX.1 pipeline math as pure functions, reproducing diffusers' FluxPipeline and
FlowMatchEulerDiscreteScheduler exactly (tests compare each with diffusers' own). Imports no backend."""

from __future__ import annotations

import math

import numpy as np
import torch


def latent_image_ids(packed_height: int, packed_width: int) -> torch.Tensor:
    """[h*w, 3] float32 position ids of the packed latent grid: (0, row, col)."""
    ids = torch.zeros(packed_height, packed_width, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(packed_height)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(packed_width)[None, :]
    return ids.reshape(packed_height * packed_width, 3)


def text_ids(length: int) -> torch.Tensor:
    """[T, 3] float32 text position ids: all zeros in FLUX.1."""
    return torch.zeros(length, 3)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: 2x2 patches packed into the channel axis."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, height: int, width: int, vae_scale_factor: int) -> torch.Tensor:
    """[B, N, 4C] -> [B, C, H/8, W/8] for an image of height x width pixels."""
    b, _, channels = latents.shape
    h = 2 * (int(height) // (vae_scale_factor * 2))
    w = 2 * (int(width) // (vae_scale_factor * 2))
    latents = latents.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, channels // 4, h, w)


def initial_noise(batch: int, latent_channels: int, height: int, width: int, vae_scale_factor: int,
                  *, generator: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """The packed starting latents (fp32), drawn from a CPU generator exactly as diffusers' prepare_latents does
    in a pipeline of `dtype`: its randn_tensor draws in that dtype, and torch's CPU generator gives a bf16
    draw other values than an fp32 one (measured: torch 2.11, independent noise; torch 2.13 rounds the fp32
    draw), so the dtype is part of what a seed means."""
    h = 2 * (int(height) // (vae_scale_factor * 2))
    w = 2 * (int(width) // (vae_scale_factor * 2))
    noise = torch.randn((batch, latent_channels, h, w), generator=generator, device="cpu", dtype=dtype)
    return pack_latents(noise.float())


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """mu for resolution-dependent timestep shifting (linear in the image token count)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


SCHEDULER_NUMBERS = {"num_train_timesteps": (1, 1 << 20), "shift": (1e-3, 1e3), "base_shift": (-100.0, 100.0),
                     "max_shift": (-100.0, 100.0), "base_image_seq_len": (1, 1 << 24), "max_image_seq_len": (1, 1 << 24)}


def check_scheduler_config(cfg) -> None:
    """ValueError naming the entry unless `cfg` (scheduler_config.json, read from a folder we did not write) is an
    object whose numbers flow_match_sigmas reads are finite and in range, and whose options it supports."""
    if not isinstance(cfg, dict):
        raise ValueError("it is not a JSON object")
    for key, (lo, hi) in SCHEDULER_NUMBERS.items():
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or not lo <= v <= hi):
            raise ValueError(f"{key} is {v!r}, not a number in {lo}..{hi}")
    if cfg.get("use_dynamic_shifting") and cfg.get("base_image_seq_len", 256) == cfg.get("max_image_seq_len", 4096):
        raise ValueError("base_image_seq_len equals max_image_seq_len (the shift's slope divides by their difference)")
    unsupported = [k for k in ("shift_terminal", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                               "invert_sigmas", "stochastic_sampling", "use_flow_sigmas") if cfg.get(k)]
    if unsupported or cfg.get("time_shift_type", "exponential") != "exponential":
        raise ValueError(f"scheduler options not supported by fluxtrt's runtime: {unsupported or cfg['time_shift_type']}")


def flow_match_sigmas(num_steps: int, image_seq_len: int, scheduler_config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps [N], sigmas [N+1]) as FluxPipeline + FlowMatchEulerDiscreteScheduler.set_timesteps make them:
    sigmas = linspace(1, 1/N, N), shifted (dynamic: exp(mu)/(exp(mu) + (1/s - 1)); static: shift*s/(1+(shift-1)s)),
    timesteps = sigmas * 1000, and a final 0 appended to sigmas. float32 throughout, like diffusers."""
    cfg = scheduler_config
    check_scheduler_config(cfg)
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
    if cfg.get("use_dynamic_shifting", False):
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
    else:
        shift = cfg.get("shift", 1.0)
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    sigmas = torch.from_numpy(sigmas).to(dtype=torch.float32)
    timesteps = sigmas * cfg.get("num_train_timesteps", 1000)
    return timesteps, torch.cat([sigmas, torch.zeros(1)])


def euler_step(sample: torch.Tensor, model_output: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """x_next = x + (sigma_next - sigma) * v, computed in fp32, returned in the model output's dtype."""
    return (sample.to(torch.float32) + dt * model_output).to(model_output.dtype)


def latents_for_vae(latents: torch.Tensor, scaling_factor: float, shift_factor: float) -> torch.Tensor:
    return latents / scaling_factor + shift_factor


def to_uint8(image: torch.Tensor) -> np.ndarray:
    """VAE output [B, 3, H, W] in [-1, 1] -> [B, H, W, 3] uint8, as diffusers' image processor does (the same
    float32 operations, computed where the image is: only the uint8 bytes cross to the host)."""
    image = (image.float() * 0.5 + 0.5).clamp(0, 1)
    return (image * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
