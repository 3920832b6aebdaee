"""Batch-invariant matrix multiplies for decode rows: fixed-shape tiles, chosen at load by a self-test.

A GEMM's row results change with the number of rows because the library picks a different blocking (or a
GEMV path) per shape. A row's numbers, and so a session's greedy tokens, must not depend on what shares its
step: that is what makes speculative drafts lossless and replies reproducible. Two ways to keep it:

- **tiles**: decode rows are padded to one of a few tile sizes and multiplied a tile at a time. The tile
  sizes used are ones whose rows this CPU computes bitwise the same whatever the other rows, the row's
  position and the tile size (measured at load on the model's own weights, `self_test`). Where one size
  is all that qualifies, every call has that shape.
- **rowwise**: one row per batch item of a `bmm` (float32) or one call per row (bfloat16): invariant by
  construction, and slow (it gives up the GEMM's blocking).

`choose` measures both on this machine and picks the fastest invariant one; machines differ (one CPU has
fast bfloat16 matmuls and rows equal at every M >= 4, another varies at every M), so nothing is assumed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

TILE_SIZES = (1, 2, 4, 8, 16)  # the sizes tried; the largest is the tile a long step is cut into
PROBE_ROWS = (1, 2, 4, 8, 16)  # the decode batch sizes a choice is timed at


def rowwise_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight)` for `x[N, K]`, computed one row at a time (bitwise batch-invariant).

    float32: one `bmm` whose batch items are single rows (measured bitwise equal to `F.linear` on the row
    alone, at any N). bfloat16 has no fast batched kernel for that shape, so its rows are separate calls.
    """
    if x.dtype != torch.float32:
        if not x.shape[0]:
            return F.linear(x, weight, bias)
        return torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(x.shape[0])])
    n = x.shape[0]
    out = torch.bmm(x.unsqueeze(1), weight.t().expand(n, -1, -1)).squeeze(1)
    return out if bias is None else out + bias


@dataclass(frozen=True, slots=True)
class DecodeLinear:
    """`F.linear` for one-token rows, batch-invariant. `tiles`: the row counts a call may have (rows are
    padded with zeros up to the smallest that holds them; more rows than the largest are cut into tiles of
    the largest); empty: rowwise."""

    tiles: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return "rowwise" if not self.tiles else "tiles " + "/".join(map(str, self.tiles))

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if not self.tiles or not x.shape[0]:
            return rowwise_linear(x, weight, bias)
        n, biggest = x.shape[0], self.tiles[-1]
        outs = []
        for start in range(0, n, biggest):
            part = x[start : start + biggest]
            tile = next(t for t in self.tiles if t >= part.shape[0])
            if tile > part.shape[0]:
                part = torch.cat([part, part.new_zeros(tile - part.shape[0], part.shape[1])])
            outs.append(F.linear(part, weight, bias))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out[:n]


ROWWISE = DecodeLinear()


def invariant_tiles(
    weights: Sequence[tuple[Tensor, Tensor | None]], sizes: Sequence[int] = TILE_SIZES, trials: int = 3
) -> tuple[int, ...]:
    """The tile sizes among `sizes` whose rows are bitwise equal to the largest size's, for every weight,
    whatever the other rows and the row's position (the largest itself included only if it passes that).
    Random rows, a fixed seed: the same test on every start."""
    gen = torch.Generator().manual_seed(0)
    largest = max(sizes)
    keep = set(sizes)
    for weight, bias in weights:
        dim = weight.shape[1]
        for _ in range(trials):
            row = torch.randn(1, dim, generator=gen).to(weight.dtype)
            alone = F.linear(torch.cat([row, row.new_zeros(largest - 1, dim)]), weight, bias)[0]
            for size in sorted(keep):
                others = torch.randn(size, dim, generator=gen).to(weight.dtype)
                position = int(torch.randint(size, (1,), generator=gen))
                others[position] = row[0]
                if not torch.equal(F.linear(others, weight, bias)[position], alone):
                    keep.discard(size)
            if largest not in keep:
                return ()
    return tuple(sorted(keep))


@dataclass(slots=True)
class KernelChoice:
    """What `choose` measured: the kernel, and the milliseconds of one step's matrix multiplies per option
    at each decode batch size (`PROBE_ROWS`)."""

    kernel: DecodeLinear
    step_ms: dict[str, dict[int, float]] = field(default_factory=dict)


def step_ms(
    kernel: DecodeLinear, layers: Sequence[tuple[Tensor, Tensor | None, int]], rows: int, passes: int = 2
) -> float:
    """Milliseconds of one step's decode matrix multiplies for `rows` rows: every weight in turn (times its
    count), as a step streams them; the fastest of `passes` whole passes, after one call per shape to warm."""
    inputs: dict[tuple[int, torch.dtype], Tensor] = {}
    for weight, bias, _ in layers:
        key = (weight.shape[1], weight.dtype)
        if key not in inputs:
            inputs[key] = torch.randn(rows, weight.shape[1]).to(weight.dtype)
            kernel(inputs[key], weight, bias)  # (warm: the first call of a shape allocates)
    best = math.inf
    for _ in range(passes):
        t0 = time.perf_counter()
        for weight, bias, count in layers:
            x = inputs[(weight.shape[1], weight.dtype)]
            for _ in range(count):
                kernel(x, weight, bias)
        best = min(best, time.perf_counter() - t0)
    return 1000 * best


def choose(
    layers: Sequence[tuple[Tensor, Tensor | None, int]],
    timed: Sequence[tuple[Tensor, Tensor | None, int]] | None = None,
) -> KernelChoice:
    """The fastest batch-invariant decode kernel for these weights (`(weight, bias, uses per step)`) on this
    CPU: each invariant tile set (self-tested on `layers`), and rowwise, timed over `timed` (default
    `layers`) at every `PROBE_ROWS` batch size; the one whose worst ratio to the best at any size is
    smallest (`least_worst_ratio`)."""
    weights = [(w, b) for w, b, _ in layers]
    timed = layers if timed is None else timed
    options: dict[str, DecodeLinear] = {ROWWISE.name: ROWWISE}
    choice = KernelChoice(ROWWISE)
    # The largest tile set that holds: below its largest tile a smaller set makes the same calls, and at 16
    # rows one tile of 16 was no slower than two of 8 (AVX2 EPYC: bfloat16 310 vs 308 ms, float32 187 vs 312).
    for largest in (16, 8, 4):
        sizes = tuple(s for s in TILE_SIZES if s <= largest)
        tiles = invariant_tiles(weights, sizes)
        if tiles:
            options[DecodeLinear(tiles).name] = DecodeLinear(tiles)
            break
    for name, kernel in options.items():
        choice.step_ms[name] = {n: step_ms(kernel, timed, n) for n in PROBE_ROWS}
    choice.kernel = options[least_worst_ratio(choice.step_ms)]
    return choice


def least_worst_ratio(step_ms: Mapping[str, Mapping[Hashable, float]]) -> str:
    """The option (name -> milliseconds per batch size) whose worst ratio to the fastest option at any batch
    size is smallest: no load, one conversation or sixteen, pays much for the choice."""
    sizes = set.intersection(*(set(ms) for ms in step_ms.values()))
    best = {n: min(ms[n] for ms in step_ms.values()) for n in sizes}
    worst = {name: max(ms[n] / best[n] for n in sizes) for name, ms in step_ms.items()}
    return min(worst, key=worst.__getitem__)
