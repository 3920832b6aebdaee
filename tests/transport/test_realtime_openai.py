"""`/v1/realtime` with the official `openai` package's realtime client, unchanged, against a real server with
every real model and a real recording. Every server event is also validated strictly against the package's
own pydantic models (its client alone accepts almost anything)."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest
import soxr

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
from openai.types.realtime import RealtimeServerEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from duplexd.bench import scenarios as sc  # noqa: E402
from duplexd.bench.data import wer  # noqa: E402

SERVER_EVENT = TypeAdapter(RealtimeServerEvent)
CHUNK_S = 0.1


def pcm24(audio16: np.ndarray) -> np.ndarray:
    return (soxr.resample(audio16.astype(np.float32) / 32768, 16000, 24000) * 32767).astype("<i2")


class Events:
    """Every server event, as raw JSON validated strictly by the openai package's models."""

    def __init__(self) -> None:
        self.all: list[dict] = []

    def kinds(self) -> list[str]:
        return [e["type"] for e in self.all]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.all if e["type"] == kind]

    async def pump(self, conn, until) -> None:
        while not until(self):
            raw = await conn.recv_bytes()
            event = json.loads(raw)
            SERVER_EVENT.validate_python(event)  # raises on any shape the GA protocol does not allow
            self.all.append(event)


async def test_the_official_client_streams_speech_and_gets_transcripts_text_and_audio(
    make_server, clip_by_name
) -> None:
    srv = await make_server()
    client = openai.AsyncOpenAI(api_key="not-checked", websocket_base_url=f"ws://127.0.0.1:{srv.port}/v1")
    events = Events()
    async with client.realtime.connect(model="duplexd") as conn:
        await events.pump(conn, lambda e: "session.created" in e.kinds())
        await conn.session.update(
            session={
                "type": "realtime",
                "instructions": "You are a helpful assistant. Answer in one short sentence.",
                "output_modalities": ["audio"],
                "tools": [],  # what duplexd has: accepted, no error
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": 24000},
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 800},
                    },
                    "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"},
                },
            }
        )
        await events.pump(conn, lambda e: "session.updated" in e.kinds())
        assert events.of("error") == []  # (clients end their session on an error OpenAI would not send)
        updated = events.of("session.updated")[0]["session"]
        assert updated["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 800

        speech = pcm24(np.concatenate([sc.silence(0.3), sc.load(clip_by_name["clip22_deepspeech_new_home.wav"].path)]))
        step = int(CHUNK_S * 24000)

        async def talk() -> None:
            t0 = time.monotonic()
            i = 0
            while True:  # the clip, then a quiet microphone
                chunk = speech[i * step : (i + 1) * step]
                if not len(chunk):
                    chunk = np.zeros(step, "<i2")
                await conn.input_audio_buffer.append(audio=base64.b64encode(chunk.tobytes()).decode())
                i += 1
                await asyncio.sleep(max(0.0, t0 + i * CHUNK_S - time.monotonic()))

        async with asyncio.TaskGroup() as tg:
            mic = tg.create_task(talk())
            await asyncio.wait_for(events.pump(conn, lambda e: "response.done" in e.kinds()), 120)
            mic.cancel()

        kinds = events.kinds()
        order = [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed",
            "conversation.item.input_audio_transcription.completed",
            "response.created",
            "response.output_audio_transcript.delta",
            "response.output_audio.delta",
            "response.done",
        ]
        assert all(k in kinds for k in order), kinds
        assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order), kinds
        assert events.of("conversation.item.input_audio_transcription.delta"), kinds
        (completed,) = events.of("conversation.item.input_audio_transcription.completed")
        assert "home" in completed["transcript"].lower() or "house" in completed["transcript"].lower(), completed
        done = events.of("response.done")[0]["response"]
        assert done["status"] == "completed"
        transcript = "".join(e["delta"] for e in events.of("response.output_audio_transcript.delta"))
        assert transcript.strip() and done["output"][0]["content"][0]["transcript"] == transcript
        audio = b"".join(base64.b64decode(e["delta"]) for e in events.of("response.output_audio.delta"))
        samples = np.frombuffer(audio, "<i2")
        assert len(samples) > 24000 * 0.5 and np.abs(samples).max() > 1000  # half a second of real sound

        # Text only, from a typed message: the same conversation goes on.
        n = len(events.all)
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And in winter?"}]}
        )
        await conn.response.create()
        await asyncio.wait_for(events.pump(conn, lambda e: e.kinds()[n:].count("response.done") == 1), 120)
        later = events.all[n:]
        kinds = [e["type"] for e in later]
        assert "conversation.item.added" in kinds and "response.output_text.delta" in kinds, kinds
        assert "response.output_audio.delta" not in kinds
        text = "".join(e["delta"] for e in later if e["type"] == "response.output_text.delta")
        final = [e for e in later if e["type"] == "response.done"][0]["response"]
        assert text.strip() and final["status"] == "completed" and final["output"][0]["content"][0]["text"] == text

        # The client's own parser turns every one of them into the right class.
        await conn.response.cancel()  # nothing in progress: an error event, the session goes on
        parsed = await conn.recv()
        assert type(parsed).__name__ == "RealtimeErrorEvent" and parsed.error.code == "response_cancel_not_active"


async def test_client_committed_turns_clear_cancel_and_truncate(make_server, clip_by_name) -> None:
    srv = await make_server()
    client = openai.AsyncOpenAI(api_key="x", websocket_base_url=f"ws://127.0.0.1:{srv.port}/v1")
    events = Events()
    speech = pcm24(sc.load(clip_by_name["clip22_deepspeech_new_home.wav"].path))
    step = int(CHUNK_S * 24000)

    async def say(audio: np.ndarray) -> None:
        t0 = time.monotonic()
        for i in range(0, len(audio), step):
            await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i : i + step].tobytes()).decode())
            await asyncio.sleep(max(0.0, t0 + (i // step + 1) * CHUNK_S - time.monotonic()))

    async with client.realtime.connect(model="duplexd") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await events.pump(conn, lambda e: "session.updated" in e.kinds())
        # Said, then cleared: none of it reaches a turn.
        async with asyncio.TaskGroup() as tg:
            pump = tg.create_task(events.pump(conn, lambda e: False))
            await say(speech[: 24000 * 2])
            await asyncio.sleep(1.5)  # let the recognizer commit some words
            await conn.input_audio_buffer.clear()
            # Said again, committed by the client: one turn, no reply until response.create.
            await say(speech)
            await conn.input_audio_buffer.commit()
            deadline = time.monotonic() + 60
            while "conversation.item.input_audio_transcription.completed" not in events.kinds():
                assert time.monotonic() < deadline, events.kinds()
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.0)
            assert "response.created" not in events.kinds()  # (create_response is off without server VAD)
            await conn.response.create()
            while not events.of("response.output_audio.delta"):
                assert time.monotonic() < deadline + 60, events.kinds()
                await asyncio.sleep(0.05)
            item_id = events.of("response.output_audio.delta")[0]["item_id"]
            await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=300)
            while "response.done" not in events.kinds():
                assert time.monotonic() < deadline + 90, events.kinds()
                await asyncio.sleep(0.05)
            pump.cancel()
    kinds = events.kinds()
    assert "input_audio_buffer.cleared" in kinds
    (completed,) = events.of("conversation.item.input_audio_transcription.completed")
    assert kinds.count("input_audio_buffer.committed") == 1
    # Only the committed audio's words: the cleared two seconds (the clip's start) are not in the turn again.
    reference = clip_by_name["clip22_deepspeech_new_home.wav"].text
    assert wer([reference], [completed["transcript"]]) <= 0.4, completed
    (truncated,) = events.of("conversation.item.truncated")
    assert truncated["audio_end_ms"] == 300
    done = events.of("response.done")[0]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
    # What stays in the conversation is what was heard: at most the first 300 ms of the reply.
    heard = done["output"][0]["content"][0]["transcript"]
    spoken = "".join(e["delta"] for e in events.of("response.output_audio_transcript.delta"))
    assert spoken.startswith(heard) and len(heard) < len(spoken)
