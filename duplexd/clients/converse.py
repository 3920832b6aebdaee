"""A Python voice client: talk to the server with recorded speech and play its replies in real time.

It behaves like the browser client: audio goes out in 20 ms frames at real-time pace (followed by silence,
as a quiet microphone would send), reply audio is "played" on a real-time clock (a small jitter buffer,
then 24 kHz samples at wall-clock rate), and the playback position is reported every 100 ms, so pacing,
barge-in and what-was-heard work exactly as with a person at a browser.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplexd.clients.stream import FRAME_MS, Received, StreamClient
from duplexd.transport.protocol import parse_audio_out

OUTPUT_RATE = 24_000
JITTER_S = 0.1  # audio buffered before playback starts
REPORT_S = 0.1


@dataclass(slots=True)
class AudioIn:
    t: float  # arrival, time.monotonic()
    reply: int | None  # the reply it belongs to (the last reply.started before it)
    seq: int
    samples: np.ndarray  # int16


@dataclass(slots=True)
class ConversationResult:
    session_id: str
    started_at: float  # monotonic time at which input audio time 0 was sent
    events: list[Received] = field(default_factory=list)
    audio: list[AudioIn] = field(default_factory=list)
    played_samples: int = 0

    def of_type(self, kind: str) -> list[Received]:
        return [r for r in self.events if r.event.get("type") == kind]

    def reply_audio(self, reply: int) -> np.ndarray:
        parts = [a.samples for a in self.audio if a.reply == reply]
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)

    def wall_time(self, stream_s: float) -> float:
        """When input audio at `stream_s` was sent."""
        return self.started_at + stream_s


class _Player:
    """A real-time player: starts after JITTER_S of audio, then consumes samples at wall-clock rate."""

    def __init__(self) -> None:
        self.played = 0
        self.pcm = bytearray()  # everything received (PCM16), for the echo of what is played
        self._echo_from = 0
        self._clock: float | None = None  # when `played` was last advanced, while playing
        self.paused = False  # reply.paused: playback stops where it is until reply.resumed or .interrupted

    @property
    def received(self) -> int:
        return len(self.pcm) // 2

    def advance(self, now: float) -> int:
        if self.paused:
            return self.played
        if self._clock is None:
            if self.received - self.played >= JITTER_S * OUTPUT_RATE:
                self._clock = now
            return self.played
        self.played = min(self.received, self.played + int((now - self._clock) * OUTPUT_RATE))
        self._clock = now if self.played < self.received else None  # underrun: wait for the buffer again
        return self.played

    def pause(self, now: float) -> None:
        """reply.paused: stop playing now, keeping what is buffered."""
        if not self.paused:
            self.advance(now)
            self.paused = True

    def resume(self, now: float) -> None:
        """reply.resumed: play on from where it paused."""
        if self.paused:
            self.paused = False
            self._clock = now if self.played < self.received else None

    def flush(self) -> None:
        """reply.interrupted: drop what was not played (it counts as played: the streams stay aligned)."""
        self.played = self.received
        self.paused = False
        self._clock = None
        self._echo_from = self.played

    def echo(self, n_out: int, out_rate: int) -> np.ndarray:
        """What the loudspeaker played since the last call, resampled to `n_out` samples at `out_rate`
        (a microphone hearing it); float in [-1, 1]."""
        start, end = self._echo_from, self.played
        self._echo_from = end
        if end <= start:
            return np.zeros(n_out, np.float32)
        stream = np.frombuffer(self.pcm, "<i2")[start:end].astype(np.float32) / 32768.0
        x = np.linspace(0, len(stream) - 1, num=max(1, round(len(stream) * out_rate / OUTPUT_RATE)))
        out = np.interp(x, np.arange(len(stream)), stream).astype(np.float32)
        return np.pad(out, (0, max(0, n_out - len(out))))[:n_out]


def _replies_settled(events: list[Received]) -> bool:
    started = sum(1 for r in events if r.event["type"] == "reply.started")
    ended = sum(1 for r in events if r.event["type"] in ("reply.done", "reply.interrupted"))
    return started >= 1 and ended >= started


def listening_after(seconds: float) -> Callable[[list[Received]], bool]:
    """An `until` for `converse_pcm`: every reply has ended, the last at least `seconds` ago. The microphone
    stays open meanwhile, as a user's does: sound after a reply (its echo, a cough) may still become a turn,
    and the reply to that turn is waited for in turn."""

    def settled(events: list[Received]) -> bool:
        ends = [r.t for r in events if r.event["type"] in ("reply.done", "reply.interrupted")]
        return _replies_settled(events) and time.monotonic() - ends[-1] >= seconds

    return settled


def answered_after(speech_end_s: float, give_up_s: float) -> Callable[[list[Received]], bool]:
    """An `until` for `converse_pcm`: every reply has ended, and the last began after `speech_end_s` (stream
    seconds): a reply begun during the speech (a turn that ended too soon) is followed by the turn the rest
    of the speech makes, and by its reply; or `give_up_s` after `speech_end_s`, every reply ended."""

    def settled(events: list[Received]) -> bool:
        if not _replies_settled(events):
            return False
        end = events[0].t + speech_end_s  # (events[0]: session.started, when the first audio was sent)
        started = [r.t for r in events if r.event["type"] == "reply.started"]
        return started[-1] >= end or time.monotonic() - end >= give_up_s

    return settled


async def converse_pcm(
    url: str,
    pcm: np.ndarray,
    sample_rate: int,
    *,
    max_s: float = 90.0,
    until: Callable[[list[Received]], bool] = _replies_settled,
    on_event: Callable[[Received], None] | None = None,
    report_playback: bool = True,
    inject: Callable[[ConversationResult], np.ndarray | None] | None = None,
    echo_gain: float = 0.0,
    echo_path: Callable[[np.ndarray], np.ndarray] | None = None,
) -> ConversationResult:
    """Say `pcm` (int16 mono), keep the microphone open (silence) until `until(events)` holds and the reply
    audio has been played, or `max_s` seconds have passed; then end the session.

    `inject(result)`, asked every frame once `pcm` is all sent, may return more speech to say (talking over
    the reply, a backchannel). `echo_gain` > 0 mixes the reply audio being played back into the
    microphone, as a loudspeaker without echo cancellation would; `echo_path(played)` (float at
    `sample_rate`) mixes in what it makes of it instead (a room: `bench.room.EchoPath`)."""
    client = await StreamClient.connect(url)
    player = _Player()
    try:
        started = await client.start(sample_rate, dialog=True)
        t0 = time.monotonic()
        result = ConversationResult(started["session_id"], t0, [Received(t0, started)])
        current: list[int | None] = [None]
        finished = asyncio.Event()

        async def receive() -> None:
            async for raw in client.ws:
                now = time.monotonic()
                if isinstance(raw, bytes):
                    frame = parse_audio_out(raw)
                    samples = np.frombuffer(frame.pcm, "<i2")
                    result.audio.append(AudioIn(now, current[0], frame.seq, samples))
                    player.pcm += frame.pcm
                    continue
                got = Received(now, json.loads(raw))
                result.events.append(got)
                kind = got.event.get("type")
                if kind == "reply.delta" and "token_seq" in got.event:
                    await client.ack(got.event["token_seq"])  # (over a live socket, tokens arrive in order)
                if kind == "reply.started":
                    current[0] = got.event["reply"]
                    player.resume(now)  # (a new reply is never paused)
                elif kind == "reply.paused":
                    player.pause(now)
                elif kind == "reply.resumed":
                    player.resume(now)
                elif kind == "reply.interrupted":
                    player.flush()
                if on_event is not None:
                    on_event(got)
                if kind == "session.ended":
                    return

        async def report() -> None:
            last = -1
            while not finished.is_set():
                played = player.advance(time.monotonic())
                if report_playback and played != last:
                    last = played
                    await client.ws.send(json.dumps({"type": "playback", "played_ms": 1000 * played / OUTPUT_RATE}))
                await asyncio.sleep(REPORT_S)

        async with asyncio.TaskGroup() as tg:
            receiver = tg.create_task(receive())
            reporter = tg.create_task(report())
            step = sample_rate * FRAME_MS // 1000
            mic = pcm.astype(np.float32) / 32768.0  # what is left to say
            i = 0
            while True:
                due = t0 + i * FRAME_MS / 1000
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                i += 1
                if not len(mic):
                    more = inject(result) if inject is not None else None
                    if more is not None:
                        mic = more.astype(np.float32) / 32768.0
                    elif (until(result.events) and player.played >= player.received) or time.monotonic() - t0 > max_s:
                        break
                frame = np.pad(mic[:step], (0, max(0, step - len(mic))))
                mic = mic[step:]
                if echo_gain or echo_path is not None:
                    player.advance(time.monotonic())
                    played = player.echo(step, sample_rate)
                    frame = frame + (echo_path(played) if echo_path is not None else echo_gain * played)
                await client.send_pcm((np.clip(frame, -1, 1) * 32767).astype("<i2").tobytes())
            finished.set()
            await reporter
            result.played_samples = player.played
            await client.end()
            await receiver
    finally:
        await client.close()
    return result


def describe(result: ConversationResult) -> list[dict[str, Any]]:
    """The conversation's events, with `at_s` = seconds since the first audio was sent."""
    return [{"at_s": round(r.t - result.started_at, 3), **r.event} for r in result.events]
