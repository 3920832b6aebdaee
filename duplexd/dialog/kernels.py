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

Either way a weight may be multiplied in its 4-bit form (`PackedInt4`: the GGUF's own Q4_0/Q4_1 codes, with
their per-32 scales, through torch's CPU int4 kernel): decode is memory-bound, and a 4-bit weight is a
quarter of a bfloat16 one (a whole SmolLM2-135M step's layer matmuls at one row: 3.8 ms against 31.5 ms
for bfloat16, measured on a 2-vCPU AVX512-BF16 EPYC). The same self-test decides its tiles.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from duplexd.dialog.device import synchronize
from duplexd.dialog.gguf_weights import FOUR_BIT_GROUP

TILE_SIZES = (1, 2, 4, 8, 16)  # the sizes tried; the largest is the tile a long step is cut into
PROBE_ROWS = (1, 2, 4, 8, 16)  # the decode batch sizes a choice is timed at


def rowwise_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight)` for `x[N, K]`, computed one row at a time (bitwise batch-invariant).

    float32 on a CPU: one `bmm` whose batch items are single rows (measured bitwise equal to `F.linear` on
    the row alone, at any N). bfloat16 has no fast batched kernel for that shape, and cuBLAS picks a `bmm`
    kernel by the batch count (a row's numbers would depend on N), so there the rows are separate calls.
    """
    if x.dtype != torch.float32 or x.device.type != "cpu":
        if not x.shape[0]:
            return F.linear(x, weight, bias)
        return torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(x.shape[0])])
    n = x.shape[0]
    out = torch.bmm(x.unsqueeze(1), weight.t().expand(n, -1, -1)).squeeze(1)
    return out if bias is None else out + bias


INT4_GROUP = FOUR_BIT_GROUP  # elements per scale: GGUF's Q4_0/Q4_1 block


@dataclass(frozen=True, slots=True)
class PackedInt4:
    """A weight `[N, K]` as torch's CPU int4 kernel takes it: `w = (code - 8) * scale + zero` per group of 32
    along K. Built from a GGUF block's `w = d * code + m` with `scale = d`, `zero = m + 8 d`, so the codes are
    the file's own; the scales and zeros are rounded to the activations' dtype (the kernel's requirement)."""

    packed: Tensor  # uint8, `_convert_weight_to_int4pack_for_cpu`'s layout
    scales_and_zeros: Tensor  # [K / group, N, 2] in the activations' dtype

    @classmethod
    def pack(cls, codes: Tensor, scales: Tensor, mins: Tensor, dtype: torch.dtype) -> PackedInt4:
        """`codes[N, K]` (0..15), `scales`, `mins` `[N, K / 32]`: `w = scales * codes + mins` per group."""
        if codes.shape[1] != INT4_GROUP * scales.shape[1]:
            raise ValueError(f"{codes.shape[1]} columns are not {scales.shape[1]} groups of {INT4_GROUP}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        d, m = scales.double(), mins.double()
        scales_and_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).to(dtype).contiguous()
        return cls(packed, scales_and_zeros)

    def dense(self) -> Tensor:
        """The weight the kernel multiplies by, `[N, K]` (read back through the kernel itself, so rounded to
        the activations' dtype; float32 tensor)."""
        eye = torch.eye(self.scales_and_zeros.shape[0] * INT4_GROUP, dtype=self.scales_and_zeros.dtype)
        return self.linear(eye).float().t().contiguous()

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)
        return out if bias is None else out + bias


@dataclass(frozen=True, slots=True)
class DecodeLinear:
    """`F.linear` for one-token rows, batch-invariant. `tiles`: the row counts a call may have (rows are
    padded with zeros up to the smallest that holds them; more rows than the largest are cut into tiles of
    the largest); empty: rowwise. `int4`: weights (by `id`) multiplied in their 4-bit form instead, each
    kept beside its dense tensor (which also holds the `id`)."""

    tiles: tuple[int, ...] = ()
    int4: Mapping[int, tuple[Tensor, PackedInt4]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def name(self) -> str:
        name = "rowwise" if not self.tiles else "tiles " + "/".join(map(str, self.tiles))
        return name + (" int4" if self.int4 else "")

    def plain(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """One untiled call: the 4-bit kernel for a weight packed here, else `F.linear`."""
        packed = self.int4.get(id(weight))
        return F.linear(x, weight, bias) if packed is None else packed[1].linear(x, bias)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if not self.tiles or not x.shape[0]:
            if id(weight) in self.int4 and x.shape[0]:
                return torch.cat([self.plain(x[i : i + 1], weight, bias) for i in range(x.shape[0])])
            return rowwise_linear(x, weight, bias)
        n, biggest = x.shape[0], self.tiles[-1]
        outs = []
        for start in range(0, n, biggest):
            part = x[start : start + biggest]
            tile = next(t for t in self.tiles if t >= part.shape[0])
            if tile > part.shape[0]:
                part = torch.cat([part, part.new_zeros(tile - part.shape[0], part.shape[1])])
            outs.append(self.plain(part, weight, bias))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out[:n]


ROWWISE = DecodeLinear()


def invariant_tiles(
    weights: Sequence[tuple[Tensor, Tensor | None]],
    sizes: Sequence[int] = TILE_SIZES,
    trials: int = 3,
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor] | None = None,
) -> tuple[int, ...]:
    """The tile sizes among `sizes` whose rows are bitwise equal to the largest size's, for every weight,
    whatever the other rows and the row's position (the largest itself included only if it passes that).
    `linear`: the untiled multiply tested (default `F.linear`; `DecodeLinear.plain` for 4-bit weights).
    Random rows, a fixed seed: the same test on every start."""
    linear = linear or F.linear
    gen = torch.Generator().manual_seed(0)
    largest = max(sizes)
    keep = set(sizes)
    for weight, bias in weights:
        dim = weight.shape[1]
        for _ in range(trials):
            row = torch.randn(1, dim, generator=gen).to(weight.device, weight.dtype)
            alone = linear(torch.cat([row, row.new_zeros(largest - 1, dim)]), weight, bias)[0]
            for size in sorted(keep):
                others = torch.randn(size, dim, generator=gen).to(weight.device, weight.dtype)
                position = int(torch.randint(size, (1,), generator=gen))
                others[position] = row[0]
                if not torch.equal(linear(others, weight, bias)[position], alone):
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
    device = layers[0][0].device
    for weight, bias, _ in layers:
        key = (weight.shape[1], weight.dtype)
        if key not in inputs:
            inputs[key] = torch.randn(rows, weight.shape[1]).to(weight.device, weight.dtype)
            kernel(inputs[key], weight, bias)  # (warm: the first call of a shape allocates)
    best = math.inf
    for _ in range(passes):
        synchronize(device)
        t0 = time.perf_counter()
        for weight, bias, count in layers:
            x = inputs[(weight.shape[1], weight.dtype)]
            for _ in range(count):
                kernel(x, weight, bias)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 1000 * best


def choose(
    layers: Sequence[tuple[Tensor, Tensor | None, int]],
    timed: Sequence[tuple[Tensor, Tensor | None, int]] | None = None,
    int4: Mapping[int, tuple[Tensor, PackedInt4]] | None = None,
) -> KernelChoice:
    """The fastest batch-invariant decode kernel for these weights (`(weight, bias, uses per step)`) on this
    CPU: each invariant tile set (self-tested on `layers`), and rowwise, timed over `timed` (default
    `layers`) at every `PROBE_ROWS` batch size; the one whose worst ratio to the best at any size is
    smallest (`least_worst_ratio`). With `int4`, every option multiplies those weights in 4 bits."""
    weights = [(w, b) for w, b, _ in layers]
    timed = layers if timed is None else timed
    int4 = int4 or {}
    rowwise = DecodeLinear((), int4) if int4 else ROWWISE
    options: dict[str, DecodeLinear] = {rowwise.name: rowwise}
    choice = KernelChoice(rowwise)
    # The largest tile set that holds: below its largest tile a smaller set makes the same calls, and at 16
    # rows one tile of 16 was no slower than two of 8 (AVX2 EPYC: bfloat16 310 vs 308 ms, float32 187 vs 312).
    for largest in (16, 8, 4):
        sizes = tuple(s for s in TILE_SIZES if s <= largest)
        tiles = invariant_tiles(weights, sizes, linear=rowwise.plain)
        if tiles:
            options[DecodeLinear(tiles, int4).name] = DecodeLinear(tiles, int4)
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
