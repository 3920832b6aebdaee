"""Speculative listening through a real server: drafts are made while the user pauses, they only ever
run on engine steps without real work, and the reply is the one the server gives without them."""

from __future__ import annotations

import numpy as np
import pytest

from duplexd.bench import scenarios as sc
from duplexd.clients.converse import ConversationResult, converse_pcm
from duplexd.config import ServerConfig, SpeculationConfig, load_config
from duplexd.dialog.engine import Priority

pytestmark = pytest.mark.slow

CLIP = "clip02_libri_1272-128104-0000.wav"  # "Mister Quilter is the apostle of the middle classes ..."
OFF = ServerConfig(speculation=SpeculationConfig(enabled=False))


def reply_done(events: list) -> bool:
    return any(r.event["type"] == "reply.done" for r in events)


def only(result: ConversationResult, kind: str) -> dict:
    (found,) = [r.event for r in result.events if r.event["type"] == kind]
    return found


def reply_text(result: ConversationResult) -> str:
    return "".join(r.event["text"] for r in result.of_type("reply.delta"))


async def converse_recorded(srv, audio: np.ndarray) -> tuple[ConversationResult, list[tuple[set[Priority], bool]]]:
    """A conversation, with the engine's schedule at every step: which kinds of session had work, and
    whether a recognizer pass was running as the step began."""
    engine = srv.server.dialog.engine
    schedules: list[tuple[set[Priority], bool]] = []
    step = engine.step

    def recorded_step() -> dict[int, list[int]]:
        asr_busy = srv.server.asr.busy
        out = step()
        schedules.append(({p for _, p in engine.last_schedule}, asr_busy))
        return out

    engine.step = recorded_step  # (the instance attribute shadows the method for this server's worker)
    try:
        result = await converse_pcm(srv.url, audio, sc.RATE, max_s=60, until=reply_done)
    finally:
        del engine.step
    return result, schedules


async def test_a_drafted_reply_is_the_reply_without_drafts(make_server, clip_by_name) -> None:
    audio = np.concatenate([sc.silence(0.5), sc.load(clip_by_name[CLIP].path)])
    # Drafts may run beside recognizer passes here, so they surely run.
    on = await make_server(ServerConfig(speculation=SpeculationConfig(yield_to_asr=False)))
    drafted, schedules = await converse_recorded(on, audio)
    spec = only(drafted, "reply.speculation")
    assert spec["reply"] == 1 and spec["drafts"] >= 1
    stats = on.server.health()["speculation"]
    assert stats["drafts"] >= spec["drafts"] and stats["turns"] == 1
    # Drafts ran, and never in a step with real work: they cannot have delayed anyone's reply.
    kinds = [k for k, _ in schedules]
    assert {Priority.DRAFT} in kinds
    assert all(k in ({Priority.NORMAL}, {Priority.DRAFT}, set()) for k in kinds)
    # Every frame was still taken in and acknowledged.
    acks = drafted.of_type("frame.ack")
    assert acks and acks[-1].event["seq"] >= len(audio) // (sc.RATE // 50) - 2

    plain = await converse_pcm((await make_server(OFF)).url, audio, sc.RATE, max_s=60, until=reply_done)
    assert only(plain, "reply.speculation") == {
        "n": only(plain, "reply.speculation")["n"],  # (its number in the session's events)
        "type": "reply.speculation",
        "reply": 1,
        "drafts": 0,
        "hit": False,
        "draft_tokens": 0,
    }
    turn_on, turn_off = only(drafted, "turn.ended")["text"], only(plain, "turn.ended")["text"]
    if turn_on == turn_off:  # (the recognizer's passes fall differently in time: usually the same words)
        assert reply_text(drafted) == reply_text(plain)
    assert reply_text(drafted) == only(drafted, "reply.done")["text"]


def test_speculation_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="speculation.draft_tokens"):
        SpeculationConfig(draft_tokens=0)
    config = load_config(env={"DUPLEXD_SPECULATION__ENABLED": "false", "DUPLEXD_TURN__PAUSE_MS": "0"})
    assert config.speculation == SpeculationConfig(enabled=False) and config.turn.pause_ms == 0
