"""A typed turn (`user.text`) and new settings (`session.update`: the system prompt, spoken or text-only
replies) on the native protocol, against a real server with its real models: what the web page's text box
and settings send over the WebSocket."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.asyncio.client import connect

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
PROMPT = "You are a pirate. Answer every question in one short sentence."


async def _until(ws, kind: str, timeout_s: float = 60) -> tuple[dict, int]:
    """The next event of `kind`, and how many binary (audio) frames came before it."""
    frames = 0
    while True:
        msg = await asyncio.wait_for(ws.recv(), timeout_s)
        if not isinstance(msg, str):
            frames += 1
        elif (event := json.loads(msg))["type"] == kind:
            return event, frames


async def test_a_typed_turn_is_answered_and_settings_change_the_prompt_and_the_voice(make_server) -> None:
    srv = await make_server()
    async with connect(srv.url) as ws:
        await ws.send(json.dumps({"type": "session.start", "version": 1, "sample_rate": 16000}))
        started, _ = await _until(ws, "session.started")
        assert started["voice"] is True and started["instructions"] == srv.server.config.dialog.system_prompt

        await ws.send(json.dumps({"type": "user.text", "text": QUESTION}))
        turn, _ = await _until(ws, "turn.ended")
        assert turn["text"] == QUESTION
        await ws.send(json.dumps({"type": "user.text", "text": "And Spain?"}))  # (while it answers)
        err, _ = await _until(ws, "error")
        assert err["code"] == "replying"
        done, frames = await _until(ws, "reply.done")
        assert done["reply"] == turn["turn"] and done["text"].strip() and done["audio_ms"] > 0 and frames > 0

        await ws.send(json.dumps({"type": "session.update", "instructions": PROMPT, "voice": False}))
        updated, _ = await _until(ws, "session.updated")
        assert updated == {"type": "session.updated", "n": updated["n"], "instructions": PROMPT, "voice": False}
        # Once the reply has played (real time: this client sends no playback reports), the LLM's context
        # opens with the new system prompt and still holds the first exchange.
        (handle,) = srv.server.handles.values()
        engine = srv.server.dialog.engine
        for _ in range(100):
            context = engine.tokenizer.decode(engine.context_tokens(handle.dialog_sid))
            if PROMPT in context:
                break
            await asyncio.sleep(0.2)
        assert PROMPT in context and QUESTION in context and done["text"].strip()[:20] in context, context
        assert srv.server.config.dialog.system_prompt not in context

        await ws.send(json.dumps({"type": "user.text", "text": "And Spain?"}))
        turn2, _ = await _until(ws, "turn.ended")
        done2, frames2 = await _until(ws, "reply.done")
        assert turn2["text"] == "And Spain?" and done2["reply"] == turn2["turn"] and done2["text"].strip()
        assert done2["audio_ms"] == 0 and frames2 == 0  # text only: no speech

        for bad in (
            {"type": "user.text", "text": "   "},
            {"type": "user.text", "text": 42},
            {"type": "session.update", "voice": "yes"},
            {"type": "session.update", "instructions": "x" * 20000},
        ):
            await ws.send(json.dumps(bad))
            err, _ = await _until(ws, "error")
            assert err["code"] == "bad_message", (bad, err)
        await ws.send(json.dumps({"type": "session.end"}))
        await _until(ws, "session.ended")


async def test_typed_turns_need_a_dialog(make_server) -> None:
    srv = await make_server()
    async with connect(srv.url) as ws:
        await ws.send(json.dumps({"type": "session.start", "version": 1, "sample_rate": 16000, "dialog": False}))
        started, _ = await _until(ws, "session.started")
        assert "voice" not in started
        for msg in ({"type": "user.text", "text": "Hello"}, {"type": "session.update", "voice": False}):
            await ws.send(json.dumps(msg))
            err, _ = await _until(ws, "error")
            assert err["code"] == "no_dialog"
        await ws.send(json.dumps({"type": "session.end"}))
        await _until(ws, "session.ended")


async def test_a_typed_turn_after_reply_cancel_talks_over_the_reply(make_server) -> None:
    """What the page's text box does while the assistant speaks: `reply.cancel`, then `user.text` at once;
    the reply stops there and the typed turn is answered, with no error."""
    srv = await make_server()
    async with connect(srv.url) as ws:
        await ws.send(json.dumps({"type": "session.start", "version": 1, "sample_rate": 16000}))
        await _until(ws, "session.started")
        await ws.send(json.dumps({"type": "user.text", "text": "Tell me about the moon."}))
        first, _ = await _until(ws, "reply.started")
        await ws.send(json.dumps({"type": "reply.cancel"}))
        await ws.send(json.dumps({"type": "user.text", "text": QUESTION}))
        seen: list[dict] = []
        while not seen or seen[-1]["type"] != "reply.done":
            msg = await asyncio.wait_for(ws.recv(), 60)
            if isinstance(msg, str):
                seen.append(json.loads(msg))
        await ws.send(json.dumps({"type": "session.end"}))
        await _until(ws, "session.ended")
    kinds = [e["type"] for e in seen]
    assert "error" not in kinds, seen
    stopped = next(e for e in seen if e["type"] == "reply.interrupted")
    turn = next(e for e in seen if e["type"] == "turn.ended")
    assert stopped["reply"] == first["reply"] and stopped["reason"] == "cancel", stopped
    assert turn["text"] == QUESTION and seen[-1]["reply"] == turn["turn"] and seen[-1]["text"].strip(), seen
    assert kinds.index("reply.interrupted") < kinds.index("turn.ended"), kinds
