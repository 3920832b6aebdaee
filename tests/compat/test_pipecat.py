"""pipecat's `OpenAIRealtimeLLMService`, unchanged, in a real pipeline against a real duplexd (issue 18).

No network transport: a microphone that speaks real clips as 24 kHz `InputAudioRawFrame`s at real-time pace (silence
in between, as a live microphone does) and a loudspeaker that plays the replies in real time through pipecat's own
output transport base, which emits the bot-speaking frames. Between pipecat and duplexd a relay records the wire.

One session: a typed turn (the pipeline's opening context, as pipecat's realtime examples start), a spoken turn, a
follow-up spoken the moment `response.done` arrives, and a barge-in during a reply. Each is answered with the user's
transcript, the reply's text and its audio, and no error reaches pipecat.
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = pytest.mark.slow

# Importing pipecat swaps `asyncio.wait_for` for `wait_for2.wait_for` process-wide (on Python < 3.12), and
# collection imports this module before any test runs: every other test of the session would run duplexd on
# pipecat's wait_for (seen: a CancelledWithResultError out of a server's idle-timeout wait). pipecat gets its
# own only while its test runs.
_ASYNCIO_WAIT_FOR = asyncio.wait_for
pytest.importorskip("pipecat.services.openai.realtime.llm")
_PIPECAT_WAIT_FOR, asyncio.wait_for = asyncio.wait_for, _ASYNCIO_WAIT_FOR

from loguru import logger  # noqa: E402
from pipecat.frames.frames import (  # noqa: E402
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMRunFrame,
    LLMTextFrame,
    OutputAudioRawFrame,
    StartFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed  # noqa: E402
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection  # noqa: E402
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService  # noqa: E402
from pipecat.transports.base_input import BaseInputTransport  # noqa: E402
from pipecat.transports.base_output import BaseOutputTransport  # noqa: E402
from pipecat.transports.base_transport import TransportParams  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402
from wiretap import RATE_HZ, WireTap, pcm24  # noqa: E402

from duplexd.bench import scenarios as sc  # noqa: E402
from duplexd.bench.data import wer  # noqa: E402
from duplexd.config import ServerConfig  # noqa: E402


@pytest.fixture(autouse=True)
def _pipecat_s_wait_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asyncio, "wait_for", _PIPECAT_WAIT_FOR)


FRAME_S = 0.02
INSTRUCTIONS = "You are a helpful assistant. Answer in a few words."
TYPED = "Hello! How are you?"
SPOKEN = "clip22_deepspeech_new_home.wav"  # "we must find a new home in the stars"
FOLLOW_UP = "clip14_sb_spk2_snt2.wav"  # "what joy there is in living"
INTERRUPTED = "clip16_sb_example1.wav"  # "The birch canoe slid on the smooth planks"
BARGE_IN = "clip15_sb_spk2_snt4.wav"  # "mend the coat before you go out"


class Microphone(BaseInputTransport):
    """A live microphone: a 20 ms frame every 20 ms, the clips it is given to say, silence in between."""

    def __init__(self) -> None:
        super().__init__(TransportParams(audio_in_enabled=True, audio_in_sample_rate=RATE_HZ))
        self._speech = bytearray()
        self._quiet = asyncio.Event()
        self._capture: asyncio.Task[None] | None = None

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)
        self._capture = self.create_task(self._run())

    async def cleanup(self) -> None:
        if self._capture:
            await self.cancel_task(self._capture)
            self._capture = None
        await super().cleanup()

    async def say(self, pcm: bytes) -> None:
        """Returns once the whole clip has gone out, at real-time pace."""
        self._quiet.clear()
        self._speech += pcm
        await self._quiet.wait()

    async def _run(self) -> None:
        step = int(RATE_HZ * FRAME_S) * 2
        next_t = time.monotonic()
        while True:
            chunk = bytes(self._speech[:step])
            del self._speech[:step]
            if not self._speech:
                self._quiet.set()
            await self.push_audio_frame(
                InputAudioRawFrame(audio=chunk.ljust(step, b"\0"), sample_rate=RATE_HZ, num_channels=1)
            )
            next_t += FRAME_S
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))


class Loudspeaker(BaseOutputTransport):
    """Plays every chunk pipecat writes in real time (a write returns when its chunk has been heard)."""

    def __init__(self) -> None:
        super().__init__(TransportParams(audio_out_enabled=True, audio_out_sample_rate=RATE_HZ))
        self.played_bytes: list[int] = []  # per stretch of bot speech (from each BotStartedSpeakingFrame)
        self._until = 0.0

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def push_frame(self, frame: Frame, direction: FrameDirection = FrameDirection.DOWNSTREAM) -> None:
        if isinstance(frame, BotStartedSpeakingFrame) and direction == FrameDirection.DOWNSTREAM:
            self.played_bytes.append(0)
        await super().push_frame(frame, direction)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        now = time.monotonic()
        self._until = max(self._until, now) + len(frame.audio) / (2 * frame.sample_rate * frame.num_channels)
        self.played_bytes[-1] += len(frame.audio)
        await asyncio.sleep(self._until - now)
        return True


class Frames(BaseObserver):
    """Every frame of the session once, where it was first pushed: by which processor, which way."""

    def __init__(self) -> None:
        super().__init__(observe_every_push=False)
        self.seen: list[tuple[str, FrameDirection, Frame]] = []

    async def on_push_frame(self, data: FramePushed) -> None:
        self.seen.append((data.source.name, data.direction, data.frame))

    def of(self, kind: type[Frame], source: object | None = None, direction: FrameDirection | None = None) -> list:
        """(The bot-speaking frames go both ways, one each: count them one way.)"""
        name = getattr(source, "name", None)
        return [f for s, d, f in self.seen if isinstance(f, kind) and name in (None, s) and direction in (None, d)]

    async def wait(self, kind: type[Frame], count: int, source: object, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.of(kind, source, FrameDirection.DOWNSTREAM)) < count:
            assert time.monotonic() < deadline, f"no {count}x {kind.__name__} from {source} within {timeout_s} s"
            await asyncio.sleep(0.02)


async def test_pipecat_realtime_service_drives_typed_spoken_follow_up_and_barge_in_turns(
    make_server, clip_by_name
) -> None:
    srv = await make_server()
    clips = {name: pcm24(sc.load(clip_by_name[name].path)) for name in (SPOKEN, FOLLOW_UP, INTERRUPTED, BARGE_IN)}
    pipecat_errors: list[str] = []
    sink = logger.add(lambda m: pipecat_errors.append(str(m)), level="ERROR")
    tap = WireTap(srv.port)
    try:
        async with tap.running():
            llm = OpenAIRealtimeLLMService(
                api_key="not-checked",
                base_url=f"ws://127.0.0.1:{tap.port}/v1/realtime",
                settings=OpenAIRealtimeLLMService.Settings(system_instruction=INSTRUCTIONS),
            )
            context = LLMContext([{"role": "user", "content": TYPED}])
            user, assistant = LLMContextAggregatorPair(context)
            mic, speaker, frames = Microphone(), Loudspeaker(), Frames()
            worker = PipelineWorker(
                Pipeline([mic, user, llm, speaker, assistant]),
                params=PipelineParams(audio_in_sample_rate=RATE_HZ, audio_out_sample_rate=RATE_HZ),
                observers=[frames],
                idle_timeout_secs=None,
            )
            runner = WorkerRunner(handle_sigint=False)
            await runner.add_workers(worker)
            running = asyncio.create_task(runner.run())
            try:
                # 1. typed: the opening context is the user's message; pipecat asks for the reply
                await worker.queue_frames([LLMRunFrame()])
                await tap.wait_for("response.done", 1)
                await frames.wait(BotStoppedSpeakingFrame, 1, speaker)
                # 2. spoken, once the reply has been heard
                await mic.say(clips[SPOKEN])
                await tap.wait_for("response.done", 2)
                # 3. spoken again the moment the reply is done (its last audio is still playing)
                await mic.say(clips[FOLLOW_UP])
                await tap.wait_for("response.done", 3)
                await frames.wait(BotStoppedSpeakingFrame, 3, speaker)
                # 4. a question, then the user talks over the reply
                await mic.say(clips[INTERRUPTED])
                await frames.wait(BotStartedSpeakingFrame, 4, speaker)
                await asyncio.sleep(0.3)
                await mic.say(clips[BARGE_IN])
                await tap.wait_for("response.done", 5)
                await frames.wait(BotStoppedSpeakingFrame, 5, speaker)
                await worker.stop_when_done()
                await asyncio.wait_for(asyncio.shield(running), 30)
            finally:
                if not running.done():
                    await worker.cancel()
                    await asyncio.wait_for(running, 30)
    finally:
        logger.remove(sink)
        path = tap.write_trace("pipecat")
        if path:
            print(f"pipecat wire trace: {path}")

    assert not tap.errors(), tap.summary()
    assert not frames.of(ErrorFrame) and not pipecat_errors, (frames.of(ErrorFrame), pipecat_errors)

    # What duplexd answered, on the wire: five responses. The fourth was cut by the barge-in while it played: the
    # server may have finished it by then (its audio runs ahead of playback), or cancelled it.
    done = [e["response"] for e in tap.of("response.done")]
    assert [r["status"] for r in done[:3] + done[4:]] == ["completed"] * 4 and len(done) == 5, tap.summary()
    if done[3]["status"] != "completed":
        # (pipecat truncates the reply on the server's speech_started, racing the server's own cancel)
        assert done[3]["status_details"]["reason"] in ("turn_detected", "client_cancelled"), done[3]
    created = [e for e in tap.of("conversation.item.create", "client")]
    assert created and created[0]["item"]["content"][0]["text"] == TYPED
    heard = [e["transcript"] for e in tap.of("conversation.item.input_audio_transcription.completed")]
    assert len(heard) == 4, heard
    for name, text in zip((SPOKEN, FOLLOW_UP, INTERRUPTED, BARGE_IN), heard, strict=True):
        assert wer([clip_by_name[name].text], [text]) <= 0.4, (name, text)
    audio_by_response = tap.check_replies_heard(done)

    # Paced as a person hears it: each reply nobody cut went out over its own length, less the lead the server
    # keeps ahead of playback (it went out faster and faster after a truncate, the idle time between replies
    # counted as played).
    lead_s = ServerConfig().transport.audio_lead_ms / 1000
    for r in (done[0], done[1], done[2], done[4]):
        sent_at = [
            m.t_s for m in tap.messages if m.type == "response.output_audio.delta" and m.event["response_id"] == r["id"]
        ]
        audio_s = audio_by_response[r["id"]] / (RATE_HZ * 2)
        assert sent_at[-1] - sent_at[0] >= audio_s - lead_s - 0.5, (r["id"], sent_at[-1] - sent_at[0], audio_s)

    # The barge-in: pipecat cut its playback of the fourth reply and told the server what was heard of it.
    assert frames.of(InterruptionFrame)
    cut_item = done[3]["output"][0]["id"]
    truncates = [e for e in tap.of("conversation.item.truncate", "client") if e["item_id"] == cut_item]
    assert truncates, tap.summary()  # (pipecat may send a second, shorter one: audio that came after the first)
    assert truncates[0]["audio_end_ms"] * RATE_HZ * 2 // 1000 <= speaker.played_bytes[3] + RATE_HZ * 2 // 10
    assert speaker.played_bytes[3] < audio_by_response[done[3]["id"]]
    assert any(e["item_id"] == cut_item for e in tap.of("conversation.item.truncated"))

    # All of it reached pipecat, as pipecat's own frames: transcripts, text, audio, played and bracketed by speaking.
    assert [f.text for f in frames.of(TranscriptionFrame, llm)] == heard
    wire_text = "".join(e["delta"] for e in tap.of("response.output_audio_transcript.delta"))
    assert "".join(f.text for f in frames.of(LLMTextFrame, llm)) == wire_text
    assert sum(len(f.audio) for f in frames.of(TTSAudioRawFrame, llm)) == sum(audio_by_response.values())
    # (one more stretch of speech is possible after the barge-in: audio the server sent before the truncate reached it)
    assert len(frames.of(TTSStartedFrame, llm)) >= 5
    spoke = [
        len(frames.of(k, speaker, FrameDirection.DOWNSTREAM))
        for k in (BotStartedSpeakingFrame, BotStoppedSpeakingFrame)
    ]
    assert spoke[0] == spoke[1] >= 5
    # Played in real time to the end, the replies nobody talked over (the first, third and last).
    for i, played in ((0, speaker.played_bytes[0]), (2, speaker.played_bytes[2]), (4, speaker.played_bytes[-1])):
        assert played >= audio_by_response[done[i]["id"]], (i, speaker.played_bytes)
