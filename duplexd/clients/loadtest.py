"""`duplexd loadtest`: many real-time users talking to one server, and what each of them experienced.

Every simulated user is a `clients.converse` voice client: it says real recordings at real-time pace,
then listens about as long as it spoke (the reply plays, reported like a browser would), and goes on
until the run's duration (`--continuous`: it talks all the time, clips back to back); users start
together or, with `--ramp`, spread over the first half of the run. A refused user (1013 +
`retry_after_ms`) tries again after the hint, as a real client would, until the run ends
(`--no-retry`: it gives up). Measured per user and over all: per-frame lag (`frame.ack`), frames past the
deadline, partial-word latency (a word's end of speech -> the first transcript showing it), end of
speech -> first reply audio, text stalls inside a reply, playback underruns, refusals, and sessions that
collapsed (no frame acknowledged for more than 2 s while streaming); and, once a second, the server's
admission limit (`/healthz`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from duplexd.bench import scenarios as sc
from duplexd.bench.data import Clip, load_clips
from duplexd.bench.latency import percentile
from duplexd.clients.converse import JITTER_S, OUTPUT_RATE, ConversationResult, converse_pcm
from duplexd.clients.stream import SessionRefused

DEADLINE_MS = 200.0
COLLAPSE_S = 2.0
STALL_S = 0.5  # a gap this long between a reply's text pieces, before it is done, is a stall
CONTINUOUS_GAP_S = 0.3  # between clips in --continuous mode: a breath, too short to end a turn


@dataclass(slots=True)
class UserResult:
    user: int
    admitted: bool
    refused_retry_after_ms: int | None = None
    refusals: int = 0
    admitted_after_s: float = 0.0  # from the user's start to its admission (0 unless refused first)
    error: str | None = None
    node: str | None = None  # the process that served it behind a balancer (`session.started.node`)
    frames: int = 0
    lags_ms: list[float] = field(default_factory=list)
    word_latency_s: list[float] = field(default_factory=list)
    eos_to_first_audio_s: list[float] = field(default_factory=list)
    turns_spoken: int = 0
    replies: int = 0
    stall_s: float = 0.0
    reply_s: float = 0.0
    underrun_s: float = 0.0
    longest_ack_gap_s: float = 0.0

    @property
    def collapsed(self) -> bool:
        return self.admitted and self.longest_ack_gap_s > COLLAPSE_S


def program(
    clips: list[Clip], user: int, duration_s: float, continuous: bool = False
) -> tuple[np.ndarray, list[float]]:
    """What user `user` says: clips in turn (rotated per user), each followed by as much silence as it
    lasted (at least 2 s: the reply is heard), for `duration_s`; `continuous`: only a breath between
    clips. Returns the audio and each turn's end of speech (stream seconds)."""
    parts, eos, t = [sc.silence(0.5)], [], 0.5
    k = user
    while t < duration_s:
        speech = sc.load(clips[k % len(clips)].path)
        k += 1
        eos.append(t + sc.speech_end_s(speech))
        gap = sc.silence(CONTINUOUS_GAP_S if continuous else max(2.0, len(speech) / sc.RATE))
        parts += [speech, gap]
        t += (len(speech) + len(gap)) / sc.RATE
    return np.concatenate(parts), eos


def measure(user: int, result: ConversationResult, eos_s: list[float]) -> UserResult:
    out = UserResult(user, admitted=True, turns_spoken=len(eos_s))
    out.node = result.events[0].event.get("node") if result.events else None
    acks = result.of_type("frame.ack")
    out.frames = len(acks)
    out.lags_ms = [a.event["lag_ms"] for a in acks]
    times = [result.started_at] + [a.t for a in acks]
    out.longest_ack_gap_s = max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)
    newest = 0.0  # the latest word end shown so far: an update showing a later one shows new words
    for r in result.events:
        if r.event.get("type") in ("transcript.partial", "transcript.final") and r.event.get("words"):
            end = max(w["end"] for w in r.event["words"])
            if end > newest:
                out.word_latency_s.append(r.t - result.wall_time(end))
                newest = end
    starts = {r.event["reply"]: r.t for r in result.of_type("reply.started")}
    out.replies = len(starts)
    first_audio: dict[int, float] = {}
    for a in result.audio:
        if a.reply is not None:
            first_audio.setdefault(a.reply, a.t)
    for turn in result.of_type("turn.ended"):  # the end of speech this turn answered: the last one before it
        spoken = [e for e in eos_s if result.wall_time(e) <= turn.t]
        reply = turn.event["turn"]
        if spoken and reply in first_audio:
            out.eos_to_first_audio_s.append(first_audio[reply] - result.wall_time(spoken[-1]))
    for reply, started in starts.items():  # text stalls: long gaps between a reply's pieces before its end
        times = [started] + [r.t for r in result.of_type("reply.delta") if r.event["reply"] == reply]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        out.stall_s += sum(g for g in gaps if g > STALL_S)
        out.reply_s += times[-1] - started
    for reply in starts:  # playback underruns: a real-time player behind a JITTER_S buffer
        chunks = [a for a in result.audio if a.reply == reply]
        if not chunks:
            continue
        clock = chunks[0].t + JITTER_S
        for a in chunks:
            if a.t > clock:
                out.underrun_s += a.t - clock
                clock = a.t
            clock += len(a.samples) / OUTPUT_RATE
    return out


async def run_user(
    url: str,
    user: int,
    clips: list[Clip],
    duration_s: float,
    delay_s: float,
    *,
    continuous: bool = False,
    retry: bool = True,
    session_s: float | None = None,
) -> list[UserResult]:
    """One user, from `delay_s` after the run's start for `duration_s`: one session (a user admitted late
    talks for the rest of the run), or with `session_s` one session after another of that length."""
    await asyncio.sleep(delay_s)
    end = time.monotonic() + duration_s
    results: list[UserResult] = []
    while end - time.monotonic() >= 5.0:
        results.append(await _session(url, user, clips, end, continuous=continuous, retry=retry, session_s=session_s))
        if not results[-1].admitted or session_s is None:
            break
    return results


async def _session(
    url: str, user: int, clips: list[Clip], end: float, *, continuous: bool, retry: bool, session_s: float | None
) -> UserResult:
    started, refusals, hint = time.monotonic(), 0, None
    while True:
        remaining = end - time.monotonic()
        if remaining < 5.0:  # not worth a turn: refused for the rest of the run
            return UserResult(user, admitted=False, refused_retry_after_ms=hint, refusals=refusals)
        audio, eos = program(clips, user, min(remaining, session_s or remaining), continuous)
        try:
            result = await converse_pcm(
                url, audio, sc.RATE, max_s=len(audio) / sc.RATE + 10.0, until=lambda events: True
            )
        except SessionRefused as exc:
            refusals, hint = refusals + 1, exc.reply.get("retry_after_ms")
            if not retry:
                return UserResult(user, admitted=False, refused_retry_after_ms=hint, refusals=refusals)
            await asyncio.sleep((hint or 1000) / 1000.0)
            continue
        except (OSError, RuntimeError) as exc:
            return UserResult(user, admitted=False, refusals=refusals, error=f"{type(exc).__name__}: {exc}")
        out = measure(user, result, eos)
        out.refusals, out.refused_retry_after_ms = refusals, hint
        out.admitted_after_s = result.started_at - started
        return out


def summarize(users: list[UserResult], *, offered: int, duration_s: float) -> dict[str, Any]:
    admitted = [u for u in users if u.admitted]
    lags = [lag for u in admitted for lag in u.lags_ms]
    first_audio = [x for u in admitted for x in u.eos_to_first_audio_s]
    word_latency = [x for u in admitted for x in u.word_latency_s]
    reply_s = sum(u.reply_s for u in admitted)
    return {
        "sessions_offered": offered,
        "sessions_admitted": len(admitted),
        "refused": sum(1 for u in users if not u.admitted and u.error is None),
        "refusals": sum(u.refusals for u in users),
        # Sessions per process behind a balancer (`session.started.node`; {} for a server on its own).
        "nodes": dict(sorted(Counter(u.node for u in admitted if u.node).items())),
        "failed": sum(1 for u in users if u.error is not None),
        "collapsed": sum(1 for u in admitted if u.collapsed),
        "duration_s": duration_s,
        "frames": len(lags),
        "frame_lag_p50_ms": percentile(lags, 50),
        "frame_lag_p99_ms": percentile(lags, 99),
        "deadline_ms": DEADLINE_MS,
        "deadline_miss_ratio": (sum(1 for lag in lags if lag > DEADLINE_MS) / len(lags)) if lags else None,
        "partial_word_latency_p50_s": percentile(word_latency, 50),
        "partial_word_latency_p90_s": percentile(word_latency, 90),
        "eos_to_first_audio_p50_s": percentile(first_audio, 50),
        "eos_to_first_audio_p90_s": percentile(first_audio, 90),
        "replies": sum(u.replies for u in admitted),
        "token_stall_ratio": (sum(u.stall_s for u in admitted) / reply_s) if reply_s else None,
        "underrun_s": round(sum(u.underrun_s for u in admitted), 3),
    }


async def _progress(users: list[asyncio.Task[list[UserResult]]], start: float, duration_s: float) -> None:
    while not all(t.done() for t in users):
        done = sum(t.done() for t in users)
        print(f"\r  {time.monotonic() - start:5.0f}/{duration_s:.0f} s, {done}/{len(users)} users done", end="")
        sys.stdout.flush()
        await asyncio.sleep(1.0)
    print()


def health_url(url: str) -> str:
    """ws://host:port/v1/stream -> http://host:port/healthz"""
    scheme, _, rest = url.partition("://")
    return f"{'https' if scheme == 'wss' else 'http'}://{rest.split('/', 1)[0]}/healthz"


async def _watch_admission(url: str, start: float, trace: list[dict[str, Any]]) -> None:
    """The server's admission limit and sessions, once a second (as long as `/healthz` answers)."""
    import urllib.request

    def get() -> dict[str, Any]:
        with urllib.request.urlopen(health_url(url), timeout=2) as r:
            return json.loads(r.read())

    while True:
        try:
            h = await asyncio.to_thread(get)
            a = h.get("admission", {})
            trace.append({"t": round(time.monotonic() - start, 2), "limit": a.get("limit"), "sessions": h["sessions"]})
        except (OSError, ValueError, KeyError):
            pass
        await asyncio.sleep(1.0)


async def run(
    url: str,
    sessions: int,
    duration_s: float,
    clips: list[Clip],
    ramp: bool,
    *,
    continuous: bool = False,
    retry: bool = True,
    session_s: float | None = None,
) -> dict[str, Any]:
    """`sessions` concurrent users; with `session_s`, each holds sessions of that length one after another
    (then `sessions_admitted` and `refused` count sessions, `sessions_offered` users)."""
    questions = [c for c in clips if c.speakers == 1 and c.text and c.duration_s <= 8.0] or clips
    start = time.monotonic()
    delays = [(i * duration_s / 2 / sessions) if ramp else 0.0 for i in range(sessions)]
    tasks = [
        asyncio.create_task(
            run_user(url, i, questions, duration_s - d, d, continuous=continuous, retry=retry, session_s=session_s)
        )
        for i, d in enumerate(delays)
    ]
    trace: list[dict[str, Any]] = []
    watcher = asyncio.create_task(_watch_admission(url, start, trace))
    await _progress(tasks, start, duration_s)
    watcher.cancel()
    users = [u for t in tasks for u in t.result()]
    return {
        **summarize(users, offered=sessions, duration_s=duration_s),
        "url": url,
        "ramp": ramp,
        "continuous": continuous,
        "session_s": session_s,
        "admission_trace": trace,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "users": [{**asdict(u), "collapsed": u.collapsed, "lags_ms": None, "word_latency_s": None} for u in users],
        "_lags_by_user": {u.user: u.lags_ms for u in users if u.admitted},  # (the last session of each)
    }


def write_report(result: dict[str, Any], out: Path) -> Path:
    """The JSON, and beside it an HTML page with the figures and, where matplotlib is installed
    (`pip install 'duplexd[loadtest]'`), a plot of frame lag over the run per user."""
    lags = result.pop("_lags_by_user")
    out.write_text(json.dumps(result, indent=2) + "\n")
    html = out.with_suffix(".html")
    rows = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in result.items() if not isinstance(v, list | dict))
    plot = ""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        for user, values in lags.items():
            ax.plot(values, linewidth=0.8, label=f"user {user}")
        ax.axhline(result["deadline_ms"], color="red", linestyle="--", linewidth=1, label="deadline")
        ax.set_xlabel("frame ack")
        ax.set_ylabel("frame lag (ms)")
        ax.set_yscale("log")
        fig.tight_layout()
        png = out.with_suffix(".lag.png")
        fig.savefig(png, dpi=100)
        plt.close(fig)
        plot = f'<img src="{png.name}" alt="frame lag per user">'
    except ImportError:
        plot = "<p>(no plot: matplotlib is not installed)</p>"
    html.write_text(
        "<!doctype html><meta charset=utf-8><title>duplexd loadtest</title>"
        f"<h1>duplexd loadtest: {result['sessions_offered']} sessions, {result['duration_s']:.0f} s</h1>"
        f"<table>{rows}</table>{plot}\n"
    )
    return html


def table(result: dict[str, Any]) -> str:
    keys = (
        "sessions_offered",
        "sessions_admitted",
        "refused",
        "collapsed",
        "frame_lag_p50_ms",
        "frame_lag_p99_ms",
        "deadline_miss_ratio",
        "partial_word_latency_p90_s",
        "eos_to_first_audio_p50_s",
        "eos_to_first_audio_p90_s",
        "token_stall_ratio",
        "underrun_s",
    )
    lines = [f"{k:>26}: {result[k]}" for k in keys]
    if result.get("nodes"):
        lines.append(f"{'sessions per process':>26}: {result['nodes']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    clips = load_clips(args.clips)
    result = asyncio.run(
        run(args.url, args.sessions, args.duration, clips, args.ramp, continuous=args.continuous, retry=args.retry)
    )
    html = write_report(result, args.out)
    print(table(result))
    print(f"wrote {args.out} and {html}")
    return 0
