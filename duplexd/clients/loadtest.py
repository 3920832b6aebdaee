"""`duplexd loadtest`: many real-time users talking to one server, and what each of them experienced.

Every simulated user is a `clients.converse` voice client: it says real recordings at real-time pace,
then listens about as long as it spoke (the reply plays, reported like a browser would), and goes on
until the run's duration (`--continuous`: it talks all the time, clips back to back); users start
together or, with `--ramp`, spread over the first half of the run. A refused user (1013 +
`retry_after_ms`) tries again after the hint, as a real client would, until the run ends
(`--no-retry`: it gives up). Measured per user and over all: per-frame lag (`frame.ack`), frames past the
deadline, partial-word latency (a word's end of speech -> the first transcript showing it), end of
speech -> first reply audio, text stalls inside a reply, playback underruns, and sessions that collapsed
(no frame acknowledged for more than 2 s while streaming); and, once a second, the server's admission
limit (`/healthz`). Every connection attempt is counted: admitted, refused by cause (1013 `overloaded`,
HTTP 429 / 503, each with its retry hint) or failed by cause (`no_http_response`, `timeout`, `http_401`,
`closed_1011`, ...); none ends the run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import html
import io
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidMessage, InvalidStatus

from duplexd.clients.clips import RATE, Clip, load, load_clips, silence, speech_end_s
from duplexd.clients.converse import JITTER_S, OUTPUT_RATE, ConversationResult, Received, converse_pcm
from duplexd.clients.stats import percentile
from duplexd.clients.stream import SessionRefused

DEADLINE_MS = 200.0
COLLAPSE_S = 2.0
STALL_S = 0.5  # a gap this long between a reply's text pieces, before it is done, is a stall
CONTINUOUS_GAP_S = 0.3  # between clips in --continuous mode: a breath, too short to end a turn
REFUSED_STATUSES = frozenset({429, 503})  # HTTP answers that mean "not now, come back" (the rest are errors)
DEFAULT_RETRY_MS = 1000  # a refusal without a hint: come back after this
SAMPLES = ("lags_ms", "lag_at_s", "word_latency_s", "eos_to_first_audio_s", "refused_at_s")  # (not in the JSON)


@dataclass(frozen=True, slots=True)
class Line:
    """A clip a user can say, loaded once per run: its audio (16 kHz PCM16) and where its speech ends."""

    pcm: np.ndarray
    speech_end_s: float


def lines_of(clips: list[Clip]) -> list[Line]:
    """Decode, resample and measure each clip once (VAD included: ~0.1 s a clip): every user's program
    is then a concatenation, cheap enough for the event loop that paces the users."""
    out = []
    for clip in clips:
        pcm = load(clip.path)
        out.append(Line(pcm, speech_end_s(pcm)))
    return out


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a connection attempt ended when it did not give a session: `refused` (the server said "not
    now": 1013 `overloaded`, HTTP 429 / 503; come back after `retry_after_ms`) or an error, by `cause`."""

    cause: str
    refused: bool = False
    retry_after_ms: int | None = None


def outcome_of(exc: BaseException) -> Outcome:
    """The outcome an exception from a session attempt stands for. `no_http_response`: the server closed
    the TCP connection before answering the handshake; `closed_<code>`: the WebSocket closed with that code
    (1006: without a close frame) before the session ended."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # (from the client's TaskGroup)
        exc = exc.exceptions[0]
    if isinstance(exc, SessionRefused):
        code = str(exc.reply.get("code", "refused"))
        hint = exc.reply.get("retry_after_ms")
        return Outcome(code, refused=code == "overloaded", retry_after_ms=hint if isinstance(hint, int) else None)
    if isinstance(exc, InvalidStatus):
        status = exc.response.status_code
        return Outcome(f"http_{status}", refused=status in REFUSED_STATUSES, retry_after_ms=_retry_after(exc))
    if isinstance(exc, InvalidMessage):
        return Outcome("no_http_response")
    if isinstance(exc, InvalidHandshake):
        return Outcome("bad_handshake")
    if isinstance(exc, ConnectionClosed):
        return Outcome(f"closed_{exc.rcvd.code if exc.rcvd is not None else 1006}")
    if isinstance(exc, TimeoutError):  # (before OSError: TimeoutError is one)
        return Outcome("timeout")
    if isinstance(exc, ConnectionRefusedError):
        return Outcome("connection_refused")
    if isinstance(exc, ConnectionResetError):
        return Outcome("connection_reset")
    return Outcome(type(exc).__name__)


def _retry_after(exc: InvalidStatus) -> int | None:
    """An HTTP refusal's hint: the body's `retry_after_ms`, else `Retry-After` (seconds)."""
    try:
        body = json.loads(bytes(exc.response.body or b"") or b"{}")
        hint = body.get("retry_after_ms") if isinstance(body, dict) else None
        if isinstance(hint, int):
            return hint
    except ValueError:
        pass
    header = exc.response.headers.get("Retry-After", "")
    return int(header) * 1000 if header.isdigit() else None


@dataclass(slots=True)
class UserResult:
    user: int
    admitted: bool
    refused_retry_after_ms: int | None = None
    refusals: int = 0
    refusal_causes: dict[str, int] = field(default_factory=dict)  # cause -> count (`Outcome.cause`)
    refused_at_s: list[float] = field(default_factory=list)  # (seconds since the run's start, each refusal)
    admitted_after_s: float = 0.0  # from the user's start to its admission (0 unless refused first)
    admitted_at_s: float | None = None  # since the run's start
    error: str | None = None  # the cause (`Outcome.cause`) of the attempt that ended in an error
    error_detail: str | None = None
    error_at_s: float | None = None  # since the run's start
    node: str | None = None  # the process that served it behind a balancer (`session.started.node`)
    frames: int = 0
    lags_ms: list[float] = field(default_factory=list)
    lag_at_s: list[float] = field(default_factory=list)  # when each lag was reported, since the run's start
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

    @property
    def attempts(self) -> int:
        """Connection attempts: every refusal, and the one that got a session or failed."""
        return self.refusals + (1 if self.admitted or self.error is not None else 0)


def program(
    lines: list[Line], user: int, duration_s: float, continuous: bool = False
) -> tuple[np.ndarray, list[float]]:
    """What user `user` says: lines in turn (rotated per user), each followed by as much silence as it
    lasted (at least 2 s: the reply is heard), for `duration_s`; `continuous`: only a breath between
    clips. Returns the audio and each turn's end of speech (stream seconds)."""
    parts, eos, t = [silence(0.5)], [], 0.5
    k = user
    while t < duration_s:
        line = lines[k % len(lines)]
        k += 1
        eos.append(t + line.speech_end_s)
        gap = silence(CONTINUOUS_GAP_S if continuous else max(2.0, len(line.pcm) / RATE))
        parts += [line.pcm, gap]
        t += (len(line.pcm) + len(gap)) / RATE
    return np.concatenate(parts), eos


def measure(user: int, result: ConversationResult, eos_s: list[float], since: float = 0.0) -> UserResult:
    """What user `user` experienced in one conversation; times in the result are `since` the run's start."""
    out = UserResult(user, admitted=True, turns_spoken=len(eos_s), admitted_at_s=result.started_at - since)
    out.node = result.events[0].event.get("node") if result.events else None
    acks = result.of_type("frame.ack")
    out.frames = len(acks)
    out.lags_ms = [a.event["lag_ms"] for a in acks]
    out.lag_at_s = [round(a.t - since, 3) for a in acks]
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
    lines: list[Line],
    duration_s: float,
    delay_s: float,
    *,
    since: float,
    continuous: bool = False,
    retry: bool = True,
    session_s: float | None = None,
) -> list[UserResult]:
    """One user, from `delay_s` after the run's start (`since`) for `duration_s`: one session (a user
    admitted late talks for the rest of the run), or with `session_s` one session after another of that
    length."""
    await asyncio.sleep(delay_s)
    end = time.monotonic() + duration_s
    results: list[UserResult] = []
    while end - time.monotonic() >= 5.0:
        results.append(
            await _session(url, user, lines, end, since=since, continuous=continuous, retry=retry, session_s=session_s)
        )
        if not results[-1].admitted or session_s is None:
            break
    return results


async def _session(
    url: str,
    user: int,
    lines: list[Line],
    end: float,
    *,
    since: float,
    continuous: bool,
    retry: bool,
    session_s: float | None,
) -> UserResult:
    """Attempts until one gives a session (measured) or fails; every refusal is counted by cause and,
    with `retry`, followed by the server's hint."""
    started = time.monotonic()
    unserved = UserResult(user, admitted=False)  # (refused so far; or failed)
    while True:
        remaining = end - time.monotonic()
        if remaining < 5.0:  # not worth a turn: refused for the rest of the run
            return unserved
        audio, eos = program(lines, user, min(remaining, session_s or remaining), continuous)
        heard: list[Received] = []  # (events after session.started: it was admitted)
        try:
            result = await converse_pcm(
                url,
                audio,
                RATE,
                max_s=len(audio) / RATE + 10.0,
                until=lambda events: True,
                on_event=heard.append,
            )
        except Exception as exc:  # every way an attempt can end is an outcome, counted by its cause
            outcome = outcome_of(exc)
            if outcome.refused:
                unserved.refusals += 1
                unserved.refusal_causes[outcome.cause] = unserved.refusal_causes.get(outcome.cause, 0) + 1
                unserved.refused_at_s.append(round(time.monotonic() - since, 3))
                unserved.refused_retry_after_ms = outcome.retry_after_ms
                if not retry:
                    return unserved
                hint_ms = DEFAULT_RETRY_MS if outcome.retry_after_ms is None else outcome.retry_after_ms
                await asyncio.sleep(hint_ms / 1000.0)
                continue
            unserved.admitted = bool(heard)
            unserved.error, unserved.error_detail = outcome.cause, f"{type(exc).__name__}: {exc}"[:300]
            unserved.error_at_s = round(time.monotonic() - since, 3)
            return unserved
        out = measure(user, result, eos, since)
        out.refusals, out.refusal_causes = unserved.refusals, unserved.refusal_causes
        out.refused_at_s, out.refused_retry_after_ms = unserved.refused_at_s, unserved.refused_retry_after_ms
        out.admitted_after_s = result.started_at - started
        return out


def _rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def summarize(users: list[UserResult], *, offered: int, duration_s: float) -> dict[str, Any]:
    """The run's figures: milliseconds to 0.1 ms, seconds to 1 ms, ratios to 4 digits."""
    admitted = [u for u in users if u.admitted]
    lags = [lag for u in admitted for lag in u.lags_ms]
    first_audio = [x for u in admitted for x in u.eos_to_first_audio_s]
    word_latency = [x for u in admitted for x in u.word_latency_s]
    reply_s = sum(u.reply_s for u in admitted)
    refusals: Counter[str] = Counter()
    for u in users:
        refusals.update(u.refusal_causes)
    errors = Counter(u.error for u in users if u.error is not None)
    return {
        "sessions_offered": offered,
        "sessions_admitted": len(admitted),
        "refused": sum(1 for u in users if not u.admitted and u.error is None),
        "refusals": sum(u.refusals for u in users),
        "refusals_by_cause": dict(sorted(refusals.items())),  # overloaded (1013), http_429, http_503
        "errors": sum(errors.values()),
        "errors_by_cause": dict(sorted(errors.items())),  # no_http_response, timeout, http_401, closed_1011, ...
        "attempts": sum(u.attempts for u in users),  # = admitted + refusals + errors, every attempt counted
        # Sessions per process behind a balancer (`session.started.node`; {} for a server on its own).
        "nodes": dict(sorted(Counter(u.node for u in admitted if u.node).items())),
        "failed": sum(errors.values()),  # (= errors; the name earlier reports used)
        "collapsed": sum(1 for u in admitted if u.collapsed),
        "duration_s": duration_s,
        "frames": len(lags),
        "frame_lag_p50_ms": _rounded(percentile(lags, 50), 1),
        "frame_lag_p99_ms": _rounded(percentile(lags, 99), 1),
        "deadline_ms": DEADLINE_MS,
        "deadline_miss_ratio": round(sum(1 for lag in lags if lag > DEADLINE_MS) / len(lags), 4) if lags else None,
        "partial_word_latency_p50_s": _rounded(percentile(word_latency, 50), 3),
        "partial_word_latency_p90_s": _rounded(percentile(word_latency, 90), 3),
        "eos_to_first_audio_p50_s": _rounded(percentile(first_audio, 50), 3),
        "eos_to_first_audio_p90_s": _rounded(percentile(first_audio, 90), 3),
        "replies": sum(u.replies for u in admitted),
        "token_stall_ratio": round(sum(u.stall_s for u in admitted) / reply_s, 4) if reply_s else None,
        "underrun_s": round(sum(u.underrun_s for u in admitted), 3),
    }


def progress_line(elapsed_s: float, duration_s: float, done: int, users: int) -> str:
    """The progress shown while a run goes on: the clock stops at the duration; after it, sessions that
    are still talking (a user's last clip and its reply) finish."""
    if elapsed_s < duration_s:
        return f"{elapsed_s:5.0f}/{duration_s:.0f} s, {done}/{users} users done"
    return f"{duration_s:5.0f}/{duration_s:.0f} s, ending sessions: {done}/{users} users done"


async def _progress(users: list[asyncio.Task[list[UserResult]]], start: float, duration_s: float) -> None:
    width = 0
    while not all(t.done() for t in users):
        line = progress_line(time.monotonic() - start, duration_s, sum(t.done() for t in users), len(users))
        width = max(width, len(line))
        print(f"\r  {line:<{width}}", end="")
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
            a, loop = h.get("admission", {}), h.get("event_loop") or {}
            trace.append(
                {
                    "t": round(time.monotonic() - start, 2),
                    "limit": a.get("limit"),
                    "sessions": h["sessions"],
                    "loop_p99_ms": loop.get("recent_p99_ms"),  # (over the server's last minute)
                    "loop_max_ms": loop.get("recent_max_ms"),
                }
            )
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
    lines = await asyncio.to_thread(lines_of, questions)
    start = time.monotonic()
    delays = [(i * duration_s / 2 / sessions) if ramp else 0.0 for i in range(sessions)]
    tasks = [
        asyncio.create_task(
            run_user(
                url,
                i,
                lines,
                duration_s - d,
                d,
                since=start,
                continuous=continuous,
                retry=retry,
                session_s=session_s,
            )
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
        # The server's event-loop lag during the run: the worst p99 (over its last minute) and the worst lag
        # it reported while the load ran (None: its /healthz has no event-loop figures).
        "loop_lag_p99_ms": _worst(trace, "loop_p99_ms"),
        "loop_lag_max_ms": _worst(trace, "loop_max_ms"),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        # Every session's figures, its samples included (`write_report` leaves those out of the JSON).
        "users": [_user_dict(u) for u in users],
    }


def _worst(trace: list[dict[str, Any]], key: str) -> float | None:
    return max((t[key] for t in trace if t.get(key) is not None), default=None)


def _user_dict(u: UserResult) -> dict[str, Any]:
    d = asdict(u)
    for key in ("admitted_after_s", "admitted_at_s", "stall_s", "reply_s", "underrun_s", "longest_ack_gap_s"):
        d[key] = _rounded(d[key], 3)
    d["lags_ms"] = [round(x, 1) for x in u.lags_ms]
    d["word_latency_s"] = [round(x, 3) for x in u.word_latency_s]
    d["eos_to_first_audio_s"] = [round(x, 3) for x in u.eos_to_first_audio_s]
    return {**d, "collapsed": u.collapsed, "attempts": u.attempts}


def write_report(result: dict[str, Any], out: Path) -> Path:
    """The JSON (without the per-sample lists), and beside it a self-contained HTML page: the figures,
    the refusals and errors by cause, and three plots (frame lag over the run, the latency distributions,
    sessions admitted and refused over the run)."""
    users = result["users"]
    slim = {**result, "users": [{k: v for k, v in u.items() if k not in SAMPLES} for u in users]}
    out.write_text(json.dumps(slim, indent=2) + "\n")
    page = out.with_suffix(".html")
    page.write_text(report_html(result))
    return page


def report_html(result: dict[str, Any]) -> str:
    def cells(items: dict[str, Any]) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in items.items()
        )
        return f"<table>{rows or '<tr><td>(none)</td></tr>'}</table>"

    figures = {k: v for k, v in result.items() if not isinstance(v, list | dict)}
    plots = "".join(
        f'<h2>{html.escape(title)}</h2><img src="data:image/png;base64,{png}" alt="{html.escape(title)}">'
        for title, png in plots_png(result)
    )
    return (
        "<!doctype html><meta charset=utf-8><title>duplexd loadtest</title>"
        "<style>body{font-family:sans-serif;max-width:64em;margin:auto}td{padding:0 1em 0 0}</style>"
        f"<h1>duplexd loadtest: {result['sessions_offered']} sessions, {result['duration_s']:.0f} s</h1>"
        f"{cells(figures)}<h2>refusals by cause</h2>{cells(result['refusals_by_cause'])}"
        f"<h2>errors by cause</h2>{cells(result['errors_by_cause'])}{plots}\n"
    )


def plots_png(result: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(title, base64 PNG) of each plot. Drawn on matplotlib's Agg canvas, without pyplot (no global
    backend, nothing imported until a report is written)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def png(fig: Figure) -> str:
        FigureCanvasAgg(fig)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        return base64.b64encode(buf.getvalue()).decode()

    users = result["users"]
    admitted = [u for u in users if u["admitted"]]

    fig = Figure(figsize=(9, 3.5))
    ax = fig.add_subplot()
    at = np.array([t for u in admitted for t in u["lag_at_s"]])
    lags = np.array([x for u in admitted for x in u["lags_ms"]])
    for u in admitted:  # (one colour per session)
        ax.plot(u["lag_at_s"], u["lags_ms"], ".", markersize=2, alpha=0.5)
    if len(at):  # the worst lag of each second, over all sessions
        second = np.floor(at).astype(int)
        worst = np.full(second.max() + 1, np.nan)
        np.fmax.at(worst, second, lags)
        ax.plot(np.arange(len(worst)) + 0.5, worst, "k-", linewidth=1, label="worst in each second")
    ax.axhline(result["deadline_ms"], color="red", linestyle="--", linewidth=1, label="deadline")
    ax.set_xlabel("seconds since the start of the run")
    ax.set_ylabel("frame lag (ms)")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"frame lag of each admitted session ({len(admitted)})")
    yield "frame lag over time", png(fig)

    fig = Figure(figsize=(9, 3))
    for i, (key, label) in enumerate(
        (
            ("lags_ms", "frame lag (ms)"),
            ("word_latency_s", "partial word latency (s)"),
            ("eos_to_first_audio_s", "end of speech -> first audio (s)"),
        )
    ):
        ax = fig.add_subplot(1, 3, i + 1)
        values = np.sort([x for u in admitted for x in u[key]])
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
            for q, style in ((50, ":"), (90, "--")):
                ax.axvline(float(np.percentile(values, q)), color="grey", linestyle=style, linewidth=1)
            if key == "lags_ms":
                ax.axvline(result["deadline_ms"], color="red", linestyle="--", linewidth=1)
                ax.set_xscale("symlog", linthresh=1.0)
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction <= x" if i == 0 else "")
        ax.set_title(f"n = {len(values)} (p50 :, p90 --)", fontsize=9)
    yield "latency distributions", png(fig)

    fig = Figure(figsize=(9, 5))
    top = fig.add_subplot(2, 1, 1)
    bottom = fig.add_subplot(2, 1, 2, sharex=top)
    admissions = sorted(u["admitted_at_s"] for u in admitted if u["admitted_at_s"] is not None)
    top.step([0.0, *admissions], range(len(admissions) + 1), where="post", label="admitted (total, this client)")
    trace = result["admission_trace"]
    if trace:
        top.plot([p["t"] for p in trace], [p["sessions"] for p in trace], "k-", linewidth=1, label="server: sessions")
        top.plot([p["t"] for p in trace], [p["limit"] for p in trace], "k:", linewidth=1, label="server: limit")
    top.set_ylabel("sessions")
    top.legend(loc="upper right", fontsize=8)
    refusals = [t for u in users for t in u["refused_at_s"]]
    errors = [u["error_at_s"] for u in users if u["error_at_s"] is not None]
    end = max([1.0, *refusals, *errors, *admissions, *(p["t"] for p in trace)])
    bins = np.arange(0.0, math.ceil(end) + 1.0)
    bottom.hist([refusals, errors], bins=bins, stacked=True, label=["refusals", "errors"], color=["C1", "C3"])
    bottom.set_ylabel("per second")
    bottom.set_xlabel("seconds since the start of the run")
    bottom.legend(loc="upper right", fontsize=8)
    yield "admitted and refused over time", png(fig)


def table(result: dict[str, Any]) -> str:
    keys = (
        "sessions_offered",
        "sessions_admitted",
        "refused",
        "refusals",
        "refusals_by_cause",
        "errors",
        "errors_by_cause",
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
    page = write_report(result, args.out)
    print(table(result))
    print(f"wrote {args.out} and {page}")
    return 0
