"""Network loss and delay models for benchmarking token-streaming transports over UDP (the pure core).

A `LossModel` decides, packet by packet, whether a packet is lost: `Bernoulli` (independent losses),
`GilbertElliott` (two-state Markov bursts) or `Trace` (a recorded pattern replayed). A `Link` is one
direction of a path: a loss model plus a one-way delay of rtt/2 with uniform jitter. Everything here is
seeded (`random.Random`, never the global generator) and takes the time as an argument, so a run with the
same seeds and the same packet sequence loses the same packets. `relay.py` is the asyncio shell.

Loss specs (`parse_loss`, `LinkConfig.loss`):

- `none`: nothing lost;
- `bernoulli:P`: each packet lost with probability P in [0, 1];
- `ge:MEAN_LOSS:BURST_PACKETS`: Gilbert-Elliott with that stationary loss rate and mean burst length;
- `outage:MEAN_LOSS:BURST_MS`: Gilbert-Elliott in time: the path alternates between up and down periods
  (exponential, the down ones `BURST_MS` long on average, the share of time down `MEAN_LOSS`); every packet
  sent while it is down is lost, however many there are (a fade or a handover, as radio links have);
- `trace:PATH`: a trace file (one line per packet, `1` lost, `0` delivered, `#` comments), looped.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class LossModel(Protocol):
    """Decides the fate of packets in order: call `lost()` exactly once per packet."""

    def lost(self) -> bool: ...


class Outages:
    """Loss in time, not per packet: a two-state (up/down) continuous-time Markov chain; a packet is lost
    when it is sent while the path is down. `lost_at(now)` needs non-decreasing times."""

    def __init__(self, mean_loss: float, burst_ms: float, seed: int) -> None:
        _require_probability("outage mean_loss", mean_loss)
        if mean_loss >= 1.0 or not (math.isfinite(burst_ms) and burst_ms > 0):
            raise ValueError(f"outage needs mean_loss < 1 and burst_ms > 0, got {mean_loss!r}, {burst_ms!r}")
        self.mean_loss = mean_loss
        self._down_s = burst_ms / 1000.0
        self._up_s = self._down_s * (1.0 - mean_loss) / mean_loss if mean_loss > 0 else math.inf
        self._rng = random.Random(seed)
        self._down = False
        self._until: float | None = None  # when the current period ends

    def lost(self) -> bool:
        raise TypeError("Outages decides by time: call lost_at(now)")

    def lost_at(self, now: float) -> bool:
        if self.mean_loss == 0:
            return False
        if self._until is None:  # start in the stationary distribution
            self._down = self._rng.random() < self.mean_loss
            self._until = now + self._period()
        while now >= self._until:
            self._down = not self._down
            self._until += self._period()
        return self._down

    def _period(self) -> float:
        return self._rng.expovariate(1.0 / (self._down_s if self._down else self._up_s))


def _require_probability(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")


class Bernoulli:
    """Each packet is lost independently with probability `p`."""

    __slots__ = ("_p", "_rng")

    def __init__(self, p: float, seed: int) -> None:
        _require_probability("p", p)
        self._p = float(p)
        self._rng = random.Random(seed)

    @property
    def mean_loss(self) -> float:
        return self._p

    def lost(self) -> bool:
        return self._rng.random() < self._p


class GilbertElliott:
    """Two-state Markov loss: a good and a bad state, each with its own loss probability.

    The state of a packet decides its loss; the chain then moves (good->bad with `p_good_bad`, bad->good with
    `p_bad_good`) before the next packet. The first state is drawn from the stationary distribution, so the
    expected loss rate is `mean_loss` from the first packet on. With `loss_good=0` and `loss_bad=1` a burst of
    losses is exactly a stay in the bad state: geometric, of mean length `1 / p_bad_good` packets.
    """

    __slots__ = ("_bad", "_loss_bad", "_loss_good", "_p_bad_good", "_p_good_bad", "_rng")

    def __init__(
        self,
        p_good_bad: float,
        p_bad_good: float,
        seed: int,
        loss_good: float = 0.0,
        loss_bad: float = 1.0,
    ) -> None:
        for name, value in (
            ("p_good_bad", p_good_bad),
            ("p_bad_good", p_bad_good),
            ("loss_good", loss_good),
            ("loss_bad", loss_bad),
        ):
            _require_probability(name, value)
        if p_good_bad + p_bad_good <= 0.0:
            raise ValueError("p_good_bad + p_bad_good must be > 0 (else the chain never moves), got 0")
        self._p_good_bad = float(p_good_bad)
        self._p_bad_good = float(p_bad_good)
        self._loss_good = float(loss_good)
        self._loss_bad = float(loss_bad)
        self._rng = random.Random(seed)
        self._bad = self._rng.random() < self.bad_fraction

    @classmethod
    def from_mean(cls, loss: float, burst_packets: float, seed: int) -> GilbertElliott:
        """The chain with stationary loss rate `loss` and mean burst length `burst_packets` (losses always in
        the bad state, never in the good one)."""
        if not (isinstance(loss, int | float) and 0.0 <= loss < 1.0):
            raise ValueError(f"loss must be in [0, 1), got {loss!r}")
        if not (isinstance(burst_packets, int | float) and math.isfinite(burst_packets) and burst_packets >= 1.0):
            raise ValueError(f"burst_packets must be a finite number >= 1, got {burst_packets!r}")
        p_bad_good = 1.0 / burst_packets
        # Stationary P(bad) = p_gb / (p_gb + p_bg) = loss  <=>  p_gb = p_bg * loss / (1 - loss).
        p_good_bad = p_bad_good * loss / (1.0 - loss)
        if p_good_bad > 1.0:
            raise ValueError(
                f"loss {loss!r} with bursts of {burst_packets!r} packets needs good runs shorter than one packet; "
                "use longer bursts or a lower loss"
            )
        return cls(p_good_bad, p_bad_good, seed)

    @property
    def bad_fraction(self) -> float:
        """The stationary probability of the bad state."""
        return self._p_good_bad / (self._p_good_bad + self._p_bad_good)

    @property
    def mean_loss(self) -> float:
        bad = self.bad_fraction
        return (1.0 - bad) * self._loss_good + bad * self._loss_bad

    @property
    def mean_burst_packets(self) -> float:
        """The mean stay in the bad state (the mean loss burst when loss_good=0 and loss_bad=1)."""
        return math.inf if self._p_bad_good == 0.0 else 1.0 / self._p_bad_good

    def lost(self) -> bool:
        rng = self._rng
        lost = rng.random() < (self._loss_bad if self._bad else self._loss_good)
        if self._bad:
            self._bad = not (rng.random() < self._p_bad_good)
        else:
            self._bad = rng.random() < self._p_good_bad
        return lost


class Trace:
    """Replays a recorded per-packet pattern (`True` = lost). Looped by default; without `loop`, packets after
    the end of the pattern are delivered."""

    __slots__ = ("_loop", "_next", "_pattern")

    def __init__(self, pattern: Sequence[bool], loop: bool = True) -> None:
        if len(pattern) == 0:
            raise ValueError("a loss trace needs at least one packet, got an empty pattern")
        self._pattern = tuple(bool(x) for x in pattern)
        self._loop = loop
        self._next = 0

    @property
    def pattern(self) -> tuple[bool, ...]:
        return self._pattern

    @property
    def mean_loss(self) -> float:
        """The lost fraction of the pattern (of one loop)."""
        return sum(self._pattern) / len(self._pattern)

    def lost(self) -> bool:
        i = self._next
        if i >= len(self._pattern):
            if not self._loop:
                return False
            i = 0
        self._next = i + 1
        return self._pattern[i]

    @classmethod
    def load(cls, path: str | Path, loop: bool = True) -> Trace:
        """Reads a trace file: one line per packet, `1` lost or `0` delivered; blank lines and `#` comments
        (whole lines or after the value) are ignored."""
        pattern: list[bool] = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                value = line.split("#", 1)[0].strip()
                if not value:
                    continue
                if value not in ("0", "1"):
                    raise ValueError(f"{path}: line {number}: expected 0 (delivered) or 1 (lost), got {value!r}")
                pattern.append(value == "1")
        if not pattern:
            raise ValueError(f"{path}: the trace has no packets")
        return cls(pattern, loop=loop)

    @staticmethod
    def record(model: LossModel, n: int) -> list[bool]:
        """The next `n` decisions of `model` (which they advance), to save and replay."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n!r}")
        return [model.lost() for _ in range(n)]

    @staticmethod
    def save(path: str | Path, pattern: Sequence[bool], comment: str = "") -> None:
        """Writes `pattern` in the format `load` reads, with `comment` (e.g. the spec it came from) on top."""
        lines = [f"# {c}" if c else "#" for c in comment.splitlines()]
        lines += ["1" if x else "0" for x in pattern]
        Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def parse_loss(spec: str, seed: int) -> LossModel:
    """The loss model of a spec: `none`, `bernoulli:P`, `ge:MEAN_LOSS:BURST_PACKETS` or `trace:PATH`."""
    kind, _, rest = spec.partition(":")
    try:
        if kind == "none" and not rest:
            return Bernoulli(0.0, seed)
        if kind == "bernoulli":
            return Bernoulli(_number(rest), seed)
        if kind == "ge":
            mean, _, burst = rest.partition(":")
            return GilbertElliott.from_mean(_number(mean), _number(burst), seed)
        if kind == "outage":
            mean, _, burst = rest.partition(":")
            return Outages(_number(mean), _number(burst), seed)  # type: ignore[return-value]
        if kind == "trace":
            if not rest:
                raise ValueError("no path")
            return Trace.load(rest)
    except (ValueError, OSError) as e:
        raise ValueError(f"bad loss spec {spec!r}: {e}") from e
    raise ValueError(
        f"bad loss spec {spec!r}: expected none, bernoulli:P, ge:MEAN_LOSS:BURST_PACKETS, "
        "outage:MEAN_LOSS:BURST_MS or trace:PATH"
    )


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def _require_ms(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """One direction of a simulated path: its loss spec and its delay (each direction adds rtt/2)."""

    loss: str = "none"
    rtt_ms: float = 0
    jitter_ms: float = 0  # each packet's one-way delay moves by a uniform draw in [-jitter, +jitter]
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.loss, str):
            raise ValueError(f"link.loss must be a loss spec string, got {self.loss!r}")
        try:
            parse_loss(self.loss, 0)
        except ValueError as e:
            raise ValueError(f"link.loss is not a valid loss spec, got {self.loss!r} ({e})") from None
        _require_ms("link.rtt_ms", self.rtt_ms)
        _require_ms("link.jitter_ms", self.jitter_ms)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"link.seed must be an int, got {self.seed!r}")


def _derive_seed(seed: int, offset: int, stream: str) -> int:
    """An independent, reproducible 64-bit seed per (seed, direction, use)."""
    digest = hashlib.blake2b(f"{seed}/{offset}/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Link:
    """One direction of a path. `admit(now)` decides one packet: its delivery time, or None when it is lost.

    Delays are rtt/2 plus a uniform jitter, clipped at zero; with jitter, later packets may overtake earlier
    ones (on purpose: real paths reorder). The two directions of a path use different `direction_seed_offset`s
    so that their losses and jitter are independent.
    """

    __slots__ = ("_base_delay_s", "_jitter_rng", "_jitter_s", "config", "model")

    def __init__(self, config: LinkConfig, direction_seed_offset: int) -> None:
        self.config = config
        self.model: LossModel = parse_loss(config.loss, _derive_seed(config.seed, direction_seed_offset, "loss"))
        self._jitter_rng = random.Random(_derive_seed(config.seed, direction_seed_offset, "jitter"))
        self._base_delay_s = config.rtt_ms / 2000.0
        self._jitter_s = config.jitter_ms / 1000.0

    def admit(self, now: float) -> float | None:
        if self.model.lost_at(now) if isinstance(self.model, Outages) else self.model.lost():
            return None
        delay_s = self._base_delay_s
        if self._jitter_s > 0.0:
            delay_s = max(0.0, delay_s + self._jitter_rng.uniform(-self._jitter_s, self._jitter_s))
        return now + delay_s
