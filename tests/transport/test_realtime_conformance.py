"""`/v1/realtime` answers what pipecat 1.14 and LiveKit Agents 1.8 send without an `error` where OpenAI sends
none (both end or log on any error), and honours what maps onto duplexd. Raw websockets against a real
server; every server event validated strictly against the `openai` package's own models."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("openai")
websockets = pytest.importorskip("websockets")
from openai.types.realtime import RealtimeServerEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

SERVER_EVENT = TypeAdapter(RealtimeServerEvent)

# The first session.update of pipecat 1.14.0's OpenAIRealtimeLLMService (server VAD with its defaults, a
# context's empty tools) and of LiveKit Agents 1.8.9's RealtimeModel (its defaults), as found on the wire.
PIPECAT_UPDATE = {
    "type": "session.update",
    "session": {
        "type": "realtime",
        "instructions": "You are a helpful assistant.",
        "output_modalities": ["audio"],
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "transcription": {"model": "gpt-4o-transcribe"},
                "noise_reduction": None,
                "turn_detection": {
                    "type": "server_vad",
                    "threshold": 0.6,
                    "prefix_padding_ms": 300,
                    "silence_duration_ms": 500,
                },
            },
            "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"},
        },
        "tools": [],
    },
}
LIVEKIT_UPDATE = {
    "type": "session.update",
    "event_id": "session_update_1",
    "session": {
        "type": "realtime",
        "model": "gpt-realtime",
        "output_modalities": ["audio"],
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "noise_reduction": None,
                "transcription": {"model": "gpt-4o-mini-transcribe"},
                "turn_detection": {
                    "type": "semantic_vad",
                    "eagerness": "high",
                    "create_response": True,
                    "interrupt_response": True,
                },
            },
            "output": {"format": {"type": "audio/pcm", "rate": 24000}, "speed": 1.0, "voice": "marin"},
        },
        "max_output_tokens": "inf",
        "tool_choice": "auto",
        "tracing": None,
        "tools": [],
    },
}


class Wire:
    """One raw Realtime connection: every server event validated and kept."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.all: list[dict[str, Any]] = []
        self._seen = 0

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def until(self, kind: str, timeout_s: float = 60.0, **match: Any) -> dict[str, Any]:
        """The next event of `kind` (with these fields) after those already returned."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i in range(self._seen, len(self.all)):
                e = self.all[i]
                if e["type"] == kind and all(e.get(k) == v for k, v in match.items()):
                    self._seen = i + 1
                    return e
            event = json.loads(await asyncio.wait_for(self.ws.recv(), max(0.01, deadline - time.monotonic())))
            SERVER_EVENT.validate_python(event)  # raises on any shape the GA protocol does not allow
            self.all.append(event)

    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.all if e["type"] == "error"]


async def connect(srv: Any) -> tuple[Any, Wire]:
    ws = await websockets.connect(f"ws://127.0.0.1:{srv.port}/v1/realtime")
    wire = Wire(ws)
    await wire.until("session.created")
    return ws, wire


def user_text(text: str) -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
    }


async def test_clients_first_updates_are_honoured_without_errors(make_server) -> None:
    srv = await make_server()
    ws, wire = await connect(srv)
    async with ws:
        session_id = wire.all[0]["session"]["id"]
        handle = srv.server.handles[session_id]
        assert not handle.conversation.continue_turns  # (OpenAI's items: speech after a turn's end is a new one)
        await wire.send(PIPECAT_UPDATE)
        td = (await wire.until("session.updated"))["session"]["audio"]["input"]["turn_detection"]
        assert td["type"] == "server_vad" and td["threshold"] == 0.6 and td["prefix_padding_ms"] == 300
        assert td["silence_duration_ms"] == 500
        # ... and they reach the session: the VAD threshold, the recognizer's pre-roll, the end-of-turn silence.
        assert handle.session._config.vad.threshold == 0.6
        assert handle.session.transcriber._config.preroll_s == 0.3
        assert handle.conversation._turn.min_silence_ms == handle.conversation._turn.max_silence_ms == 500

        await wire.send(LIVEKIT_UPDATE)
        session = (await wire.until("session.updated"))["session"]
        td = session["audio"]["input"]["turn_detection"]
        assert td == {"type": "semantic_vad", "eagerness": "high", "create_response": True, "interrupt_response": True}
        assert session["max_output_tokens"] == "inf" and session["tools"] == [] and session["tool_choice"] == "auto"
        base = srv.server.config.turn
        assert handle.conversation._turn.min_silence_ms < base.min_silence_ms  # eager: shorter silences
        assert handle.session._config.vad.threshold == srv.server.config.vad.threshold  # (back to the server's)

        # Out of band (conversation "none"): answered in text on a dialog session of its own, metadata echoed,
        # outside the conversation (no item added to it).
        await wire.send(
            {
                "type": "response.create",
                "response": {"conversation": "none", "metadata": {"topic": "x"}, "output_modalities": ["text"]},
            }
        )
        created = await wire.until("response.created")
        done = await wire.until("response.done")
        assert created["response"]["metadata"] == done["response"]["metadata"] == {"topic": "x"}
        assert done["response"]["status"] == "completed" and done["response"]["conversation_id"] is None
        assert done["response"]["output"][0]["content"][0]["text"]
        assert not [e for e in wire.all if e["type"] == "conversation.item.added"]
        assert wire.errors() == []

        # Where OpenAI errors, duplexd does too, in the wording clients match on.
        await wire.send({"type": "response.cancel", "event_id": "c1"})
        error = (await wire.until("error"))["error"]
        assert error["code"] == "response_cancel_not_active" and error["message"].startswith("Cancellation failed")
        for _ in range(srv.server.config.transport.max_errors + 5):  # (races: never "too many errors")
            await wire.send({"type": "response.cancel"})
        await wire.send({"type": "session.update", "session": {"type": "realtime"}})
        await wire.until("session.updated")
        await wire.send({"type": "input_audio_buffer.commit"})  # (VAD, no speech: nothing to commit)
        assert (await wire.until("error"))["error"]["code"] == "input_audio_buffer_commit_empty"
        await wire.send({"type": "conversation.item.retrieve", "item_id": "nope", "event_id": "rci_nope"})
        error = (await wire.until("error"))["error"]
        assert error["code"] == "item_retrieve_invalid_item_id" and error["event_id"] == "rci_nope"


async def test_metadata_token_cap_and_truncate_after_response_done(make_server) -> None:
    srv = await make_server()
    ws, wire = await connect(srv)
    async with ws:
        session_id = wire.all[0]["session"]["id"]
        handle = srv.server.handles[session_id]
        engine = srv.server.dialog.engine

        async def settled(done: Any, timeout_s: float = 10.0) -> str:
            """The LLM context once `done(context)` holds (or as it is at the deadline)."""
            deadline = time.monotonic() + timeout_s
            while True:
                await asyncio.sleep(0.1)
                context = engine.tokenizer.decode(engine.context_tokens(handle.dialog_sid))
                if done(context) or time.monotonic() > deadline:
                    return context

        await wire.send(
            {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}}
        )
        await wire.until("session.updated")
        await wire.send(user_text("Tell me about the sea."))
        user_item = (await wire.until("conversation.item.done"))["item"]["id"]
        await wire.send(
            {
                "type": "response.create",
                "event_id": "response_create_1",
                "response": {"metadata": {"client_event_id": "response_create_1"}, "max_output_tokens": 12},
            }
        )
        created = await wire.until("response.created")
        assert created["response"]["metadata"] == {"client_event_id": "response_create_1"}  # (LiveKit waits on it)
        done = (await wire.until("response.done", 90))["response"]
        assert done["metadata"] == {"client_event_id": "response_create_1"}
        item = done["output"][0]
        spoken = item["content"][0]["transcript"]
        if done["status"] == "incomplete":
            assert done["status_details"]["reason"] == "max_output_tokens"
        assert len(engine.tokenizer.encode(spoken)) <= 13

        # Right after response.done the client has played part of it: truncating is no error, and the LLM's
        # context keeps only what was heard.
        deltas = [e for e in wire.all if e["type"] == "response.output_audio.delta"]
        audio_ms = sum(len(base64.b64decode(e["delta"])) for e in deltas) / 2 / 24
        end_ms = int(0.7 * audio_ms)
        await wire.send(
            {"type": "conversation.item.truncate", "item_id": item["id"], "content_index": 0, "audio_end_ms": end_ms}
        )
        truncated = await wire.until("conversation.item.truncated")
        assert truncated["audio_end_ms"] == end_ms
        await wire.send({"type": "conversation.item.retrieve", "item_id": item["id"]})
        heard = (await wire.until("conversation.item.retrieved"))["item"]["content"][0]["transcript"]
        assert heard and spoken.startswith(heard) and len(heard) < len(spoken), (heard, spoken)
        context = await settled(lambda c: spoken not in c)  # (the worker applies the cut between steps)
        assert "sea" in context and spoken not in context and heard in context, context

        # The user's next words follow; the reply is cut again, under them (a later truncate, as LiveKit's).
        await wire.send(user_text("And the mountains?"))
        await wire.until("conversation.item.done")
        await wire.send(
            {"type": "conversation.item.truncate", "item_id": item["id"], "content_index": 0, "audio_end_ms": 0}
        )
        await wire.until("conversation.item.truncated")
        context = await settled(lambda c: "mountains" in c and heard not in c)
        assert "mountains" in context and heard not in context, context

        # Delete, retrieve.
        await wire.send({"type": "conversation.item.delete", "item_id": item["id"]})
        assert (await wire.until("conversation.item.deleted"))["item_id"] == item["id"]
        await wire.send({"type": "conversation.item.retrieve", "item_id": user_item})
        assert (await wire.until("conversation.item.retrieved"))["item"]["content"][0]["text"] == (
            "Tell me about the sea."
        )
        assert wire.errors() == []

        # idle_timeout_ms: a quiet microphone after the last response -> timeout_triggered and a response.
        await wire.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "output_modalities": ["text"],
                    "audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 1000}}},
                },
            }
        )
        await wire.until("session.updated")
        silence = base64.b64encode(bytes(2 * 2400)).decode()

        async def quiet() -> None:
            while True:
                await wire.send({"type": "input_audio_buffer.append", "audio": silence})
                await asyncio.sleep(0.1)

        async with asyncio.TaskGroup() as tg:
            mic = tg.create_task(quiet())
            triggered = await wire.until("input_audio_buffer.timeout_triggered", 30)
            await wire.until("response.created", 30)
            mic.cancel()
        assert triggered["audio_end_ms"] >= triggered["audio_start_ms"]
        assert wire.errors() == []


async def test_item_edits_and_response_instructions_reach_the_llm_context(make_server, monkeypatch) -> None:
    """What a client does to the conversation's items is what the LLM reads: typed assistant and system
    messages, inserts, deletes, a truncated older response, a response's own instructions (for it only);
    an out-of-band response with its own `input` leaves the conversation as it was."""
    srv = await make_server()
    from duplexd.commands import ReplaceContext

    submitted: list[Any] = []
    submit = srv.server.dialog.submit
    monkeypatch.setattr(srv.server.dialog, "submit", lambda sid, c: (submitted.append(c), submit(sid, c))[1])
    ws, wire = await connect(srv)
    async with ws:
        handle = srv.server.handles[wire.all[0]["session"]["id"]]
        engine = srv.server.dialog.engine

        async def context(done: Any, timeout_s: float = 20.0) -> str:
            """The LLM's context once all of it is in and `done(context)` holds (or at the deadline)."""
            deadline = time.monotonic() + timeout_s
            while True:
                text = engine.tokenizer.decode(engine.context_tokens(handle.dialog_sid))
                if (done(text) and not engine.busy()) or time.monotonic() > deadline:
                    return text
                await asyncio.sleep(0.1)

        await wire.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "instructions": "You are a ship's cook.",
                    "audio": {"input": {"turn_detection": None}},
                },
            }
        )
        await wire.until("session.updated")
        await wire.send(user_text("My name is Ada."))
        ada = (await wire.until("conversation.item.done"))["item"]["id"]
        await wire.send(
            {
                "type": "conversation.item.create",
                "previous_item_id": ada,
                "item": {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Welcome aboard, Ada."}],
                },
            }
        )
        welcome = (await wire.until("conversation.item.done"))["item"]
        assert welcome["role"] == "assistant" and welcome["status"] == "completed"
        await wire.send(
            {
                "type": "conversation.item.create",
                "previous_item_id": "root",
                "item": {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
            }
        )
        assert (await wire.until("conversation.item.added"))["previous_item_id"] is None
        text = await context(lambda c: "Be brief." in c and "Welcome aboard, Ada." in c)
        assert text.index("ship's cook") < text.index("Be brief.") < text.index("My name is Ada.")
        assert text.index("My name is Ada.") < text.index("Welcome aboard, Ada.")

        # A function call's output (tools come later): kept as an item, no error, not in the context.
        await wire.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call_output", "call_id": "call_1", "output": '{"ok": true}'},
            }
        )
        await wire.until("conversation.item.done")

        # Deleting the user's message takes its words out of what the LLM reads.
        await wire.send({"type": "conversation.item.delete", "item_id": ada})
        await wire.until("conversation.item.deleted")
        text = await context(lambda c: "Welcome aboard" in c and "My name is Ada." not in c)
        assert "My name is Ada." not in text and "Welcome aboard, Ada." in text, text

        # A response's own instructions: in the context for that response, the session's back after it.
        await wire.send(user_text("What is for dinner?"))
        await wire.until("conversation.item.done")
        submitted.clear()
        await wire.send(
            {
                "type": "response.create",
                "response": {"instructions": "You are a lighthouse keeper.", "output_modalities": ["text"]},
            }
        )
        await wire.until("rate_limits.updated")
        first = (await wire.until("response.done", 90))["response"]
        assert first["status"] in ("completed", "incomplete")
        text = await context(lambda c: "ship's cook" in c and "lighthouse" not in c)
        assert "ship's cook" in text and "lighthouse" not in text and "What is for dinner?" in text, text
        rebuilt = [c for c in submitted if isinstance(c, ReplaceContext)]
        assert [c.system_prompt.split("\n\n")[0] for c in rebuilt] == [
            "You are a lighthouse keeper.",
            "You are a ship's cook.",
        ]
        assert "What is for dinner?" in [t for _, t in rebuilt[0].turns]  # (before its reply)
        reply = first["output"][0]["content"][0]["text"]
        assert ("assistant", reply) in rebuilt[1].turns  # (after it: the reply is part of the conversation)

        # Out of band with its own input: answered; the conversation's context is left as it was.
        before = await context(lambda c: reply in c)
        await wire.send(
            {
                "type": "response.create",
                "response": {
                    "conversation": "none",
                    "output_modalities": ["text"],
                    "input": [
                        {"type": "item_reference", "id": welcome["id"]},
                        user_text("Say a number.")["item"],
                    ],
                },
            }
        )
        oob = (await wire.until("response.done", 90))["response"]
        assert oob["status"] in ("completed", "incomplete") and oob["conversation_id"] is None
        assert oob["output"][0]["content"][0]["text"]
        assert await context(lambda c: True) == before
        assert wire.errors() == []


async def test_truncating_an_older_response_cuts_it_in_the_context(make_server) -> None:
    srv = await make_server()
    ws, wire = await connect(srv)
    async with ws:
        handle = srv.server.handles[wire.all[0]["session"]["id"]]
        engine = srv.server.dialog.engine
        await wire.send(
            {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}}}
        )
        await wire.until("session.updated")
        replies = []
        for question in ("Tell me about the sea.", "And the mountains?"):
            await wire.send(user_text(question))
            await wire.until("conversation.item.done")
            await wire.send({"type": "response.create"})
            replies.append((await wire.until("response.done", 90))["response"])
        older = replies[0]["output"][0]
        spoken = older["content"][0]["transcript"]
        audio_ms = sum(
            len(base64.b64decode(e["delta"])) / 48
            for e in wire.all
            if e["type"] == "response.output_audio.delta" and e["response_id"] == replies[0]["id"]
        )
        await wire.send(
            {"type": "conversation.item.truncate", "item_id": older["id"], "content_index": 0, "audio_end_ms": 0}
        )
        assert (await wire.until("conversation.item.truncated"))["audio_end_ms"] == 0
        deadline = time.monotonic() + 20
        while True:  # (the worker rebuilds the context between steps, then prefills it)
            text = engine.tokenizer.decode(engine.context_tokens(handle.dialog_sid))
            if spoken not in text and "mountains" in text and not engine.busy():
                break
            assert time.monotonic() < deadline, text
            await asyncio.sleep(0.1)
        later = replies[1]["output"][0]["content"][0]["transcript"]
        assert "the sea" in text and "mountains" in text and later in text, text
        await wire.send(  # (past the end of its audio: what OpenAI refuses)
            {
                "type": "conversation.item.truncate",
                "item_id": older["id"],
                "content_index": 0,
                "audio_end_ms": round(audio_ms) + 500,
            }
        )
        assert (await wire.until("error"))["error"]["code"] == "invalid_value"
