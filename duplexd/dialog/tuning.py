"""The dialog model as this CPU runs it fastest: the dtype and the decode kernel, measured at load.

`dialog.dtype = "auto"` (the default) times the decode step's matrix multiplies in float32 and bfloat16,
each with its fastest batch-invariant kernel (`kernels.choose`), over every layer's own weights as a step
streams them, at 1 to 16 rows. Of the dtypes that keep the perplexity of a fixed real text within
`PPL_TOLERANCE` of float32's, it takes the one whose worst ratio to the other at any of those batch sizes is
smallest (`kernels.least_worst_ratio`): one conversation's latency counts as much as sixteen's throughput.
"float32" or "bfloat16" force the dtype; the kernel is still measured. CPUs differ (fast bfloat16 matmuls
on one, none on another), so nothing is assumed.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from duplexd.dialog.gguf_weights import ChatTokenizer, LlamaConfig
from duplexd.dialog.kernels import DecodeLinear, choose, invariant_tiles, least_worst_ratio
from duplexd.dialog.model import Transformer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PPL_TOKENS = 512  # of `long_text`: the perplexity check at load (about a second per dtype on 2 cores)
PPL_TOLERANCE = 0.01  # bfloat16 is used only if its perplexity is within 1 % of float32's
FORMAT = 2  # of the cache file (2: timed over every layer's weights, per batch size; attention's dtype)


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
    attention: str = "float32"  # the dtype attention computes in (`attention_ms`)
    attention_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # compute dtype -> probe -> ms
    cached: bool = False
    seconds: float = 0.0

    @property
    def kernel(self) -> DecodeLinear:
        return DecodeLinear(self.tiles)

    def report(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "decode_linear": self.kernel.name,
            "dtype_setting": self.setting,
            "dtypes_offered": self.dtypes_offered,
            "step_ms": self.step_ms,
            "perplexity": self.perplexity,
            "attention_dtype": self.attention,
            "attention_ms": self.attention_ms,
            "cached": self.cached,
        }


ATTENTION_PROBES = ((1, 128), (1, 2048), (16, 128), (16, 2048))  # (sessions, cache rows) of a decode step


def attention_ms(config: LlamaConfig, stored: torch.dtype, compute: torch.dtype) -> dict[str, float]:
    """Milliseconds of one layer's decode attention matmuls (scores and weighted values) over a KV cache
    stored in `stored`, computed in `compute` (the cache rows cast to it first, as `attention` does), for
    each `ATTENTION_PROBES` shape; the fastest of three. On an AVX2 CPU without bfloat16 instructions the
    bfloat16 matmuls of these small shapes ran 2-8x slower than casting and multiplying in float32; where
    bfloat16 is native, the cast may cost more than it saves."""
    gen = torch.Generator().manual_seed(0)
    kv_heads, group, dim = config.n_kv_heads, config.n_heads // config.n_kv_heads, config.head_dim
    out = {}
    for sessions, rows in ATTENTION_PROBES:
        q = torch.randn(sessions, kv_heads, group, dim, generator=gen).to(compute)
        k, v = (torch.randn(sessions, kv_heads, rows, dim, generator=gen).to(stored) for _ in range(2))
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            probs = torch.softmax((q @ k.to(compute).transpose(-1, -2)).float(), dim=-1).to(compute)
            probs @ v.to(compute)
            best = min(best, time.perf_counter() - t0)
        out[f"{sessions}x{rows}"] = round(1000 * best, 3)
    return out


def perplexity(model: Transformer, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).float()
    return math.exp(float(F.cross_entropy(logits[0, :-1], torch.tensor(ids[1:]))))


def tuned_model(
    config: LlamaConfig, weights: dict[str, torch.Tensor], tokenizer: ChatTokenizer, setting: str, model_id: str
) -> tuple[Transformer, Tuning]:
    """The model in the dtype `setting` asks for ("auto": the faster that keeps the perplexity), with its
    decode kernel measured (or taken from the cache, re-checked)."""
    t0 = time.perf_counter()
    path = _cache_path(setting, model_id)
    tuning = _read(path, setting)
    if tuning is not None:
        model = Transformer.from_state_dict(config, weights, DTYPES[tuning.dtype])
        sizes = tuning.tiles or ()
        if not sizes or invariant_tiles([(w, b) for w, b, _ in model.decode_layers()], sizes) == sizes:
            model.decode_linear = tuning.kernel
            model.attention_dtype = DTYPES[tuning.attention]
            tuning.cached, tuning.seconds = True, time.perf_counter() - t0
            return model, tuning
        log.info("dialog kernel cache is stale (tiles %s no longer invariant): measuring again", sizes)
    offered = list(DTYPES) if setting == "auto" else [setting]
    tuning = Tuning(dtype=offered[0], tiles=(), setting=setting, dtypes_offered=offered)
    models: dict[str, Transformer] = {}
    kernels: dict[str, DecodeLinear] = {}
    for name in offered:
        model = Transformer.from_state_dict(config, weights, DTYPES[name])
        choice = choose(model.decode_layers(), model.decode_weights())
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
    if tuning.dtype != "float32":
        tuning.attention_ms = {name: attention_ms(config, DTYPES[tuning.dtype], DTYPES[name]) for name in DTYPES}
        tuning.attention = least_worst_ratio(tuning.attention_ms)
    model.attention_dtype = DTYPES[tuning.attention]
    tuning.seconds = time.perf_counter() - t0
    _write(path, tuning)
    return model, tuning


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


def _cache_path(setting: str, model_id: str) -> Path:
    from duplexd.dialog.models import model_cache_dir

    key = json.dumps([FORMAT, torch.__version__, _cpu(), torch.get_num_threads(), model_id, setting])
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
    return tuning if tuning.dtype in DTYPES and tuning.attention in DTYPES else None


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
