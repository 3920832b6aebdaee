"""`duplexd bench llm`: the dialog LLM engine's throughput, memory and windowed perplexity, with baselines.

Everything is measured in one run on this machine, with the same torch thread count throughout:

- the engine (`duplexd.dialog.engine`): decode tok/s for 1/2/4/8/16 concurrent sessions, prefill tok/s,
  the most tokens one session ever holds in its KV window, RSS per session, and perplexity on a long real
  text with full attention, with a window plus attention sinks, and with a window alone;
- baseline 1, transformers' own `generate` on the same GGUF weights (batch 1, float32, greedy);
- baseline 2, the raw matrix-multiply time of this model's weight shapes (`matmul_bound_tok_s`): the most
  tok/s any engine that multiplies these weights in this dtype with this kernel could reach; for "int4"
  (`int4_bound_tok_s`) the layers' matrices in 4 bits through torch's CPU int4 kernel and the output head
  in bfloat16, as the engine's int4 dtype runs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from duplexd.dialog.attention import attend_one
from duplexd.dialog.device import describe, synchronize, torch_device
from duplexd.dialog.gguf_weights import ChatTokenizer, LlamaConfig, open_gguf, read_config, read_tokenizer
from duplexd.dialog.kv_window import KvPool, Plan, RopeTable, WindowConfig, WindowState
from duplexd.dialog.model import Transformer
from duplexd.dialog.models import gguf_path
from duplexd.dialog.tuning import long_text

Kernel = Literal["gemm", "rowwise"]

THREADS = 2
SESSION_COUNTS = (1, 2, 4, 8, 16)
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "int4": "int4"}
KERNELS: tuple[Kernel, ...] = ("gemm", "rowwise")
PPL_TOKENS = 8192  # the model's context: full attention over exactly this many tokens is valid
QUICK_TOKENS = 2560  # --quick: perplexity and KV runs still go past the 2048-token window
PROMPT = "Tell me a long story about a lighthouse keeper who finds a message in a bottle."
MAX_DRAIN_STEPS = 100_000
CONTENDED_CORES = 0.25  # other processes busier than this during a phase: its timings are flagged


def rss_mb() -> float:
    """This process's resident set size now, in MiB (`VmRSS` from /proc/self/status).

    Where /proc is missing (not Linux), the peak RSS from `resource.getrusage`, which never decreases.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, kB elsewhere


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_1m": os.getloadavg()[0],  # above ~0.5 before the run: other processes share the CPUs
    }


def long_text_tokens(tokenizer: ChatTokenizer, n_tokens: int = PPL_TOKENS) -> list[int]:
    """The first `n_tokens` token ids of `long_text()` (no BOS or template). Raises `ValueError` if shorter."""
    ids = tokenizer.encode(long_text())
    if len(ids) < n_tokens:
        raise ValueError(f"long_text() has {len(ids)} tokens, fewer than n_tokens={n_tokens}")
    return ids[:n_tokens]


def model_config() -> LlamaConfig:
    """The dialog model's shape, from the cached GGUF's metadata."""
    return read_config(open_gguf(gguf_path()))


def matmul_shapes(config: LlamaConfig) -> list[tuple[int, int]]:
    """Weight shapes `(out_features, in_features)` multiplied once per decoded token, in model order.

    Per layer: q, k, v, o, gate, up, down; after the last layer the output head (vocab x dim).
    """
    q_dim = config.n_heads * config.head_dim
    kv_dim = config.n_kv_heads * config.head_dim
    layer = [
        (q_dim, config.dim),
        (kv_dim, config.dim),
        (kv_dim, config.dim),
        (config.dim, q_dim),
        (config.hidden_dim, config.dim),
        (config.hidden_dim, config.dim),
        (config.dim, config.hidden_dim),
    ]
    return layer * config.n_layers + [(config.vocab, config.dim)]


def _median_s(fn: Callable[[], object], warmup: int, repeats: int, device: torch.device | None = None) -> float:
    """Median wall seconds of `fn()` (on a GPU, its queued work waited for before and after each call)."""
    device = device or torch.device("cpu")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_bound_tok_s(
    batch_sizes: Sequence[int],
    dtype: torch.dtype,
    kernel: Kernel,
    config: LlamaConfig | None = None,
    *,
    warmup: int = 1,
    repeats: int = 5,
    device: torch.device | None = None,
) -> dict[int, float]:
    """Tokens/s of the weight matmuls alone: `B / (median time of one decode step's matmuls with B rows)`.

    One step multiplies B activation rows by every weight of `matmul_shapes(config)` (random weights, one
    distinct tensor per layer, so each step streams the whole model through memory as a real one does).
    Kernels: `"gemm"` is `F.linear(x[B, K], W)`, one matrix multiply for the batch; `"rowwise"` is
    `torch.bmm(x[B, 1, K], W.t().expand(B, -1, -1))`, which computes each row alone (the engine's
    batch-invariant decode kernel: a row's result never depends on the other rows). Attention, norms and
    everything else are left out, so this bounds from above what an engine using that kernel can reach.
    `config` defaults to the dialog model's (`model_config()`); `device` to the CPU.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    device = device or torch.device("cpu")
    shapes = matmul_shapes(config if config is not None else model_config())
    gen = torch.Generator().manual_seed(0)
    weights = [torch.empty(n, k, dtype=dtype).uniform_(-0.05, 0.05, generator=gen).to(device) for n, k in shapes]
    result: dict[int, float] = {}
    for batch in batch_sizes:
        if batch <= 0:
            raise ValueError(f"batch sizes must be positive, got {batch}")
        rows = {k: torch.randn(batch, k, generator=gen).to(device, dtype) for k in {k for _, k in shapes}}

        def step(rows: dict[int, torch.Tensor] = rows, batch: int = batch) -> None:
            with torch.inference_mode():
                for w in weights:
                    x = rows[w.shape[1]]
                    if kernel == "gemm":
                        F.linear(x, w)
                    else:
                        torch.bmm(x[:, None, :], w.t().expand(batch, -1, -1))

        result[batch] = batch / _median_s(step, warmup, repeats, device)
    return result


def int4_bound_tok_s(
    batch_sizes: Sequence[int], config: LlamaConfig | None = None, *, warmup: int = 1, repeats: int = 5
) -> dict[int, float]:
    """Like `matmul_bound_tok_s(..., "gemm")` for the engine's "int4" dtype: every layer matrix of
    `matmul_shapes` as random 4-bit codes with per-32 scales, multiplied by `kernels.PackedInt4` (one call
    for the whole batch), and the output head (the last shape) in bfloat16 with `F.linear`."""
    from duplexd.dialog.kernels import INT4_GROUP, PackedInt4

    shapes = matmul_shapes(config if config is not None else model_config())
    gen = torch.Generator().manual_seed(0)
    layers = []
    for n, k in shapes[:-1]:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scales = torch.rand(n, k // INT4_GROUP, generator=gen) * 0.01
        layers.append(PackedInt4.pack(codes, scales, -8 * scales, torch.bfloat16))
    head = torch.empty(shapes[-1], dtype=torch.bfloat16).uniform_(-0.05, 0.05, generator=gen)
    result: dict[int, float] = {}
    for batch in batch_sizes:
        if batch <= 0:
            raise ValueError(f"batch sizes must be positive, got {batch}")
        rows = {k: torch.randn(batch, k, generator=gen).bfloat16() for k in {k for _, k in shapes}}

        def step(rows: dict[int, torch.Tensor] = rows) -> None:
            with torch.inference_mode():
                for (_, k), packed in zip(shapes[:-1], layers, strict=True):
                    packed.linear(rows[k])
                F.linear(rows[head.shape[1]], head)

        result[batch] = batch / _median_s(step, warmup, repeats)
    return result


def hf_generate_tok_s(
    prompt_ids: Sequence[int],
    *,
    new_tokens: int = 64,
    repeats: int = 3,
    path: Path | None = None,
    device: torch.device | None = None,
) -> float:
    """Decode tok/s of transformers' own `generate` on the same GGUF (batch 1, float32, greedy, no prefill).

    The model is `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)` (transformers dequantizes the
    same blocks to float32). Prefill is excluded by difference: with `t(n)` the median wall time of
    `generate` forced to exactly n new tokens (`min_new_tokens = max_new_tokens = n`) under
    `torch.inference_mode`, the result is `new_tokens / (t(new_tokens + 1) - t(1))`: both runs do the
    same prefill and first token, and the longer one `new_tokens` decode steps more. Threads are the
    caller's (`torch.set_num_threads`). Raises `ImportError` when transformers (a test-only extra) or
    accelerate is not installed.
    """
    import accelerate  # noqa: F401  # transformers needs it to load a GGUF file
    import transformers  # test-only dependency, imported lazily

    device = device or torch.device("cpu")
    path = path if path is not None else gguf_path()
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        .to(device)
        .eval()
    )
    ids = torch.tensor([list(prompt_ids)], device=device)
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    def generate(n: int) -> None:
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
            )
        if out.shape[1] != ids.shape[1] + n:
            raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} tokens, asked for {n}")

    first = _median_s(lambda: generate(1), warmup=1, repeats=repeats, device=device)
    full = _median_s(lambda: generate(new_tokens + 1), warmup=0, repeats=repeats, device=device)
    return new_tokens / (full - first)


# --- the engine (contract: duplexd.dialog.engine) -------------------------------------------------------


def cpu_busy_s() -> tuple[float, float] | None:
    """CPU seconds used since boot by the whole machine (all cores, /proc/stat) and by this process.

    None where /proc/stat is missing. Their difference over a phase is what other processes (and the
    hypervisor's steal) took from the CPUs while we measured.
    """
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal, *_ = (int(v) for v in f.readline().split()[1:])
    except (OSError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return (user + nice + system + irq + softirq + steal) / ticks, own.user + own.system


@contextmanager
def _phase(name: str, phases: dict[str, dict[str, float | None]]) -> Iterator[None]:
    """Print `name`, run the block; record its wall time and the cores other processes kept busy meanwhile."""
    print(f"{name} ...", flush=True)
    cpu0, t0 = cpu_busy_s(), time.perf_counter()
    yield
    cpu1, wall_s = cpu_busy_s(), time.perf_counter() - t0
    others = None if cpu0 is None or cpu1 is None else ((cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / wall_s
    phases[name] = {"s": round(wall_s, 2), "other_cores": None if others is None else round(max(others, 0.0), 2)}
    shown = "" if others is None else f" (other processes: {max(others, 0.0):.2f} cores)"
    print(f"  {wall_s:.1f} s{shown}", flush=True)


def _drain(engine: Any) -> int:
    """Step until no session has pending work; the number of steps."""
    steps = 0
    while engine.busy():
        engine.step()
        steps += 1
        if steps > MAX_DRAIN_STEPS:
            raise RuntimeError(f"engine still busy after {MAX_DRAIN_STEPS} steps")
    return steps


def _aggregate(engine: Any, sessions: int, decode_steps: int) -> dict[str, Any]:
    """Decode tok/s over `sessions` concurrent replies to the same prompt (prefill not timed).

    All sessions are prefilled first (stepped until idle), then every reply is started. The first step
    after that is not timed (it ingests the turn-closing template tokens and yields the first token);
    then up to `decode_steps` steps are, each counted only while every session gets a token from it (a
    step after some reply ended has fewer rows and ingests the reply's closing tokens: timing stops there).
    `rss_delta_mb` is the RSS growth from before opening the sessions to after the timed steps: after a
    warm-up run it is what the sessions themselves cost (a KV pool reserved up front shows as none).
    """
    rss_before_mb = rss_mb()
    sids = [engine.open() for _ in range(sessions)]
    try:
        for sid in sids:
            engine.append_user_text(sid, PROMPT)
        _drain(engine)
        for sid in sids:
            engine.start_reply(sid)
        engine.step()
        tokens = steps = 0
        elapsed_s = 0.0
        for _ in range(decode_steps):
            t0 = time.perf_counter()
            out = engine.step()
            dt = time.perf_counter() - t0
            if len(out) < sessions:
                break
            tokens += sum(len(v) for v in out.values())
            elapsed_s += dt
            steps += 1
        rss_after_mb = rss_mb()
    finally:
        for sid in sids:
            engine.close(sid)
        _drain(engine)
    return {
        "tok_s": tokens / elapsed_s if tokens else None,
        "tokens": tokens,
        "steps": steps,
        "rss_delta_mb": rss_after_mb - rss_before_mb,
    }


def _prefill_tok_s(engine: Any, text: str) -> float:
    """Prefill tok/s of one session ingesting `text` (its system prompt ingested first, not timed)."""
    sid = engine.open()
    try:
        _drain(engine)
        before = engine.resident_tokens(sid)
        engine.append_user_text(sid, text)
        t0 = time.perf_counter()
        _drain(engine)
        elapsed_s = time.perf_counter() - t0
        return (engine.resident_tokens(sid) - before) / elapsed_s
    finally:
        engine.close(sid)


def _kv_resident_max(engine: Any, tokenizer: ChatTokenizer, ids: list[int], chunk_tokens: int) -> tuple[int, int]:
    """Feed one session `ids` as user text, `chunk_tokens` at a time, then a few reply steps.

    Returns the most resident tokens seen after any step, and the tokens the session ingested in all.
    """
    sid = engine.open()
    most = 0
    try:
        for start in range(0, len(ids), chunk_tokens):
            engine.append_user_text(sid, tokenizer.decode(ids[start : start + chunk_tokens]))
            while engine.busy():
                engine.step()
                most = max(most, engine.resident_tokens(sid))
        engine.start_reply(sid)  # a reply still decodes once the window has wrapped
        for _ in range(8):
            engine.step()
            most = max(most, engine.resident_tokens(sid))
        return most, engine.tokens_seen(sid)
    finally:
        engine.close(sid)


@torch.inference_mode()
def sequence_nll(model: Transformer, tokens: Sequence[int], window: WindowConfig | None, chunk: int = 256) -> float:
    """Mean negative log-likelihood of `tokens[1:]` given the prefix, read through a bounded KV window
    (`None`: full attention, i.e. a window as long as the text). The perplexity probe of `bench llm`."""
    if len(tokens) < 2:
        raise ValueError("need at least two tokens")
    window = window or WindowConfig(sink_tokens=0, window_tokens=len(tokens))
    chunk = min(chunk, window.window_tokens)
    mc = model.config
    pool = KvPool(
        layers=mc.n_layers,
        kv_heads=mc.n_kv_heads,
        head_dim=mc.head_dim,
        window=window,
        slots=1,
        dtype=model.tok_embeddings.weight.dtype,
        device=model.device,
    )
    state = WindowState(window)
    rope = RopeTable(mc.head_dim, mc.rope_theta, cached=len(tokens))
    scale = 1.0 / math.sqrt(mc.head_dim)
    ids = torch.tensor(list(tokens))
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, chunk):
        piece = ids[start : start + chunk]
        plan = state.plan(len(piece), rope, mc.n_heads // mc.n_kv_heads)
        on_device = plan.to(model.device)

        def attend(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan = on_device
        ) -> torch.Tensor:
            return attend_one(pool.k[layer, 0], pool.v[layer, 0], q, k, v, plan, scale, window.sink_tokens)

        logits = model.step(piece, attend, None).cpu()
        state.commit(plan)
        targets = ids[start + 1 : start + 1 + len(piece)]
        logp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        total -= float(logp.gather(1, targets[:, None]).sum())
        count += len(targets)
    return total / count


def _engine_parts(
    tokenizer: ChatTokenizer,
    quick: bool,
    skipped: dict[str, str],
    phases: dict[str, dict[str, float | None]],
    device: str = "cpu",
) -> dict[str, Any]:
    keys = (
        "config",
        "aggregate",
        "prefill_tok_s",
        "kv_resident_max_tokens",
        "kv_tokens_fed",
        "kv_pool_mb_per_slot",
        "ppl",
    )
    try:
        from duplexd.dialog.engine import DialogEngine, EngineConfig
    except ModuleNotFoundError as exc:
        if exc.name != "duplexd.dialog.engine":
            raise
        skipped["engine"] = "duplexd.dialog.engine is not in this tree"
        return dict.fromkeys(keys) | {"rss_mb": {}}

    rss = {"before_load": rss_mb()}
    with _phase("engine: load", phases):
        engine = DialogEngine.load(EngineConfig(max_sessions=max(SESSION_COUNTS), device=device))  # (default window)
    rss["after_load"] = rss_mb()
    pool = getattr(engine, "pool", None)  # not in the engine contract: reported when present
    kv_pool_mb = None if pool is None else (pool.k.nbytes + pool.v.nbytes) / (1 << 20) / max(SESSION_COUNTS)
    ppl_tokens = QUICK_TOKENS if quick else PPL_TOKENS
    kv_tokens = QUICK_TOKENS if quick else 20_480
    text_ids = long_text_tokens(tokenizer, max(ppl_tokens, kv_tokens, 512))
    aggregate = {}
    for n in SESSION_COUNTS:
        with _phase(f"engine: {n} session(s) decoding", phases):
            _aggregate(engine, n, decode_steps=4)  # warm-up, as transformers' generate gets one: the first
            # steps of a shape pay one-time costs (oneDNN primitives, first touch of the KV rows)
            aggregate[n] = _aggregate(engine, n, decode_steps=8 if quick else 32)
    with _phase("engine: prefill", phases):
        prefill = _prefill_tok_s(engine, tokenizer.decode(text_ids[:512]))
    with _phase(f"engine: one session through {kv_tokens} tokens", phases):
        kv_max, kv_fed = _kv_resident_max(engine, tokenizer, text_ids[:kv_tokens], chunk_tokens=512)
    ppl = {}
    configured = engine.config.window
    for name, window in (
        ("full", None),
        ("window_sinks", configured),
        ("window_no_sinks", WindowConfig(sink_tokens=0, window_tokens=configured.capacity)),
    ):
        with _phase(f"engine: perplexity ({name}) on {ppl_tokens} tokens", phases):
            ppl[name] = math.exp(float(sequence_nll(engine.model, text_ids[:ppl_tokens], window, chunk=256)))
    config = getattr(engine, "config", None)
    return {
        "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None,
        "tuning": getattr(engine, "tuning", None),  # (the dtype and decode kernel measured at load)
        "aggregate": aggregate,
        "prefill_tok_s": prefill,
        "kv_resident_max_tokens": kv_max,
        "kv_tokens_fed": kv_fed,
        "kv_pool_mb_per_slot": kv_pool_mb,
        "ppl": ppl,
        "rss_mb": rss | {"end": rss_mb()},
    }


# --- the result -----------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def report(
    *,
    machine: dict[str, Any],
    quick: bool,
    engine: dict[str, Any],
    hf_generate_tok_s: float | None,
    matmul: dict[str, dict[str, dict[int, float]]],
    ppl_text: dict[str, Any],
    skipped: dict[str, str],
    phases: dict[str, dict[str, float | None]],
) -> dict[str, Any]:
    """The JSON result from the raw measurements: headline numbers, baselines and their ratios.

    `engine` is `_engine_parts`' dict (its values None when the engine is absent); `matmul` is
    kernel -> dtype name -> batch size -> tok/s. Session counts become string keys (JSON objects).
    """
    aggregate = engine["aggregate"] or {}
    agg = {str(n): aggregate.get(n, {}).get("tok_s") for n in SESSION_COUNTS}
    tuning = engine.get("tuning") or {}
    dtype = tuning.get("dtype", "float32")
    # The bound is the plain GEMM of the dtype the engine runs: what its batch-invariant kernel gives up.
    bound = {str(n): v for n, v in matmul.get("gemm", {}).get(DTYPE_NAMES.get(dtype, "fp32"), {}).items()}
    engine_config = None
    if engine["config"] is not None:
        engine_config = {
            **engine["config"],
            "dtype": dtype,
            "dtype_setting": tuning.get("dtype_setting", engine["config"].get("dtype")),
            "dtypes_offered": tuning.get("dtypes_offered", [dtype]),
            "decode_linear": tuning.get("decode_linear", "rowwise"),
        }
    single = agg["1"]
    sessions = max(SESSION_COUNTS)
    rss_delta = aggregate.get(sessions, {}).get("rss_delta_mb")
    return {
        "machine": machine,
        "quick": quick,
        "engine_config": engine_config,
        "single_tok_s": single,
        "prefill_tok_s": engine["prefill_tok_s"],
        "aggregate_tok_s": agg,
        "hf_generate_tok_s": hf_generate_tok_s,
        "matmul_bound_tok_s": {
            kernel: {dtype: {str(n): v for n, v in by_n.items()} for dtype, by_n in by_dtype.items()}
            for kernel, by_dtype in matmul.items()
        },
        "engine_bound_tok_s": bound,
        "kv_resident_max_tokens": engine["kv_resident_max_tokens"],
        "kv_tokens_fed": engine["kv_tokens_fed"],
        "rss_per_session_mb": None if rss_delta is None else rss_delta / sessions,
        "kv_pool_mb_per_slot": engine["kv_pool_mb_per_slot"],
        "rss_mb": engine["rss_mb"],
        "ppl": engine["ppl"] or dict.fromkeys(("full", "window_sinks", "window_no_sinks")),
        "ppl_text": ppl_text,
        "ratios": {
            "single_over_hf": _ratio(single, hf_generate_tok_s),
            f"aggregate{sessions}_over_single": _ratio(agg[str(sessions)], single),
            "aggregate_over_engine_bound": {n: _ratio(agg[n], bound.get(n)) for n in agg},
        },
        "decode": {str(n): aggregate[n] for n in aggregate},
        "skipped": skipped,
        "phases": phases,
    }


def table(r: dict[str, Any]) -> str:
    def f(v: Any, unit: str = "") -> str:
        return "—" if v is None else f"{v:.2f}{unit}" if isinstance(v, float) else f"{v}{unit}"

    mm = r["matmul_bound_tok_s"]
    lines = [
        f"single {f(r['single_tok_s'], ' tok/s')} vs transformers generate {f(r['hf_generate_tok_s'], ' tok/s')} "
        f"(ratio {f(r['ratios']['single_over_hf'])}); prefill {f(r['prefill_tok_s'], ' tok/s')}",
        f"KV resident max {f(r['kv_resident_max_tokens'])} tokens over {f(r['kv_tokens_fed'])} fed; "
        f"RSS/session {f(r['rss_per_session_mb'], ' MiB')} (KV pool reserves {f(r['kv_pool_mb_per_slot'], ' MiB')}"
        " per slot)",
        "perplexity: " + ", ".join(f"{k} {f(v)}" for k, v in r["ppl"].items()),
        f"engine: {f((r['engine_config'] or {}).get('dtype'))}, decode "
        f"{f((r['engine_config'] or {}).get('decode_linear'))} (measured at load, offered: "
        f"{', '.join((r['engine_config'] or {}).get('dtypes_offered') or [])})",
        "| sessions | engine tok/s | engine bound (gemm, its dtype) | engine/bound | gemm fp32 | gemm bf16 "
        "| gemm int4 | rowwise bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, v in r["aggregate_tok_s"].items():
        lines.append(
            f"| {n} | {f(v)} | {f(r['engine_bound_tok_s'].get(n))} "
            f"| {f(r['ratios']['aggregate_over_engine_bound'][n])} "
            f"| {f(mm.get('gemm', {}).get('fp32', {}).get(n))} | {f(mm.get('gemm', {}).get('bf16', {}).get(n))} "
            f"| {f(mm.get('gemm', {}).get('int4', {}).get(n))} | {f(mm.get('rowwise', {}).get('bf16', {}).get(n))} |"
        )
    lines += [f"skipped {k}: {v}" for k, v in r["skipped"].items()]
    shared = {k: v["other_cores"] for k, v in r["phases"].items() if (v["other_cores"] or 0.0) > CONTENDED_CORES}
    if shared:
        lines.append(
            "warning: other processes used the CPUs (cores busy on average) during "
            + ", ".join(f"{k} ({v:.2f})" for k, v in shared.items())
            + ": those timings are not this machine's"
        )
    return "\n".join(lines)


def run_llm_bench(out: Path, quick: bool, threads: int = THREADS, device_name: str = "cpu") -> dict[str, Any]:
    """Measure everything, write the JSON result to `out`, print a short table, return the result. Every
    part runs on `device_name` (`dialog.device`: the engine, its baselines and the matmul bounds)."""
    device = torch_device(device_name)
    torch.set_num_threads(threads)
    machine = machine_info() | {"device": describe(device)}  # (before the run: the load average is others')
    reader = open_gguf(gguf_path())
    config = read_config(reader)
    tokenizer = read_tokenizer(reader)
    del reader
    skipped: dict[str, str] = {}
    phases: dict[str, dict[str, float | None]] = {}
    ppl_ids = long_text_tokens(tokenizer, QUICK_TOKENS if quick else PPL_TOKENS)
    ppl_text = {
        "source": "pydoc_data.topics",
        "python": platform.python_version(),
        "tokens": len(ppl_ids),
        "sha256": hashlib.sha256(json.dumps(ppl_ids).encode()).hexdigest(),
    }

    matmul: dict[str, dict[str, dict[int, float]]] = {}
    for kernel in KERNELS:
        for name, dtype in DTYPES.items():
            with _phase(f"matmul bound: {kernel} {name}", phases):
                matmul.setdefault(kernel, {})[name] = matmul_bound_tok_s(
                    SESSION_COUNTS, dtype, kernel, config, repeats=1 if quick else 5, device=device
                )
    if device.type == "cpu":  # (torch's int4 kernel here is a CPU one; the engine offers int4 on the CPU only)
        with _phase("matmul bound: gemm int4", phases):
            matmul["gemm"]["int4"] = int4_bound_tok_s(SESSION_COUNTS, config, repeats=1 if quick else 5)

    engine = _engine_parts(tokenizer, quick, skipped, phases, device_name)

    hf: float | None = None
    with _phase("transformers generate", phases):
        try:
            prompt_ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": PROMPT}]))
            hf = hf_generate_tok_s(prompt_ids, repeats=1 if quick else 3, device=device)
        except ImportError as exc:
            skipped["hf_generate_tok_s"] = f"transformers baseline not installed ({exc}); pip install duplexd[test]"

    result = report(
        machine=machine,
        quick=quick,
        engine=engine,
        hf_generate_tok_s=hf,
        matmul=matmul,
        ppl_text=ppl_text,
        skipped=skipped,
        phases=phases,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {out}")
    return result


def main(args: argparse.Namespace) -> int:
    run_llm_bench(args.out, args.quick, device_name=getattr(args, "device", "cpu"))
    return 0
