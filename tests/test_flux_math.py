"""FLUX math as pure functions, each compared with diffusers' own implementation on fresh random data."""

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as diffusers_shift

from fluxtrt import flux_math as fm

DEV = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
           base_image_seq_len=256, max_image_seq_len=4096)
SCHNELL = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


@pytest.mark.parametrize("b,c,h,w", [(1, 16, 128, 128), (2, 4, 8, 12), (3, 16, 64, 96)])
def test_pack_unpack_match_diffusers(b, c, h, w):
    x = torch.randn(b, c, h, w)
    packed = fm.pack_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, b, c, h, w))
    px_h, px_w = h * 8, w * 8
    assert torch.equal(fm.unpack_latents(packed, px_h, px_w, 8), FluxPipeline._unpack_latents(packed, px_h, px_w, 8))
    assert torch.equal(fm.unpack_latents(packed, px_h, px_w, 8), x)


@pytest.mark.parametrize("h,w", [(64, 64), (4, 6), (48, 80)])
def test_image_ids_match_diffusers(h, w):
    assert torch.equal(fm.latent_image_ids(h, w), FluxPipeline._prepare_latent_image_ids(1, h, w, "cpu", torch.float32))


@pytest.mark.parametrize("seq", [24, 256, 1024, 4096, 9216])
def test_shift_matches_diffusers(seq):
    assert fm.calculate_shift(seq) == diffusers_shift(seq)


@pytest.mark.parametrize("cfg", [DEV, SCHNELL], ids=["dev", "schnell"])
@pytest.mark.parametrize("steps,seq", [(1, 24), (4, 256), (28, 4096), (50, 2304), (7, 9216)])
def test_sigmas_and_timesteps_match_the_scheduler(cfg, steps, seq):
    sched = FlowMatchEulerDiscreteScheduler(**cfg)
    sigmas_in = np.linspace(1.0, 1 / steps, steps)
    sched.set_timesteps(steps, sigmas=sigmas_in, mu=diffusers_shift(seq))
    timesteps, sigmas = fm.flow_match_sigmas(steps, seq, dict(sched.config))
    assert torch.equal(timesteps, sched.timesteps) and torch.equal(sigmas, sched.sigmas)


def test_euler_steps_match_the_scheduler():
    sched = FlowMatchEulerDiscreteScheduler(**DEV)
    steps = 6
    sched.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=0.8)
    sched.set_begin_index(0)
    _, sigmas = fm.flow_match_sigmas(steps, int((0.8 - 0.5) / ((1.15 - 0.5) / 3840)) + 256, dict(sched.config))
    sigmas = sched.sigmas  # same schedule; compare the step itself
    x_ref = x_ours = torch.randn(2, 24, 16)
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(2, 24, 16)
        x_ref = sched.step(v, t, x_ref, return_dict=False)[0]
        x_ours = fm.euler_step(x_ours, v, sigmas[i + 1] - sigmas[i])
        assert torch.equal(x_ours, x_ref), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_initial_noise_matches_prepare_latents(tiny_dev, dtype):
    """diffusers draws the noise in its pipeline's dtype; a bf16 draw is not the fp32 draw rounded on every
    torch (torch 2.11 gives independent values), so the noise is drawn in the dtype being matched."""
    pipe = tiny_dev.load_pipeline()
    seed = int(np.random.default_rng().integers(0, 2**31))
    for b, h, w in ((1, 64, 64), (2, 64, 96)):
        ref, _ = pipe.prepare_latents(b, 4, h, w, dtype, "cpu", torch.Generator().manual_seed(seed))
        ours = fm.initial_noise(b, 4, h, w, 8, generator=torch.Generator().manual_seed(seed), dtype=dtype)
        assert ours.dtype == torch.float32 and torch.equal(ours, ref.float())


def test_vae_scaling_and_uint8_match_the_pipeline():
    lat = torch.randn(2, 16, 8, 12)
    assert torch.equal(fm.latents_for_vae(lat, 0.3611, 0.1159), (lat / 0.3611) + 0.1159)
    image = torch.rand(2, 3, 64, 96) * 2.4 - 1.2  # includes values outside [-1, 1]
    ref = VaeImageProcessor(vae_scale_factor=16).postprocess(image, output_type="np")
    assert np.array_equal(fm.to_uint8(image), (ref * 255).round().astype("uint8"))
