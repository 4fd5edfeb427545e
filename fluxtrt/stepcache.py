"""First-Block Cache with diffusers' semantics (diffusers/hooks/first_block_cache.py, 0.42), one implementation
for every executor: the transformer runs as three parts (components.py: transformer_head, transformer_tail,
transformer_out) and this decides at each step whether the tail runs.

- The head (embeddings and the first block) runs every step; its residual is the first block's image-stream
  output minus its input.
- The tail runs on the first step of a branch, and whenever mean|r - r_prev| / mean|r_prev| > threshold, where
  r_prev is the head residual of the last step that ran the tail (the metric is over the whole batch of that
  call, as diffusers computes it over its batch). Then the cache keeps tail output - head output.
- Otherwise the step uses head output + the kept residual in place of the tail's output.
- The part after the blocks (norm_out, proj_out) runs every step. There is no special last step.
- Each branch keeps its own state, as diffusers' `cache_context("cond")` / `("uncond")` (true CFG's negative
  prompts are the second branch); the state lives for one generation.
- threshold 0 turns the cache off: the uncached single-call transformer runs, bit for bit.

The decision reads one number from the device per step (the hook's `.item()`)."""

from __future__ import annotations

from dataclasses import dataclass, field


def relative_change(residual, previous) -> float:
    """diffusers' metric: mean |r - r_prev| / mean |r_prev|, in the tensors' dtype, read to the host."""
    return float(((residual - previous).abs().mean() / previous.abs().mean()).item())


@dataclass
class BranchState:
    head_residual: object = None  # the head residual of the last step that ran the tail
    tail_residual: object = None  # tail output - head output of that step


@dataclass
class FirstBlockCache:
    """The cache of one generation (or one served request): `threshold` and a state per branch."""

    threshold: float
    computed: int = 0
    skipped: int = 0
    branches: dict = field(default_factory=dict)

    def must_compute(self, branch: str, head_residual) -> bool:
        state = self.branches.setdefault(branch, BranchState())
        return state.head_residual is None or relative_change(head_residual, state.head_residual) > self.threshold

    def keep(self, branch: str, head_residual, head_hidden, tail_hidden) -> None:
        state = self.branches.setdefault(branch, BranchState())
        state.head_residual, state.tail_residual = head_residual, tail_hidden - head_hidden

    def cached(self, branch: str, head_hidden):
        return self.branches[branch].tail_residual + head_hidden

    def record(self, branch: str, compute: bool) -> None:
        """Count a step (the first branch's: a true-CFG step counts once)."""
        if branch == "cond":
            self.computed, self.skipped = self.computed + compute, self.skipped + (not compute)

    def summary(self) -> dict:
        return {"threshold": self.threshold, "computed": self.computed, "skipped": self.skipped}
