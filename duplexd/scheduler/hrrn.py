"""Which recognizer pass runs next: Highest Response Ratio Next, duration-aware (pure).

One ASR engine serves every session, one pass at a time. A pass's cost grows with its window (Whisper pads
the encoder to 30 s, so a fixed part dominates; the decoder's share grows with the words in the window).
Shortest-first would let a long window wait forever; oldest-first makes every short pass queue behind a long
one. HRRN orders by

    ratio = (waited + cost) / cost

so a short pass goes first at equal waits, and a long one's ratio rises with its wait until it wins: no
starvation. `waited` is the age of the oldest speech the pass will cover (the session's ASR lag), `cost`
comes from `PassCost`, a least-squares line through recent (window seconds, pass seconds) measurements, one
line per kind of pass (`PassCosts`: a preview encodes a shorter input than a full pass).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    key: Hashable
    waited_s: float  # age of the oldest speech the pass would cover
    window_s: float  # audio the pass would transcribe
    preview: bool = False  # a preview pass (a shorter encoder input: its own cost line)


@dataclass(frozen=True, slots=True)
class Choice:
    key: Hashable
    ratios: dict[Hashable, float]  # every candidate's ratio at the moment of choosing


class PassCost:
    """Expected pass seconds for a window: `fixed + per_s * window_s`, fit online."""

    def __init__(self, fixed_s: float = 0.4, per_s: float = 0.02, history: int = 64, min_samples: int = 8) -> None:
        self.fixed_s, self.per_s = fixed_s, per_s
        self._prior = (fixed_s, per_s)
        self._samples: deque[tuple[float, float]] = deque(maxlen=history)
        self._min_samples = min_samples

    def observe(self, window_s: float, elapsed_s: float) -> None:
        self._samples.append((window_s, elapsed_s))
        self._fit()

    @property
    def samples(self) -> list[tuple[float, float]]:
        """The (window seconds, pass seconds) the line is fit through, oldest first."""
        return list(self._samples)

    def __call__(self, window_s: float) -> float:
        return max(1e-3, self.fixed_s + self.per_s * window_s)

    def _fit(self) -> None:
        n = len(self._samples)
        if n < self._min_samples:
            return
        mx = sum(x for x, _ in self._samples) / n
        my = sum(y for _, y in self._samples) / n
        sxx = sum((x - mx) ** 2 for x, _ in self._samples)
        if sxx < 1e-6 * n:  # every window the same length: only the mean is known
            self.fixed_s, self.per_s = my - self._prior[1] * mx, self._prior[1]
            return
        slope = sum((x - mx) * (y - my) for x, y in self._samples) / sxx
        slope = max(0.0, slope)  # noise can tilt the line; a longer window never costs less
        self.fixed_s, self.per_s = my - slope * mx, slope


class PassCosts:
    """A cost line for each kind of pass: a preview encodes a few seconds, a full pass Whisper's 30 s (on
    this CPU ~0.1 s against ~0.35 s for the same window), so one line through both fits neither."""

    def __init__(self, full: PassCost | None = None, preview: PassCost | None = None) -> None:
        self.full = full if full is not None else PassCost()
        self.preview = preview if preview is not None else PassCost(fixed_s=0.1)

    def observe(self, window_s: float, elapsed_s: float, preview: bool = False) -> None:
        (self.preview if preview else self.full).observe(window_s, elapsed_s)

    def __call__(self, window_s: float, preview: bool = False) -> float:
        return (self.preview if preview else self.full)(window_s)


def ratio(candidate: Candidate, cost: PassCosts) -> float:
    c = cost(candidate.window_s, candidate.preview)
    return (max(0.0, candidate.waited_s) + c) / c


def pick(candidates: Sequence[Candidate], cost: PassCosts) -> Choice | None:
    """The candidate with the highest response ratio (the first listed wins a tie)."""
    if not candidates:
        return None
    ratios = {c.key: ratio(c, cost) for c in candidates}
    best = max(candidates, key=lambda c: ratios[c.key])
    return Choice(best.key, ratios)
