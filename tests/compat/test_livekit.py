"""LiveKit Agents' OpenAI realtime plugin, unchanged, inside an `AgentSession` against a real duplexd (issue 18).

No room and no LiveKit server: the session's audio input is a microphone that speaks real clips at real-time pace
(silence in between) and its audio output a loudspeaker that plays the replies in real time and reports playback as
LiveKit's sinks do. Between the plugin and duplexd a relay records the wire.

One session: a spoken turn, a barge-in during a reply, and `generate_reply`, whose response the server must
acknowledge (the `response.created` that carries the request's metadata back) within a second. No `error` is logged
by the plugin or reaches the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("livekit.agents")
pytest.importorskip("livekit.plugins.openai")

from livekit import rtc  # noqa: E402
from livekit.agents import Agent, AgentSession, io, llm  # noqa: E402
from livekit.plugins.openai.realtime import RealtimeModel  # noqa: E402
from wiretap import RATE_HZ, WireTap, pcm24  # noqa: E402

from duplexd.bench import scenarios as sc  # noqa: E402
from duplexd.bench.data import wer  # noqa: E402

FRAME_S = 0.02
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
SPOKEN = "clip22_deepspeech_new_home.wav"  # "we must find a new home in the stars"
INTERRUPTED = "clip16_sb_example1.wav"  # "The birch canoe slid on the smooth planks"
BARGE_IN = "clip15_sb_spk2_snt4.wav"  # "mend the coat before you go out"
TYPED = "Thank you! And what is your name?"


class Microphone(io.AudioInput):
    """A live microphone: a 20 ms frame every 20 ms, the clips it is given to say, silence in between."""

    def __init__(self) -> None:
        super().__init__(label="microphone")
        self._speech = bytearray()
        self._quiet = asyncio.Event()
        self._next_t: float | None = None

    async def say(self, pcm: bytes) -> None:
        """Returns once the whole clip has gone out, at real-time pace."""
        self._quiet.clear()
        self._speech += pcm
        await self._quiet.wait()

    async def __anext__(self) -> rtc.AudioFrame:
        step = int(RATE_HZ * FRAME_S) * 2
        self._next_t = (self._next_t or time.monotonic()) + FRAME_S
        await asyncio.sleep(max(0.0, self._next_t - time.monotonic()))
        chunk = bytes(self._speech[:step])
        del self._speech[:step]
        if not self._speech:
            self._quiet.set()
        return rtc.AudioFrame(
            data=chunk.ljust(step, b"\0"), sample_rate=RATE_HZ, num_channels=1, samples_per_channel=step // 2
        )


class Loudspeaker(io.AudioOutput):
    """Plays what the session captures in real time, 20 ms at a time; a segment ends when its audio has been played
    after `flush()`, or at once on `clear_buffer()` (interrupted, at the position reached)."""

    def __init__(self) -> None:
        super().__init__(label="loudspeaker", capabilities=io.AudioOutputCapabilities(pause=False), sample_rate=RATE_HZ)
        self.finished: list[io.PlaybackFinishedEvent] = []
        self.started = 0
        self._queue = bytearray()
        self._in_segment = self._flushed = self._playing = False
        self._position_s = 0.0
        self._wake = asyncio.Event()

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        if not self._in_segment:
            self._in_segment, self._flushed, self._playing, self._position_s = True, False, False, 0.0
        self._queue += bytes(frame.data)
        self._wake.set()

    def flush(self) -> None:
        super().flush()
        self._flushed = True
        self._wake.set()

    def clear_buffer(self) -> None:
        self._queue.clear()
        if self._in_segment:
            self._finish(interrupted=True)

    def _finish(self, *, interrupted: bool) -> None:
        self._in_segment = False
        self.on_playback_finished(playback_position=self._position_s, interrupted=interrupted)
        self.finished.append(io.PlaybackFinishedEvent(playback_position=self._position_s, interrupted=interrupted))

    async def play(self) -> None:
        """The device: runs for the whole session."""
        step = int(RATE_HZ * FRAME_S) * 2
        next_t: float | None = None
        while True:
            self._wake.clear()
            if not self._queue:
                if self._in_segment and self._flushed:
                    self._finish(interrupted=False)
                next_t = None
                await self._wake.wait()
                continue
            if not self._playing:
                self._playing = True
                self.started += 1
                self.on_playback_started(created_at=time.time())
            chunk = self._queue[:step]
            del self._queue[:step]
            self._position_s += len(chunk) / (2 * RATE_HZ)
            next_t = (next_t or time.monotonic()) + len(chunk) / (2 * RATE_HZ)
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))

    async def wait(self, *, started: int = 0, finished: int = 0, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.started < started or len(self.finished) < finished:
            assert time.monotonic() < deadline, (self.started, self.finished)
            await asyncio.sleep(0.02)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Session:
    """One AgentSession on the realtime plugin, through the relay, with what it reported."""

    agent_session: AgentSession
    agent: Agent
    mic: Microphone
    speaker: Loudspeaker
    tap: WireTap
    errors_logged: Records = field(default_factory=Records)
    session_errors: list[object] = field(default_factory=list)
    heard: list[str] = field(default_factory=list)
    said: list[llm.ChatMessage] = field(default_factory=list)

    def assert_no_error(self) -> None:
        assert not self.tap.errors(), self.tap.summary()
        logged = [r.getMessage() for r in self.errors_logged.records]
        assert not logged and not self.session_errors, (logged, self.session_errors)


@contextlib.asynccontextmanager
async def livekit_session(port: int, name: str) -> AsyncIterator[Session]:
    tap = WireTap(port)
    async with tap.running():
        model = RealtimeModel(api_key="not-checked", base_url=f"ws://127.0.0.1:{tap.port}/v1")
        s = Session(AgentSession(llm=model), Agent(instructions=INSTRUCTIONS), Microphone(), Loudspeaker(), tap)
        s.agent_session.input.audio = s.mic
        s.agent_session.output.audio = s.speaker
        s.agent_session.on("error", lambda ev: s.session_errors.append(ev.error))
        s.agent_session.on("user_input_transcribed", lambda ev: ev.is_final and s.heard.append(ev.transcript))
        s.agent_session.on(
            "conversation_item_added",
            lambda ev: isinstance(ev.item, llm.ChatMessage) and ev.item.role == "assistant" and s.said.append(ev.item),
        )
        logging.getLogger("livekit").addHandler(s.errors_logged)
        device = asyncio.create_task(s.speaker.play())
        try:
            await s.agent_session.start(s.agent, record=False)
            yield s
        finally:
            await s.agent_session.aclose()
            await model.aclose()
            device.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await device
            logging.getLogger("livekit").removeHandler(s.errors_logged)
            tap.write_trace(name)


async def test_livekit_agent_session_drives_spoken_barge_in_and_generate_reply_turns(make_server, clip_by_name) -> None:
    srv = await make_server()
    clips = {name: pcm24(sc.load(clip_by_name[name].path)) for name in (SPOKEN, INTERRUPTED, BARGE_IN)}
    generations: list[tuple[float, bool]] = []
    async with livekit_session(srv.port, "livekit") as s:
        s.agent.realtime_llm_session.on(
            "generation_created", lambda ev: generations.append((time.monotonic(), ev.user_initiated))
        )
        # 1. spoken
        await s.mic.say(clips[SPOKEN])
        await s.tap.wait_for("response.done", 1)
        await s.speaker.wait(finished=1)
        # 2. a question, then the user talks over the reply (not the first reply: LiveKit sends silence instead of
        # the user for the first 3 s the agent speaks in a session, its aec_warmup_duration)
        await s.mic.say(clips[INTERRUPTED])
        await s.speaker.wait(started=2)
        await asyncio.sleep(0.3)
        await s.mic.say(clips[BARGE_IN])
        await s.tap.wait_for("response.done", 3)
        await s.speaker.wait(finished=3)
        # 3. typed, answered through generate_reply (the microphone stays live, and quiet)
        asked_at = time.monotonic()
        handle = s.agent_session.generate_reply(user_input=TYPED)
        await asyncio.wait_for(handle.wait_for_playout(), 60)
    tap, speaker = s.tap, s.speaker
    s.assert_no_error()

    # What duplexd answered, on the wire: four responses, the second cut by the barge-in while it played.
    done = [e["response"] for e in tap.of("response.done")]
    assert [r["status"] for r in done[:1] + done[2:]] == ["completed"] * 3 and len(done) == 4, tap.summary()
    if done[1]["status"] != "completed":  # (the server may have finished it: its audio runs ahead of playback)
        # (the plugin cancels on the server's speech_started, racing the server's own cancel)
        assert done[1]["status_details"]["reason"] in ("turn_detected", "client_cancelled"), done[1]
    transcribed = [e["transcript"] for e in tap.of("conversation.item.input_audio_transcription.completed")]
    for name, text in zip((SPOKEN, INTERRUPTED, BARGE_IN), transcribed, strict=True):
        assert wer([clip_by_name[name].text], [text]) <= 0.4, (name, text)
    audio_by_response = tap.check_replies_heard(done)

    # The session heard the user and said the replies: transcripts, text and audio, played by the loudspeaker.
    assert s.heard == transcribed
    assert [m.interrupted for m in s.said] == [False, True, False, False]
    whole = (0, 2, 3)  # the replies nobody talked over: played in real time to the end
    assert [s.said[i].text_content for i in whole] == [done[i]["output"][0]["content"][0]["transcript"] for i in whole]
    assert [f.interrupted for f in speaker.finished] == [False, True, False, False]
    for i in whole:
        assert speaker.finished[i].playback_position >= audio_by_response[done[i]["id"]] / (2 * RATE_HZ) - 0.05, i
    assert speaker.finished[1].playback_position < audio_by_response[done[1]["id"]] / (2 * RATE_HZ)

    # The barge-in: the plugin cut its playback and told the server what was heard of the reply.
    cut_item = done[1]["output"][0]["id"]
    cut = [e for e in tap.of("conversation.item.truncate", "client") if e["item_id"] == cut_item]
    deleted = [e for e in tap.of("conversation.item.delete", "client") if e["item_id"] == cut_item]
    assert cut or deleted, tap.summary()
    assert any(
        e["item_id"] == cut_item for e in tap.of("conversation.item.truncated") + tap.of("conversation.item.deleted")
    )

    # generate_reply: the typed message went in as an item, and its response was acknowledged (`response.created`
    # carrying the request's metadata back) within a second, then answered and played.
    (typed,) = [e for e in tap.of("conversation.item.create", "client") if e["item"].get("role") == "user"]
    assert typed["item"]["content"][0]["text"] == TYPED
    (reply_at,) = [t for t, user_initiated in generations if user_initiated]
    assert reply_at - asked_at < 1.0
    (request,) = tap.of("response.create", "client")
    assert done[3]["metadata"] == request["response"]["metadata"]
