"""A small Python client for the native protocol: stream a file (or any PCM) and collect the events."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import numpy as np
import soundfile as sf
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from duplexd.errors import CliError, UsageError
from duplexd.transport.protocol import PROTOCOL_VERSION, encode_audio_frame

FRAME_MS = 20
STREAM_PATH = "/v1/stream"  # as duplexd.transport.server serves it (not imported: it loads the engine packages)
DEFAULT_URL = f"ws://127.0.0.1:8000{STREAM_PATH}"


def read_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Read a WAV/FLAC file as mono PCM16 at its own sample rate."""
    data, rate = sf.read(str(path), dtype="int16", always_2d=True)
    mono = data.mean(axis=1).astype(np.int16) if data.shape[1] > 1 else data[:, 0]
    return mono, int(rate)


@dataclass(slots=True)
class Received:
    t: float  # time.monotonic() on arrival
    event: dict[str, Any]


@dataclass(slots=True)
class StreamResult:
    session_id: str
    started_at: float  # monotonic time at which audio time 0 was sent
    speed: float
    events: list[Received] = field(default_factory=list)
    close_code: int | None = None

    def of_type(self, kind: str) -> list[Received]:
        return [r for r in self.events if r.event.get("type") == kind]

    @property
    def finals(self) -> list[dict[str, Any]]:
        return [r.event for r in self.of_type("transcript.final")]

    @property
    def text(self) -> str:
        """The finals joined, each utterance as it reads last (`joined`)."""
        return joined(Final.of(event) for event in self.finals)


@dataclass(frozen=True, slots=True)
class Final:
    """A `transcript.final` as a client reads it."""

    utterance: int
    text: str
    continues: int | None = None  # the utterance this one goes on with
    previous_text: str | None = None  # that one as it reads joined ("best." -> "best"; None: unchanged)

    @classmethod
    def of(cls, event: dict[str, Any]) -> Final:
        return cls(event["utterance"], event["text"], event.get("continues"), event.get("previous_text"))


def as_read(finals: Iterable[Final]) -> dict[int, str]:
    """Each utterance's text as it reads last: a final that continues an earlier one may repair how that
    one ends ("Sunday is the best." | "part of the week." reads "Sunday is the best part of the week.")."""
    texts: dict[int, str] = {}
    for final in finals:
        if final.previous_text is not None and final.continues in texts:
            texts[final.continues] = final.previous_text
        texts[final.utterance] = final.text
    return texts


def joined(finals: Iterable[Final]) -> str:
    """The finals as one text, each utterance as it reads last (`as_read`)."""
    return " ".join(text for text in as_read(finals).values() if text)  # (an utterance can end with no words)


class SessionRefused(RuntimeError):
    """The server answered `session.start` with an error (`reply`), e.g. `overloaded` + `retry_after_ms`."""

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(f"session refused: {reply}")
        self.reply = reply


def resume_url(url: str, started: dict[str, Any]) -> str:
    """`url` with `?node=` when the session lives on a named process behind a balancer (`session.started
    .node`): the balancer routes the resume there."""
    node = started.get("node")
    if not node:
        return url
    return f"{url}{'&' if '?' in url else '?'}{urlencode({'node': node})}"


class StreamClient:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.seq = 0

    @classmethod
    async def connect(cls, url: str) -> StreamClient:
        return cls(await connect(url, max_size=2**22, open_timeout=30))

    async def start(self, sample_rate: int, **extra: Any) -> dict[str, Any]:
        await self.ws.send(
            json.dumps({"type": "session.start", "version": PROTOCOL_VERSION, "sample_rate": sample_rate, **extra})
        )
        reply = json.loads(await self.ws.recv())
        if reply.get("type") != "session.started":
            raise SessionRefused(reply)
        return reply

    @classmethod
    async def resume(
        cls,
        url: str,
        started: dict[str, Any],
        *,
        token_seq: int,
        audio_ms: float,
        seq: int,
        event_seq: int | None = None,
    ) -> tuple[StreamClient, dict[str, Any]]:
        """Continue the session `started` (its `session.started`) on a new connection, after a drop: the
        server resends the reply tokens after `token_seq` and the reply audio after `audio_ms`.
        `seq` is the last audio frame number sent before the drop; with `event_seq` (the last event `n`
        received) the server also replays every event after it. Returns the client and `session.resumed`."""
        client = cls(await connect(resume_url(url, started), max_size=2**22, open_timeout=30))
        client.seq = seq
        await client.ws.send(
            json.dumps(
                {
                    "type": "session.resume",
                    "version": PROTOCOL_VERSION,
                    "session_id": started["session_id"],
                    "resume_token": started["resume"]["token"],
                    "token_seq": token_seq,
                    "audio_ms": audio_ms,
                    **({} if event_seq is None else {"event_seq": event_seq}),
                }
            )
        )
        reply = json.loads(await client.ws.recv())
        if reply.get("type") != "session.resumed":
            await client.close()
            raise SessionRefused(reply)
        return client, reply

    async def ack(self, token_seq: int | None = None, event_seq: int | None = None) -> None:
        """Every reply token up to `token_seq` has been rendered, every event up to `event_seq` received
        (the server may forget them)."""
        fields = {k: v for k, v in (("token_seq", token_seq), ("event_seq", event_seq)) if v is not None}
        await self.ws.send(json.dumps({"type": "ack", **fields}))

    async def send_pcm(self, pcm: bytes) -> None:
        self.seq += 1
        await self.ws.send(encode_audio_frame(self.seq, pcm))

    async def end(self) -> None:
        await self.ws.send(json.dumps({"type": "session.end"}))

    async def close(self) -> None:
        await self.ws.close()


async def stream_pcm(
    url: str,
    pcm: np.ndarray,
    sample_rate: int,
    *,
    speed: float = 1.0,
    on_event: Callable[[Received], None] | None = None,
) -> StreamResult:
    """Stream int16 mono `pcm` in 20 ms frames at `speed` x real time (transcription only: no dialog);
    return every event received."""
    client = await StreamClient.connect(url)
    try:
        started = await client.start(sample_rate, dialog=False)
        t0 = time.monotonic()
        result = StreamResult(started["session_id"], t0, speed, [Received(t0, started)])
        if on_event is not None:
            on_event(result.events[0])

        async def receive() -> None:
            async for raw in client.ws:
                if isinstance(raw, bytes):
                    continue
                got = Received(time.monotonic(), json.loads(raw))
                result.events.append(got)
                if on_event is not None:
                    on_event(got)
                if got.event.get("type") == "session.ended":
                    return

        async with asyncio.TaskGroup() as tg:
            receiver = tg.create_task(receive())
            step = sample_rate * FRAME_MS // 1000
            for i, start in enumerate(range(0, len(pcm), step)):
                due = t0 + (i * FRAME_MS / 1000) / speed
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await client.send_pcm(pcm[start : start + step].astype("<i2").tobytes())
            await client.end()
            await receiver
    finally:
        await client.close()
    result.close_code = client.ws.close_code
    return result


async def stream_file(
    url: str, path: str | Path, *, speed: float = 1.0, on_event: Callable[[Received], None] | None = None
) -> StreamResult:
    pcm, rate = read_audio(path)
    return await stream_pcm(url, pcm, rate, speed=speed, on_event=on_event)


async def check_server(url: str) -> None:
    """Open and close one WebSocket connection to `url` (no session), so a command that would otherwise
    start many users against a wrong URL fails at once; raises what `connect` raises."""
    client = await StreamClient.connect(url)
    await client.close()


def connect_error(url: str, exc: BaseException) -> CliError | None:
    """What went wrong talking to the stream endpoint at `url`, as one line that says what to do; None
    when `exc` is not such a failure."""
    if isinstance(exc, InvalidURI):
        parts = urlsplit(url)
        scheme = {"http": "ws", "https": "wss"}.get(parts.scheme)
        fix = parts._replace(scheme=scheme).geturl() if scheme else f"ws://HOST:PORT{STREAM_PATH}"
        return UsageError(f"--url {url} is not a WebSocket URL ({exc.msg}); use {fix}")
    if isinstance(exc, InvalidStatus):
        return CliError(
            f"{url} answered HTTP {exc.response.status_code} instead of opening a WebSocket: it is not the stream "
            f"endpoint; duplexd serves it at ws://HOST:PORT{STREAM_PATH}"
        )
    if isinstance(exc, InvalidHandshake):
        return CliError(f"{url} is not a WebSocket server ({exc}); are the host and port those of `duplexd serve`?")
    if isinstance(exc, SessionRefused):
        error = exc.reply
        retry = f"; retry in {error['retry_after_ms']} ms" if error.get("retry_after_ms") is not None else ""
        return CliError(f"{url} refused the session: {error.get('code')}: {error.get('message')}{retry}")
    if isinstance(exc, ConnectionClosed):
        code = exc.rcvd.code if exc.rcvd is not None else None
        reason = f" ({exc.rcvd.reason})" if exc.rcvd is not None and exc.rcvd.reason else ""
        return CliError(f"the server at {url} closed the connection (code {code}){reason}")
    if isinstance(exc, ConnectionRefusedError):
        return CliError(
            f"cannot connect to {url}: connection refused; start the server with `duplexd serve`, or pass "
            "--url with the address it listens on"
        )
    if isinstance(exc, socket.gaierror):
        return CliError(f"cannot connect to {url}: unknown host {urlsplit(url).hostname!r}; check --url")
    if isinstance(exc, TimeoutError):
        return CliError(f"cannot connect to {url}: timed out; check --url and that the server is reachable")
    if isinstance(exc, OSError):
        return CliError(f"cannot connect to {url}: {exc.strerror or exc}; check --url")
    return None


@dataclass(frozen=True, slots=True)
class Line:
    """One piece of `duplexd stream` output."""

    text: str
    end: str = "\n"
    stderr: bool = False


_CLEAR = "\r\x1b[2K"  # back to the line's start and erase it: a partial is overwritten by the next one
_HOLD_S = 2.0  # a final that no speech has followed for this long is no longer continued


class StreamOutput:
    """How `duplexd stream` shows the server's events: one line per utterance and the ones that continue
    it, as they read joined (`Sentences`). On a terminal the line in progress (those utterances, then the
    newest partial transcript) is rewritten in place, its newest end where it is wider than the terminal;
    into a pipe or a file only the finished lines, with no terminal escapes. With `json_lines` every event
    is one JSON line, except the `frame.ack` sent for each audio frame unless `acks`. Errors go to stderr
    at once."""

    def __init__(
        self, *, json_lines: bool, acks: bool, tty: bool, hold_s: float = _HOLD_S, width: int | None = None
    ) -> None:
        self._json, self._acks, self._tty = json_lines, acks, tty
        self._sentences = Sentences(hold_s)
        self._partial: tuple[int, str] | None = None  # (utterance, text): the newest partial not yet final
        self._width = width  # the terminal's columns (None: asked at each line)

    def show(self, got: Received) -> list[Line]:
        event = got.event
        kind = event.get("type")
        if self._json:
            return [] if kind == "frame.ack" and not self._acks else [Line(json.dumps(event))]
        if kind == "error":
            # On a terminal, start a new line: the line in progress on stdout would otherwise run into it.
            where = "\n" if self._tty else ""
            return [Line(f"{where}server error {event['code']}: {event['message']}", stderr=True)]
        done = self._sentences.feed(got)
        if not self._tty:
            return [Line(text) for text in done]
        if kind == "transcript.partial":
            self._partial = (event["utterance"], event["text"])
        elif kind == "transcript.final" and self._partial is not None and self._partial[0] <= event["utterance"]:
            self._partial = None
        lines = [Line(f"{_CLEAR}{text}") for text in done]
        if done or kind in ("transcript.partial", "transcript.final"):
            lines += self._in_progress()
        return lines

    def close(self) -> list[Line]:
        """What is still held when the stream ends (whether or not it ended well)."""
        if self._json:
            return []
        lines = [Line(f"{_CLEAR}{text}" if self._tty else text) for text in self._sentences.flush()]
        if self._tty and not lines and self._partial is not None:
            lines = [Line("")]  # (the line in progress ends where it is)
        return lines

    def _in_progress(self) -> list[Line]:
        held, partial = self._sentences.held, self._partial[1] if self._partial is not None else ""
        text = " ".join(t for t in (held, f"… {partial}" if partial else "") if t)
        if not text:
            return []
        width = self._width or shutil.get_terminal_size().columns
        if len(text) >= width:  # (a line that wraps is not rewritten in place: its newest end is shown)
            text = "…" + text[len(text) - width + 2 :]
        return [Line(f"{_CLEAR}{text}", end="")]


class Sentences:
    """Final transcripts as lines of text, each utterance as it reads joined with the ones that continue
    it: a final is held until the next one says whether it goes on with it (`continues`, repairing its end
    with `previous_text`: "And so my fellow Americans" | "ask not ..."), the stream ends, or `hold_s`
    passes with no speech (the server continues only speech that resumes within `[asr] continue_gap_s`,
    1 s by default: a final followed by silence is let go soon after)."""

    def __init__(self, hold_s: float = _HOLD_S) -> None:
        self.hold_s = hold_s
        self._held: list[Final] = []  # the finals of the line held
        self._quiet_since = 0.0  # when the held final came, or speech last stopped after it
        self._speaking = False
        self._later = False  # a later utterance was shown: its final decides

    def feed(self, got: Received) -> list[str]:
        event, kind = got.event, got.event.get("type")
        out: list[str] = []
        held = self._held
        if kind == "transcript.final":
            final = Final.of(event)
            if not held or final.continues != held[-1].utterance:
                out = self.flush()
            self._held.append(final)
            self._quiet_since, self._later = got.t, False
        elif kind == "vad.speech_started":
            self._speaking = True
        elif kind == "vad.speech_stopped":
            self._speaking, self._quiet_since = False, got.t
        elif kind == "transcript.partial" and held and event["utterance"] > held[-1].utterance:
            self._later = True
        elif kind == "session.ended":
            return self.flush()
        waiting = self._speaking or self._later
        if self._held and not waiting and got.t - self._quiet_since >= self.hold_s:
            out += self.flush()
        return out

    @property
    def held(self) -> str:
        """The line held so far (it may go on), each utterance as it reads joined."""
        return joined(self._held)

    def flush(self) -> list[str]:
        line = self.held
        self._held = []
        return [line] if line else []
