"""`duplexd bench collapse`: bounded vs unbounded per-session KV under the same pool (Metronome, scaled).

The Metronome paper's cliff: when per-session state grows without bound, a server under sustained load
exhausts its KV pool, starts preempting and recomputing sessions, and latency collapses, while its
averages still look fine. Here the real dialog engine and model run `--sessions` conversations of
`--turns` turns (questions from a fixed list, replies up to `--reply-tokens`, a short think time between
turns), as fast as the engine steps, twice per seed:

- bounded: the server's engine, each session a slot of S + W rows (sinks + sliding window): resident KV
  never exceeds `sessions x (S + W)` rows by construction;
- unbounded: slots sized for whole conversations (the window never evicts) and the same number of rows,
  `sessions x (S + W)`, as a shared budget (`bench.baseline.UnboundedEngine`): when a step needs more,
  idle sessions, then the newest, are preempted and recomputed later.

A run collapses when a replying session waits more than `COLLAPSE_S` (2 s) between two of its tokens, or
when it cannot finish within `--timeout` seconds. The workload is long enough that whole conversations
(sessions x turns x ~90 tokens) exceed the pool; the bounded engine forgets the oldest context instead.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from duplexd.bench import write_result

COLLAPSE_S = 2.0
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Why is the sky blue?",
    "How do bees make honey?",
    "Tell me something about the moon.",
    "What should I cook for dinner tonight?",
    "How far away is the sun from the earth?",
    "Can you recommend a good book about history?",
    "What is the difference between weather and climate?",
    "How do I keep a plant alive indoors?",
    "Why do cats purr?",
    "What is a good way to learn a new language?",
]


@dataclass(slots=True)
class _User:
    sid: int
    turns_left: int
    wake_step: int  # next question at this step (while listening)
    replying: bool = False
    last_token_at: float = 0.0
    worst_gap_s: float = 0.0
    tokens: int = 0


@dataclass(slots=True)
class RunResult:
    mode: str
    seed: int
    wall_s: float
    steps: int
    reply_tokens: int
    worst_gap_s: float
    gap_p99_s: float
    finished: bool
    preemptions: int
    recomputed_tokens: int
    peak_rows: int

    @property
    def collapsed(self) -> bool:
        return not self.finished or self.worst_gap_s > COLLAPSE_S


def run_once(engine: Any, mode: str, seed: int, sessions: int, turns: int, timeout_s: float) -> RunResult:
    rng = random.Random(seed)
    users = [_User(engine.open(), turns, wake_step=rng.randrange(0, 20)) for _ in range(sessions)]
    by_sid = {u.sid: u for u in users}
    gaps: list[float] = []
    start = time.monotonic()
    step = peak = 0
    finished = False
    while time.monotonic() - start < timeout_s:
        for u in users:
            if not u.replying and u.turns_left and step >= u.wake_step:
                engine.append_user_text(u.sid, rng.choice(QUESTIONS))
                engine.start_reply(u.sid)
                u.replying, u.turns_left = True, u.turns_left - 1
                u.last_token_at = time.monotonic()
        if all(not u.replying and not u.turns_left for u in users):
            finished = True
            break
        out = engine.step()
        step += 1
        now = time.monotonic()
        peak = max(peak, engine.kv_rows())
        for sid, tokens in out.items():
            u = by_sid[sid]
            gap = now - u.last_token_at
            gaps.append(gap)
            u.worst_gap_s = max(u.worst_gap_s, gap)
            u.last_token_at = now
            u.tokens += len(tokens)
        for u in users:
            if u.replying and not engine.replying(u.sid):
                u.replying = False
                u.wake_step = step + rng.randrange(2, 12)  # the user listens, thinks, asks again
            elif u.replying:
                u.worst_gap_s = max(u.worst_gap_s, now - u.last_token_at)  # waiting counts while it waits
    for u in users:
        engine.close(u.sid)
    gaps.sort()
    return RunResult(
        mode=mode,
        seed=seed,
        wall_s=round(time.monotonic() - start, 2),
        steps=step,
        reply_tokens=sum(u.tokens for u in users),
        worst_gap_s=round(max(u.worst_gap_s for u in users), 3),
        gap_p99_s=round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 3) if gaps else 0.0,
        finished=finished,
        preemptions=int(engine.stats.get("preemptions", 0)),  # (the bounded engine never preempts)
        recomputed_tokens=int(engine.stats.get("recomputed_tokens", 0)),
        peak_rows=peak,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from duplexd.bench.baseline import UnboundedEngine
    from duplexd.dialog.engine import DialogEngine, EngineConfig
    from duplexd.dialog.kv_window import WindowConfig

    bounded_window = WindowConfig(4, args.window)
    pool_rows = args.sessions * bounded_window.capacity
    configs = {
        "bounded": EngineConfig(window=bounded_window, max_sessions=args.sessions, max_reply_tokens=args.reply_tokens),
        "unbounded": EngineConfig(
            window=WindowConfig(4, args.unbounded_window),
            max_sessions=args.sessions,
            max_reply_tokens=args.reply_tokens,
        ),
    }
    base = DialogEngine.load(configs["bounded"])
    engines = {
        "bounded": base,
        "unbounded": UnboundedEngine(base.model, base.tokenizer, configs["unbounded"], kv_budget_tokens=pool_rows),
    }
    runs: list[RunResult] = []
    for seed in range(args.runs):
        for mode in ("bounded", "unbounded") if seed % 2 == 0 else ("unbounded", "bounded"):
            engine = engines[mode]
            if mode == "unbounded":
                engine.stats["preemptions"] = engine.stats["recomputed_tokens"] = 0
            r = run_once(engine, mode, seed, args.sessions, args.turns, args.timeout)
            runs.append(r)
            print(
                f"  seed {seed:2d} {mode:>9}: {r.wall_s:6.1f} s, worst gap {r.worst_gap_s:6.2f} s, "
                f"preemptions {r.preemptions:4d}, peak rows {r.peak_rows:5d}/{pool_rows}"
                f"{'  COLLAPSED' if r.collapsed else ''}",
                flush=True,
            )
    summary = {}
    for mode in ("bounded", "unbounded"):
        rs = [r for r in runs if r.mode == mode]
        summary[mode] = {
            "runs": len(rs),
            "collapsed": sum(r.collapsed for r in rs),
            "unfinished": sum(not r.finished for r in rs),
            "worst_gap_p50_s": statistics.median(r.worst_gap_s for r in rs),
            "worst_gap_max_s": max(r.worst_gap_s for r in rs),
            "gap_p99_median_s": statistics.median(r.gap_p99_s for r in rs),
            "wall_s_median": statistics.median(r.wall_s for r in rs),
            "reply_tokens_per_s_median": statistics.median(r.reply_tokens / r.wall_s for r in rs),
            "preemptions_median": statistics.median(r.preemptions for r in rs),
            "recomputed_tokens_median": statistics.median(r.recomputed_tokens for r in rs),
            "peak_rows_max": max(r.peak_rows for r in rs),
        }
    return {
        "benchmark": "collapse",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "sessions": args.sessions,
        "turns": args.turns,
        "reply_tokens": args.reply_tokens,
        "pool_rows": pool_rows,
        "bounded_window": bounded_window.capacity,
        "collapse_gap_s": COLLAPSE_S,
        **summary,
        "runs": [asdict(r) | {"collapsed": r.collapsed} for r in runs],
    }


def table(r: dict[str, Any]) -> str:
    keys = (
        "collapsed",
        "unfinished",
        "worst_gap_p50_s",
        "worst_gap_max_s",
        "gap_p99_median_s",
        "reply_tokens_per_s_median",
        "preemptions_median",
        "peak_rows_max",
    )
    lines = [f"| KV | runs | {' | '.join(keys)} |", "|---" * (len(keys) + 2) + "|"]
    for mode in ("bounded", "unbounded"):
        m = r[mode]
        cells = " | ".join(f"{m[k]:.3g}" if isinstance(m[k], float) else str(m[k]) for k in keys)
        lines.append(f"| {mode} | {m['runs']} | {cells} |")
    lines.append(
        f"pool: {r['pool_rows']} rows ({r['sessions']} sessions x {r['bounded_window']}); "
        f"collapse = a token gap > {r['collapse_gap_s']} s or unfinished"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    write_result(Path(args.out), result, table(result))
    return 0
