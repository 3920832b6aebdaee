"""The dialog model as this CPU runs it fastest: the dtype and the decode kernel, measured at load.

`dialog.dtype = "auto"` (the default) times the decode step's matrix multiplies in float32, bfloat16 and,
for a model stored in 4 bits (the default SmolLM2 GGUF is Q4_1), "int4" (bfloat16 activations, the layers'
matrices multiplied in their own 4-bit codes), each with its fastest batch-invariant kernel
(`kernels.choose`), over every layer's own weights as a step streams them, at 1 to 16 rows. Of the dtypes
that keep the perplexity of a fixed real text within `PPL_TOLERANCE` of float32's, it takes the one whose
worst ratio to the others at any of those batch sizes is smallest (`kernels.least_worst_ratio`): one
conversation's latency counts as much as sixteen's throughput. "float32", "bfloat16" or "int4" force the
dtype; the kernel is still measured. CPUs differ (fast bfloat16 matmuls on one, none on another), so
nothing is assumed.

Measuring takes seconds (22 s on a 2-vCPU AVX2 EPYC, half of it the perplexity check), so the outcome is
kept in a small JSON in the user cache directory, keyed by the torch version, the CPU (model name and
flags), the thread count, the model and the dtype setting; a start that finds it re-checks only that the
chosen tiles are still invariant (a fraction of a second).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from duplexd.dialog.device import describe, synchronize
from duplexd.dialog.gguf_weights import ChatTokenizer, FourBitBlocks, LlamaConfig
from duplexd.dialog.kernels import DecodeLinear, choose, invariant_tiles, least_worst_ratio
from duplexd.dialog.model import Transformer
from duplexd.errors import EngineError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int4": torch.bfloat16}
"""`dialog.dtype` -> the model's activations (and dense weights). "int4": bfloat16, and the layers' matrices
multiplied for decode rows in their 4-bit form (`kernels.PackedInt4`), offered for a Q4_0/Q4_1 GGUF."""
ARITHMETIC = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what attention may compute in
PPL_TOKENS = 512  # of `long_text`: the perplexity check at load (about a second per dtype on 2 cores)
PPL_TOLERANCE = 0.01  # bfloat16 is used only if its perplexity is within 1 % of float32's
FORMAT = 3  # of the cache file (2: timed over every layer's weights, per batch size; 3: int4, attention by rows)


def long_text() -> str:
    """A long real English text that every CPython install has, with no download: the Python reference docs.

    `pydoc_data.topics.topics` is the prose `help()` shows for keywords and topics (about 460,000
    characters, over 100,000 SmolLM2 tokens). Topics are joined in sorted key order; reStructuredText
    underline rows (`*****`, `=====`) are dropped, each line is stripped with runs of spaces and tabs made
    one space, and runs of blank lines become one. The text differs a little between Python versions, so
    results record the Python version and a digest of the tokens.
    """
    from pydoc_data.topics import topics

    lines = []
    for key in sorted(topics):
        for line in topics[key].splitlines():
            line = re.sub(r"[ \t]+", " ", line).strip()
            if re.fullmatch(r"([*=\-~^#])\1{2,}", line):
                continue
            if line or (lines and lines[-1]):
                lines.append(line)
    return "\n".join(lines)


@dataclass(slots=True)
class Tuning:
    """What was chosen, and what it was chosen from (reported in `/healthz` and by `bench llm`)."""

    dtype: str
    tiles: tuple[int, ...]  # `kernels.DecodeLinear.tiles` (empty: rowwise)
    setting: str  # `dialog.dtype` as configured
    dtypes_offered: list[str] = field(default_factory=list)
    # dtype -> kernel -> decode rows -> step ms (each dtype's options; the chosen kernel's decide the dtype)
    step_ms: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)
    perplexity: dict[str, float] = field(default_factory=dict)
    # bucket rows -> the dtype decode attention over up to that many rows computes in (`attention_choice`;
    # empty: the model's own dtype throughout)
    attention: dict[str, str] = field(default_factory=dict)
    attention_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # compute dtype -> probe -> ms
    device: str = "cpu"  # where it was measured and runs (`device.describe`)
    cached: bool = False
    seconds: float = 0.0

    @property
    def kernel(self) -> DecodeLinear:
        return DecodeLinear(self.tiles)

    def report(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "decode_linear": self.kernel.name + (" int4" if self.dtype == "int4" else ""),
            "dtype_setting": self.setting,
            "dtypes_offered": self.dtypes_offered,
            "step_ms": self.step_ms,
            "perplexity": self.perplexity,
            "attention_dtype": self.attention,
            "attention_ms": self.attention_ms,
            "device": self.device,
            "cached": self.cached,
        }


ATTENTION_SESSIONS = (1, 16)  # decode rows in a bucket, timed ...
ATTENTION_ROWS = (128, 512, 2048)  # ... at these bucket lengths (a bucket takes the first at least its size)


def attention_ms(
    config: LlamaConfig, stored: torch.dtype, compute: torch.dtype, device: torch.device | None = None
) -> dict[str, float]:
    """Milliseconds of one layer's decode attention as a step runs it (`DecodeBatch.attend`: rotation, the
    pool write, the cast of the cache rows, scores, softmax, values) over a cache stored in `stored`,
    computed in `compute`, for `ATTENTION_SESSIONS` x `ATTENTION_ROWS` ("1x128", ...); the fastest of
    five. Measured on a 2-vCPU AVX512-BF16 EPYC: float32 faster for short buckets (the cast is cheap and
    small bfloat16 matmuls are slow), bfloat16 for 16 sessions at 1,024 rows; an AVX2 CPU without
    bfloat16 instructions ran the small bfloat16 matmuls 2-8x slower."""
    from duplexd.dialog.attention import DecodeBatch
    from duplexd.dialog.kv_window import KvPool, RopeTable, WindowConfig, WindowState

    window = WindowConfig()
    gen = torch.Generator().manual_seed(0)
    kv_heads, dim = config.n_kv_heads, config.head_dim
    rope = RopeTable(dim, config.rope_theta, cached=window.capacity + 1)
    slots = max(ATTENTION_SESSIONS)
    device = device or torch.device("cpu")
    pool = KvPool(
        layers=1,
        kv_heads=kv_heads,
        head_dim=dim,
        window=window,
        slots=slots,
        dtype=stored,
        compute_dtype=compute,
        device=device,
    )
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen).to(device))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen).to(device))
    scale = 1 / math.sqrt(dim)
    out = {}
    for rows in ATTENTION_ROWS:
        state = WindowState(window)
        while state.n < min(rows, window.capacity) - 1:  # (the new row makes the bucket `rows` long)
            state.commit(state.plan(min(window.window_tokens, min(rows, window.capacity) - 1 - state.n), rope))
        plan = state.plan(1, rope, config.n_heads // kv_heads)
        for sessions in ATTENTION_SESSIONS:
            batch = DecodeBatch.build(pool, list(range(sessions)), [plan] * sessions)
            q = torch.randn(sessions, config.n_heads, dim, generator=gen).to(device, stored)
            k, v = (torch.randn(sessions, kv_heads, dim, generator=gen).to(device, stored) for _ in range(2))
            batch.attend(pool, 0, q, k, v, scale, window.sink_tokens)  # (warm)
            best = math.inf
            for _ in range(5):
                synchronize(device)
                t0 = time.perf_counter()
                batch.attend(pool, 0, q, k, v, scale, window.sink_tokens)
                synchronize(device)
                best = min(best, time.perf_counter() - t0)
            out[f"{sessions}x{rows}"] = round(1000 * best, 3)
    return out


def attention_choice(measured: Mapping[str, Mapping[str, float]]) -> dict[str, str]:
    """Bucket rows -> the dtype (of `measured`: dtype -> "sessions x rows" -> ms) whose worst ratio to the
    fastest over the session counts at that length is smallest (`least_worst_ratio`)."""
    return {
        str(rows): least_worst_ratio(
            {name: {s: ms[f"{s}x{rows}"] for s in ATTENTION_SESSIONS} for name, ms in measured.items()}
        )
        for rows in ATTENTION_ROWS
    }


def perplexity(model: Transformer, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).float().cpu()
    return math.exp(float(F.cross_entropy(logits[0, :-1], torch.tensor(ids[1:]))))


def tuned_model(
    config: LlamaConfig,
    weights: dict[str, torch.Tensor],
    tokenizer: ChatTokenizer,
    setting: str,
    model_id: str,
    blocks: Mapping[str, FourBitBlocks] | None = None,
    device: torch.device | None = None,
) -> tuple[Transformer, Tuning]:
    """The model in the dtype `setting` asks for ("auto": the faster that keeps the perplexity), with its
    decode kernel measured (or taken from the cache, re-checked), on `device` (default the CPU). `blocks`:
    the weights' 4-bit form, where the model came in one ("int4", a CPU kernel, is offered only then, and
    only on the CPU)."""
    t0 = time.perf_counter()
    device = device or torch.device("cpu")
    blocks = blocks or {}
    four_bit = all(name in blocks for name in four_bit_names(config))
    if setting == "int4" and not four_bit:
        raise EngineError(
            f"dialog.dtype = int4 needs a model stored in 4 bits (a Q4_0 or Q4_1 GGUF); {model_id} is not"
        )
    if setting == "int4" and device.type != "cpu":
        raise EngineError(f"dialog.dtype = int4 is a CPU kernel; on {device} use auto, float32 or bfloat16")
    four_bit = four_bit and device.type == "cpu"
    where = describe(device)
    path = _cache_path(setting, model_id, where)
    tuning = _read(path, setting)
    if tuning is not None and (tuning.dtype != "int4" or four_bit):
        tuning.device = where
        model, kernel = _build(config, weights, tuning.dtype, blocks, tuning.tiles, device)
        sizes = tuning.tiles or ()
        layers = [(w, b) for w, b, _ in model.decode_layers()]
        if not sizes or invariant_tiles(layers, sizes, linear=kernel.plain) == sizes:
            model.decode_linear = kernel
            model.attention_dtypes = {int(rows): ARITHMETIC[name] for rows, name in tuning.attention.items()}
            tuning.cached, tuning.seconds = True, time.perf_counter() - t0
            return model, tuning
        log.info("dialog kernel cache is stale (tiles %s no longer invariant): measuring again", sizes)
    offered = [n for n in DTYPES if n != "int4" or four_bit] if setting == "auto" else [setting]
    tuning = Tuning(dtype=offered[0], tiles=(), setting=setting, dtypes_offered=offered, device=where)
    models: dict[str, Transformer] = {}
    kernels: dict[str, DecodeLinear] = {}
    for name in offered:
        model, plain = _build(config, weights, name, blocks, (), device)
        choice = choose(model.decode_layers(), model.decode_weights(), plain.int4)
        models[name], kernels[name] = model, choice.kernel
        tuning.step_ms[name] = {k: {n: round(v, 3) for n, v in ms.items()} for k, ms in choice.step_ms.items()}
    usable = list(offered)
    if len(offered) > 1:
        ids = tokenizer.encode(long_text())[:PPL_TOKENS]
        tuning.perplexity = {name: round(perplexity(models[name], ids), 4) for name in offered}
        reference = tuning.perplexity["float32"]
        usable = [n for n in offered if tuning.perplexity[n] <= reference * (1 + PPL_TOLERANCE)]
    tuning.dtype = least_worst_ratio({name: tuning.step_ms[name][kernels[name].name] for name in usable})
    tuning.tiles = kernels[tuning.dtype].tiles
    model = models[tuning.dtype]
    model.decode_linear = kernels[tuning.dtype]
    if DTYPES[tuning.dtype] != torch.float32:
        stored = DTYPES[tuning.dtype]
        tuning.attention_ms = {name: attention_ms(config, stored, dtype, device) for name, dtype in ARITHMETIC.items()}
        tuning.attention = attention_choice(tuning.attention_ms)
    model.attention_dtypes = {int(rows): ARITHMETIC[name] for rows, name in tuning.attention.items()}
    tuning.seconds = time.perf_counter() - t0
    _write(path, tuning)
    return model, tuning


def four_bit_names(config: LlamaConfig) -> list[str]:
    """The matrices `int4` multiplies in 4 bits: every layer's projections (not the embedding/output head)."""
    parts = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
    parts += ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    return [f"layers.{i}.{part}.weight" for i in range(config.n_layers) for part in parts]


def _build(
    config: LlamaConfig,
    weights: Mapping[str, torch.Tensor],
    name: str,
    blocks: Mapping[str, FourBitBlocks],
    tiles: tuple[int, ...],
    device: torch.device | None = None,
) -> tuple[Transformer, DecodeLinear]:
    """The model for dtype `name`, and its decode kernel with these tiles (4-bit weights packed for int4)."""
    model = Transformer.from_state_dict(config, weights, DTYPES[name], device or "cpu")
    int4 = model.pack_int4({n: blocks[n] for n in four_bit_names(config)}) if name == "int4" else {}
    return model, DecodeLinear(tiles, int4)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    name = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
    return f"{name.group(1) if name else '?'}|{flags.group(1) if flags else ''}"


def _cache_path(setting: str, model_id: str, device: str = "cpu") -> Path:
    from duplexd.dialog.models import model_cache_dir

    where = _cpu() if device == "cpu" else device
    key = json.dumps([FORMAT, torch.__version__, where, torch.get_num_threads(), model_id, setting])
    return model_cache_dir() / "tuning" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read(path: Path, setting: str) -> Tuning | None:
    try:
        raw = json.loads(path.read_text())
        tuning = Tuning(
            dtype=raw["dtype"],
            tiles=tuple(int(t) for t in raw["tiles"]),
            setting=setting,
            dtypes_offered=list(raw["dtypes_offered"]),
            step_ms={
                dtype: {kernel: {int(n): float(v) for n, v in ms.items()} for kernel, ms in options.items()}
                for dtype, options in raw["step_ms"].items()
            },
            perplexity=raw["perplexity"],
            attention=raw["attention"],
            attention_ms=raw["attention_ms"],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    valid = tuning.dtype in DTYPES and isinstance(tuning.attention, dict)
    return tuning if valid and all(name in ARITHMETIC for name in tuning.attention.values()) else None


def _write(path: Path, tuning: Tuning) -> None:
    data = {
        "dtype": tuning.dtype,
        "tiles": list(tuning.tiles),
        "dtypes_offered": tuning.dtypes_offered,
        "step_ms": tuning.step_ms,
        "perplexity": tuning.perplexity,
        "attention": tuning.attention,
        "attention_ms": tuning.attention_ms,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f)
        os.replace(f.name, path)
    except OSError as exc:  # (a read-only cache: measured again next start)
        log.warning("could not keep the dialog tuning at %s: %s", path, exc)
