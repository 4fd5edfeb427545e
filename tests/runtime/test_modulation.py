"""runtime/modulation.py: every step's AdaLN modulation computed before the loop, read by the layers."""

import pytest
import torch

from fluxtrt.components import ShapePoint
from fluxtrt.runtime.assembly import open_pipeline


@pytest.fixture(scope="module", params=["tiny", "tiny-schnell"])
def pipe(request):
    return open_pipeline(None, backend="torch", model=request.param, device="cpu", torch_dtype="fp32")


def layer_outputs(ex, feeds):
    """The transformer's output and every modulation layer's output of one call, in the table's column order."""
    outs = {}
    hooks = [linear.register_forward_hook(lambda m, i, o, k=k: outs.__setitem__(k, o.clone()))
             for k, (linear, _) in enumerate(ex.modulation.layers)]
    try:
        pred = ex.infer(dict(feeds))["noise_pred"].clone()
    finally:
        for h in hooks:
            h.remove()
    return pred, torch.cat([outs[k] for k in range(len(outs))], dim=1)


def test_a_schedules_rows_are_what_the_layers_compute_and_the_call_reading_them_is_the_same(pipe):
    """For fresh random inputs (batch 2) at three random timesteps: row i of the table equals the modulation the
    layers compute in a call at timestep i (fp32, 1e-6 of the largest), and a call reading row i equals the call
    computing it (1e-5). Every AdaLN layer is in the table: 2 per double block, 1 per single block, norm_out."""
    ex = pipe.executors["transformer"]
    ex.activate()
    model = ex.module.model
    assert len(ex.modulation.layers) == 2 * len(model.transformer_blocks) + len(model.single_transformer_blocks) + 1
    feeds = ex.spec.sample_inputs(ShapePoint(2, 128, 128), pipe.geo, int(torch.randint(0, 10_000, ())))
    schedule = torch.rand(3).sort(descending=True).values
    rows = ex.schedule_rows(feeds, schedule)
    for i, t in enumerate(schedule):
        at = dict(feeds, timestep=t.expand(2))
        ex.modulation_off()
        pred, computed = layer_outputs(ex, at)
        assert (rows.table[i] - computed).abs().max() <= 1e-6 * computed.abs().max()
        rows.select(i)
        read = ex.infer(dict(at))["noise_pred"]
        assert (read - pred).abs().max() <= 1e-5 * pred.abs().max()
    ex.modulation_off()


def test_a_generation_reads_its_table_every_step_and_equals_computing_it(pipe, monkeypatch):
    """generate with true CFG (two tables: the negative prompts' pooled embedding differs) and with First-Block
    Cache's parts: the latents equal a generation whose layers compute their modulation (fp32, 1e-5 of the
    largest); every modulation layer call inside the loop reads the table; after it the layers compute again."""
    ex = pipe.executors["transformer"]
    ex.activate()
    reads = []
    hook = ex.modulation.layers[0][0].register_forward_hook(lambda m, i, o: reads.append(ex.modulation.on))
    seed = int(torch.randint(0, 10_000, ()))
    runs = [dict(negative_prompts=["blurry", "dark"], true_cfg=2.0), dict(cache_threshold=0.05)]
    try:
        got = [pipe.generate(["a fox", "a red cat"], 128, 128, 3, seed=seed, trace=True, **kw) for kw in runs]
        calls, after = len(reads), ex.modulation.on
        with monkeypatch.context() as m:
            m.setattr(ex, "schedule_rows", lambda feeds, schedule: None)
            want = [pipe.generate(["a fox", "a red cat"], 128, 128, 3, seed=seed, trace=True, **kw) for kw in runs]
    finally:
        hook.remove()
    assert calls >= 3 * 2 + 3 and all(reads[:calls]) and not any(reads[calls:])
    assert after is False
    for g, w in zip(got, want):
        a, b = g.latents_per_step[-1], w.latents_per_step[-1]
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
