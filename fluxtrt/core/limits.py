"""Request limits, one place for every front end (the CLI through api, the HTTP server): numbers past these are
typos or attacks, refused in one line naming the option before any work starts."""

from __future__ import annotations

from ..errors import FluxtrtError

MAX_STEPS = 1000  # diffusers' schedulers have 1000 training timesteps; more steps than that are a typo
MAX_GUIDANCE = 100.0  # distilled guidance and true-CFG scales (FLUX uses 1-30); more is a typo
MAX_CACHE_THRESHOLD = 10.0  # First-Block Cache's relative change; past 1 every step after the first is skipped
MAX_SIDE = 8192  # pixels a side: over any FLUX profile (the engines' own range is checked per request)


def check_number(flag: str, value, lo, hi) -> None:
    """A numeric option is finite and inside lo..hi before any work starts.

    Args: flag: the option's name for the message; value (None: not given); lo, hi: the inclusive range.
    Returns: None. Raises: FluxtrtError naming the flag and the bound it crosses."""
    import math

    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise FluxtrtError(f"{flag} must be a finite number, got {value}")
    if value < lo:
        raise FluxtrtError(f"{flag} must be at least {lo}, got {value}")
    if value > hi:
        raise FluxtrtError(f"{flag} must be at most {hi}, got {value}")
