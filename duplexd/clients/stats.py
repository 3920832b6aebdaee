"""Summaries of what clients measured (pure)."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float | None:
    """The `q`-th percentile (0-100), linear between the closest ranks; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
