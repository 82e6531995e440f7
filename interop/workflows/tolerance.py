"""A comparison's tolerance, checked at the door: a negative one fails everything, a NaN passes nothing
and `max_diff <= nan` is False in a way a reader of the verdict would not expect."""
from __future__ import annotations

import math

from ..errors import InteropError


def check_tolerance(tolerance: float | None) -> None:
    """None (the default by dtype) or a finite number >= 0; else one line naming the flag."""
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
        raise InteropError(f"--tolerance {tolerance}: must be a finite number >= 0")
