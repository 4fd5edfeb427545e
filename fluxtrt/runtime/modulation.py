"""The transformer's AdaLN modulation for a whole schedule at once (the PyTorch transformer in `generate`).

Every block's modulation (`norm1.linear`, `norm1_context.linear`, the single blocks' `norm.linear`, `norm_out.linear`)
is a GEMM of one row per image, silu(temb), against 3072 x 18432 (or 9216, 6144) bf16 weights: 77 GEMMs that read
6.4 GB of weights every step for a few kilobytes of output (2.2 ms of the fp8 step at any resolution, on an H200).
temb depends only on the timestep, the guidance and the pooled prompt, all known before the loop starts, so
`ScheduleModulation.rows` computes every step's modulation in one pass over those weights (each GEMM with one row
per step and image), and each step copies its row into a fixed buffer that the layers read instead of computing
(a CUDA graph captures the reads; the copy happens before each replay). The arithmetic is the layers' own: the
same weights and inputs, the rows batched.

Off (every layer computes) for calls without a schedule: the continuous batcher's mixed-step batches, and
context parallelism's followers (never installed there). A layer a LoRA wraps is left computing. The layers stay
nn.Linear (their class is swapped for a subclass), so names, parameters and state dicts are unchanged."""

from __future__ import annotations

MAX_BYTES = 2 << 30  # a schedule's table above this (long schedules of large batches) is not built


def _lookup_linear():
    import torch

    class LookupLinear(torch.nn.Linear):
        """A modulation layer: its columns of the step's row while its schedule is on, else the Linear itself."""

        def forward(self, x):
            owner, offset = self._modulation
            if owner.on:
                return owner.current[: x.shape[0], offset:offset + self.out_features]
            return torch.nn.functional.linear(x, self.weight, self.bias)

    return LookupLinear


class ScheduleModulation:
    """The modulation layers of a diffusers FLUX transformer `module`, reading their columns of `current` while
    `on` (set by Rows.select, cleared by `off`)."""

    _cls = None

    def __init__(self, module):
        import torch

        if ScheduleModulation._cls is None:
            ScheduleModulation._cls = _lookup_linear()
        self.module, self.on, self.current = module, False, None
        self.buffers: dict = {}  # (rows, dtype) -> the step's row buffer (kept: CUDA graphs captured its address)
        self.layers = []  # (linear, column offset)
        col = 0
        for owner in module.modules():
            linear = getattr(owner, "linear", None)
            if type(owner).__name__.startswith("AdaLayerNorm") and type(linear) is torch.nn.Linear:
                linear.__class__ = ScheduleModulation._cls
                linear._modulation = (self, col)
                self.layers.append((linear, col))
                col += linear.out_features
        self.width = col

    def off(self) -> None:
        self.on = False

    def temb(self, timesteps, feeds: dict, dtype):
        """temb for every (step, image), as the transformer's forward computes it (timestep and guidance in its
        dtype, times 1000): [steps * batch, D]."""
        steps, batch = timesteps.shape[0], feeds["pooled_projections"].shape[0]
        t = timesteps.to(dtype)[:, None].expand(steps, batch).reshape(-1) * 1000
        pooled = feeds["pooled_projections"].to(dtype).repeat(steps, 1)
        embed = self.module.time_text_embed
        if feeds.get("guidance") is None:
            return embed(t, pooled)
        return embed(t, (feeds["guidance"].to(dtype) * 1000).repeat(steps), pooled)

    def rows(self, timesteps, feeds: dict, dtype, padded: int):
        """Every step's modulation for `feeds` (their pooled prompts and guidance) at `timesteps` [steps] (what
        the loop feeds as `timestep`; `padded`: the batch the executor pads a call to), or None where the table
        would exceed MAX_BYTES: a Rows."""
        import torch

        steps, batch = timesteps.shape[0], feeds["pooled_projections"].shape[0]
        elem = torch.empty((), dtype=dtype).element_size()
        if not self.layers or steps * batch * self.width * elem > MAX_BYTES:
            return None
        with torch.inference_mode():
            x = torch.nn.functional.silu(self.temb(timesteps, feeds, dtype)).to(dtype)
            table = torch.empty(steps, batch, self.width, dtype=dtype, device=x.device)
            flat = table.view(steps * batch, self.width)
            for linear, offset in self.layers:
                flat[:, offset:offset + linear.out_features] = torch.nn.functional.linear(x, linear.weight,
                                                                                          linear.bias)
        key = (max(batch, padded), dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.zeros(key[0], self.width, dtype=dtype, device=x.device)
        return Rows(self, table, self.buffers[key])


class Rows:
    """One generation's table [steps, batch, width] and its batch's row buffer: `select(i)` before step i."""

    def __init__(self, owner: ScheduleModulation, table, buffer):
        self.owner, self.table, self.buffer = owner, table, buffer

    def select(self, i: int) -> None:
        self.buffer[: self.table.shape[1]].copy_(self.table[i], non_blocking=True)
        self.owner.current, self.owner.on = self.buffer, True
