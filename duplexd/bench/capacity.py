"""`duplexd bench capacity` and `duplexd bench overload`: how many people one server holds, and what
admission control does when more come.

capacity: a fresh `duplexd serve` (admission off, so nothing is refused) per concurrency N = 1, 2, ...,
each under `duplexd loadtest` for `--duration` seconds: conversational users (they talk in turns with
pauses and listen to the replies, about half the time talking), or with `--continuous` users who talk
all the time. N* is the largest N for which every N' <= N met the criteria: frame-deadline misses <= 1 %,
partial-word latency p90 <= 2 s, end of speech -> first reply audio p90 <= 1.5 s (conversational only),
no collapsed session. The sweep stops after two failing N in a row.

overload: `--sessions` users (2 x N* by default) that hold sessions of `--session-s` seconds one after
another and retry after the hint when refused, against a server with admission on and then off. Reports
what the admitted sessions got, the controller's limit over the run, and where it settled (the median
over the run's second half). `--reply-lag-s` sets the controller's reply-lag target: N*'s first-audio
bound (1.5 s from the end of speech) minus the endpointer's wait (~0.85 s here) is ~0.65 s from the
turn's end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from duplexd.bench import write_result
from duplexd.bench.server import server_process
from duplexd.clients import loadtest
from duplexd.clients.clips import load_clips

MAX_MISS_RATIO = 0.01
MAX_WORD_LATENCY_P90_S = 2.0
MAX_FIRST_AUDIO_P90_S = 1.5


def meets(r: dict[str, Any], *, continuous: bool) -> list[str]:
    """The criteria this load-test result fails (empty: it is schedulable)."""
    failed = []
    if r["deadline_miss_ratio"] is None or r["deadline_miss_ratio"] > MAX_MISS_RATIO:
        failed.append("deadline_miss_ratio")
    if r["partial_word_latency_p90_s"] is None or r["partial_word_latency_p90_s"] > MAX_WORD_LATENCY_P90_S:
        failed.append("partial_word_latency_p90_s")
    if not continuous and (
        r["eos_to_first_audio_p90_s"] is None or r["eos_to_first_audio_p90_s"] > MAX_FIRST_AUDIO_P90_S
    ):
        failed.append("eos_to_first_audio_p90_s")
    if r["collapsed"] or r["sessions_admitted"] < r["sessions_offered"]:
        failed.append("collapsed_or_refused")
    return failed


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    r.pop("_lags_by_user", None)
    return {k: v for k, v in r.items() if k not in ("users", "url")}


def _load(port: int, sessions: int, duration_s: float, clips: list, **kwargs: Any) -> dict[str, Any]:
    url = f"ws://127.0.0.1:{port}/v1/stream"
    return _summary(asyncio.run(loadtest.run(url, sessions, duration_s, clips, **kwargs)))


def sweep(max_sessions: int, measure: Callable[[int], dict[str, Any]], *, continuous: bool = False) -> tuple[int, list]:
    """Load tests at N = 1, 2, ... (`measure(n)`) until two N in a row fail the criteria, or `max_sessions`.
    Returns N* (the largest N for which every N' <= N passed) and the runs, each with its `failed` list."""
    rows: list[dict[str, Any]] = []
    n_star, failing = 0, 0
    for n in range(1, max_sessions + 1):
        r = measure(n)
        r["failed"] = meets(r, continuous=continuous)
        rows.append(r)
        print(f"  {'ok' if not r['failed'] else 'fails ' + ', '.join(r['failed'])}", flush=True)
        if not r["failed"] and failing == 0:
            n_star = n
        failing = failing + 1 if r["failed"] else 0
        if failing >= 2:
            break
    return n_star, rows


def capacity(args: argparse.Namespace) -> dict[str, Any]:
    clips = load_clips(args.data)

    def measure(n: int) -> dict[str, Any]:
        print(f"N = {n}", flush=True)
        with server_process(args.config, settings={"admission.enabled": "false"}) as port:
            return _load(port, n, args.duration, clips, ramp=False, continuous=args.continuous)

    n_star, rows = sweep(args.max_sessions, measure, continuous=args.continuous)
    return {
        "benchmark": "capacity",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": "continuous" if args.continuous else "conversational",
        "duration_s": args.duration,
        "criteria": {
            "deadline_miss_ratio_max": MAX_MISS_RATIO,
            "partial_word_latency_p90_s_max": MAX_WORD_LATENCY_P90_S,
            "eos_to_first_audio_p90_s_max": None if args.continuous else MAX_FIRST_AUDIO_P90_S,
        },
        "n_star": n_star,
        "runs": rows,
    }


def overload(args: argparse.Namespace) -> dict[str, Any]:
    clips = load_clips(args.data)
    modes: dict[str, Any] = {}
    for mode in ("on", "off"):
        print(f"admission {mode}: {args.sessions} users, sessions of {args.session_s:.0f} s")
        settings = {"admission.enabled": "true" if mode == "on" else "false"}
        if args.reply_lag_s is not None:
            settings["admission.reply_lag_s"] = str(args.reply_lag_s)
        with server_process(args.config, settings=settings) as port:
            r = _load(port, args.sessions, args.duration, clips, ramp=True, session_s=args.session_s)
        half = [p["limit"] for p in r["admission_trace"] if p["t"] >= args.duration / 2 and p["limit"] is not None]
        r["settled_limit"] = statistics.median(half) if half else None
        r["failed"] = meets(r, continuous=False)
        modes[mode] = r
    settled = modes["on"]["settled_limit"]
    return {
        "benchmark": "overload",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "users": args.sessions,
        "session_s": args.session_s,
        "duration_s": args.duration,
        "n_star": args.n_star,
        "reply_lag_target_s": args.reply_lag_s,
        "settled_within_10pct": (abs(settled - args.n_star) <= 0.1 * args.n_star) if settled and args.n_star else None,
        "on": modes["on"],
        "off": modes["off"],
    }


KEYS = (
    "sessions_offered",
    "sessions_admitted",
    "refusals",
    "collapsed",
    "frame_lag_p99_ms",
    "deadline_miss_ratio",
    "partial_word_latency_p90_s",
    "eos_to_first_audio_p90_s",
)


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def table(result: dict[str, Any]) -> str:
    if result["benchmark"] == "capacity":
        rows = [(f"N={r['sessions_offered']}", r) for r in result["runs"]]
        foot = f"N* = {result['n_star']} ({result['workload']})"
    else:
        rows = [(f"admission {m}", result[m]) for m in ("on", "off")]
        foot = f"settled limit {result['on']['settled_limit']} vs N* {result['n_star']}"
    head = f"{'':>14} " + " ".join(f"{k[:14]:>14}" for k in (*KEYS, "failed"))
    lines = [head]
    for name, r in rows:
        lines.append(f"{name:>14} " + " ".join(f"{_fmt(r[k]):>14}" for k in KEYS) + f" {','.join(r['failed']) or 'ok'}")
    return "\n".join([*lines, foot])


def main(args: argparse.Namespace) -> int:
    result = capacity(args) if args.what == "capacity" else overload(args)
    write_result(Path(args.out), result, table(result))
    return 0
