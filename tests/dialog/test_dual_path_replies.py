"""`[dialog] mode = "relay"`: the local SmolLM2 speaks a reply's first words, a real `duplexd serve-llm` continues
from exactly those words (RelayS2S's dual path; `dialog/relay.py`).

The remote model here is the same SmolLM2 (float32 on both sides), so a relayed reply must be, token for
token, the reply either model gives alone: any word dropped, repeated or changed at the seam shows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from duplexd.config import DialogConfig, RelayConfig
from duplexd.dialog.engine import DialogEngine, EngineConfig, TokenStats, token_stats
from duplexd.dialog.relay import PREFIX_TOKENS, RelayDialogEngine, accept_prefix, sure
from tests.dialog.test_remote_backend import DTYPE, TURNS, assert_taken_back_as_if_said_right, converse, remote_engine
from tests.dialog.test_remote_backend import llm_url as llm_url  # (the module's serve-llm fixture)
from tests.dialog.test_remote_backend import local as local  # (llm_url needs it)

SURE = TokenStats(logprob=-0.01, entropy=0.1, margin=0.98)
UNSURE = TokenStats(logprob=-3.0, entropy=5.0, margin=0.0)  # p 0.05: SmolLM2's first reply token is like this
ANY = RelayConfig(min_prob=0.0, max_entropy=1e9, min_margin=0.0)  # every prefix passes
NONE = RelayConfig(min_prob=1.0)  # no prefix passes (p < 1 always)


def _decode(pieces: list[str]):
    return lambda ids: "".join(pieces[i] for i in ids)


def test_the_prefix_is_the_longest_run_of_whole_words_sure_together() -> None:
    pieces = ["The", " capital", " of", " Fr", "ance", " is", " Paris", "."]
    ids = list(range(len(pieces)))
    rule = RelayConfig(prefix_words=3)
    decode = _decode(pieces)
    # Still deciding: fewer than 3 complete words ("of" is not complete until a later token starts another).
    assert accept_prefix(ids[:3], [SURE] * 3, decode, rule, done=False) == ("", False)
    assert accept_prefix(ids[:4], [SURE] * 4, decode, rule, done=False) == ("The capital of", True)  # (not "Fr")
    # Together: an unsure first token alone is not spoken, but with sure ones after it it is (mean p 0.37).
    assert accept_prefix(ids[:6], [UNSURE] + [SURE] * 5, decode, rule, done=False) == ("The capital of", True)
    assert accept_prefix(ids[:6], [UNSURE] * 6, decode, rule, done=False) == ("", True)
    # A reply that ended: its last word is complete; a token given (no stats) is not the local model's.
    assert accept_prefix(ids[6:8], [SURE, SURE], decode, rule, done=True) == ("Paris.", True)
    assert accept_prefix(ids[:2], [SURE, None], decode, rule, done=True) == ("The", True)
    assert accept_prefix([], [], decode, rule, done=True) == ("", True)


def test_tokens_are_sure_together_by_probability_entropy_and_margin() -> None:
    import torch

    rule = RelayConfig(min_prob=0.3, max_entropy=3.0, min_margin=0.25)
    peaked = token_stats(torch.tensor([5.0, 0.0, 0.0, 0.0]), 0)
    p = math.exp(5) / (math.exp(5) + 3)
    assert sure([peaked], rule) and peaked.margin == pytest.approx(p - (1 - p) / 3, abs=1e-6)
    assert peaked.logprob == pytest.approx(math.log(p), abs=1e-6)
    flat = token_stats(torch.zeros(50), 0)  # p 0.02, entropy ln 50 = 3.9
    assert not sure([flat], rule) and flat.entropy == pytest.approx(math.log(50), abs=1e-5)
    assert sure([flat, peaked, peaked, peaked], rule)  # (geometric-mean p 0.37, entropy 1.1, margin 0.73)
    tied = token_stats(torch.tensor([3.0, 3.0, -5.0]), 0)  # probable, but a coin toss with the next
    assert not sure([tied], rule) and tied.margin == pytest.approx(0.0)
    banned = token_stats(torch.tensor([2.0, float("-inf"), 0.0]), 0)  # (a banned token counts as p 0)
    q = math.exp(2) / (math.exp(2) + 1)
    assert banned.entropy == pytest.approx(-(q * math.log(q) + (1 - q) * math.log(1 - q)), abs=1e-6)
    assert not sure([None], rule) and not sure([], rule) and not sure([peaked, None], rule)


def test_relay_needs_a_remote_backend() -> None:
    with pytest.raises(ValueError, match="dialog.mode"):
        DialogConfig(mode="relay")
    with pytest.raises(ValueError, match="dialog.mode"):
        DialogConfig(mode="both", backend="remote", remote_url="http://x/v1")
    assert DialogConfig(mode="relay", backend="remote", remote_url="http://x/v1").mode == "relay"
    with pytest.raises(ValueError, match="relay.prefix_words"):
        RelayConfig(prefix_words=0)


HEARD_WORDS = 1  # of the second reply, heard before the user talks over it


def heard_words(texts: list[str]) -> int | None:
    """Cut the second reply after its first `HEARD_WORDS` words, not pieces: the relay's prefix comes as one
    piece a word, a remote server's text as tokens, and the heard text must be the same for the next turn
    to read the same transcript. None until a later piece has started another word."""
    if not any(len(t.split()) > HEARD_WORDS for t in texts):
        return None
    return max(k + 1 for k, t in enumerate(texts) if len(t.split()) <= HEARD_WORDS)


@pytest.fixture(scope="module")
def speaker(gguf_file: Path) -> Iterator[DialogEngine]:  # (gguf_file: skipped where SmolLM2 cannot be fetched)
    yield DialogEngine.load(EngineConfig(max_sessions=4, max_reply_tokens=PREFIX_TOKENS, dtype=DTYPE))


def relay(url: str, speaker: DialogEngine, rule: RelayConfig) -> RelayDialogEngine:
    for sid in list(speaker._sessions):  # (each test starts with the local engine empty)
        speaker.close(sid)
    return RelayDialogEngine(remote_engine(url), speaker, rule)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rule", "prefixed"),
    [(ANY, True), (dataclasses.replace(ANY, prefix_words=2), True), (RelayConfig(), None), (NONE, False)],
    ids=["any-5-words", "any-2-words", "defaults", "none"],
)
async def test_a_relayed_conversation_is_the_conversation_either_model_has_alone(
    llm_url: str, speaker: DialogEngine, rule: RelayConfig, prefixed: bool | None
) -> None:
    """Three turns, the second cut after its first word (inside the prefix): what the user hears, and the
    transcript the next turn reads, are exactly the remote conversation's."""
    expected, _ = await converse(remote_engine(llm_url), heard_words)
    engine = relay(llm_url, speaker, rule)
    got, client = await converse(engine, heard_words)
    assert got == expected
    stats = engine.relay_stats
    assert stats["replies"] == len(TURNS) and sorted(client.relayed) == [1, 2, 3]  # (`reply.relayed`, each)
    for n, text in client.relayed.items():  # the prefix is how the reply begins (`texts[i]`: through piece i)
        assert client.texts[n][-1].startswith(text), (n, text, client.texts[n][-1])
    if prefixed is True:
        assert stats["with_prefix"] == len(TURNS) and engine.remote.continues is not False  # (never refused)
        assert all(0 < len(t.split()) <= rule.prefix_words for t in client.relayed.values())
    elif prefixed is False:
        assert set(client.relayed.values()) == {""} and engine.remote.continues is None  # (never asked)


@pytest.mark.slow
async def test_the_local_model_gives_the_turn_signal_and_a_cut_prefix_leaves_nothing(
    llm_url: str, speaker: DialogEngine
) -> None:
    engine = relay(llm_url, speaker, ANY)
    sid = engine.open()
    engine.append_user_text(sid, TURNS[0])
    while engine.p_end_of_turn(sid) is None:
        engine.step()
    assert 0.0 < engine.p_end_of_turn(sid) < 1.0  # (SmolLM2's P(end of turn), as the local backend gives)
    engine.start_reply(sid)
    assert engine.replying(sid) and engine.reply_tokens(sid) == []  # (the prefix is being decoded)
    engine.interrupt(sid, 0)  # talked over before a word was said
    assert not engine.replying(sid)
    assert engine.history(sid)[-2:] == [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": ""}]
    engine.append_user_text(sid, TURNS[2])
    engine.start_reply(sid)
    while engine.replying(sid):
        engine.step()
    reply = engine.tokenizer.decode(engine.reply_tokens(sid))
    assert reply and engine.history(sid)[-1] == {"role": "assistant", "content": reply}
    engine.close(sid)
    assert engine.sessions == 0 and not speaker._sessions


@pytest.mark.slow
async def test_a_draft_made_at_the_pause_brings_its_prefix_to_the_end_of_the_turn(
    llm_url: str, speaker: DialogEngine
) -> None:
    """Speculative listening with relay: the draft forked at the user's pause decodes its prefix there and
    sends the remote request; the turn's end adopts it, and the prefix's words are out at once. (A draft
    once counted one step behind its conversation from its first step, and was dropped every time.)"""
    engine = relay(llm_url, speaker, ANY)
    sid = engine.open()
    engine.append_user_text(sid, TURNS[0])
    while engine.busy():
        engine.step()
    draft = engine.fork(sid, decode_limit=16)
    engine.start_reply(draft)
    assert engine.steps_to_reply(draft) <= engine.steps_to_reply(sid)  # not behind: the worker keeps it
    while engine.replying(draft) and not engine.reply_tokens(draft):
        engine.step()
    ready = engine.reply_tokens(draft)
    engine.adopt(sid, draft)
    assert engine.reply_tokens(sid)[: len(ready)] == ready  # (at the turn's end: no step needed)
    relayed = engine.take_relayed(sid)  # (the draft's prefix is the conversation's now; told once)
    assert relayed is not None and relayed[0] and engine.tokenizer.decode(ready).startswith(relayed[0])
    assert engine.take_relayed(sid) is None
    while engine.replying(sid):
        engine.step()
    whole = engine.tokenizer.decode(engine.reply_tokens(sid))
    assert whole.startswith(engine.tokenizer.decode(ready)) and engine.history(sid)[-1]["content"] == whole
    engine.close(sid)


@pytest.mark.slow
@pytest.mark.parametrize("rule", [ANY, NONE], ids=["prefix", "no-prefix"])
async def test_the_remote_model_is_asked_at_the_end_of_the_turn_while_the_prefix_is_decided(
    llm_url: str, speaker: DialogEngine, rule: RelayConfig
) -> None:
    """`[relay] remote_at_once`: the remote request goes out with the turn's end, not after the local model
    decided (a reply with no prefix waited 0.1-0.5 s for that decision in bench relay); an accepted prefix
    asks again, continuing it, and the reply is still exactly prefix + continuation."""
    expected, _ = await converse(remote_engine(llm_url), heard_words)
    engine = relay(llm_url, speaker, dataclasses.replace(rule, remote_at_once=True))
    sid = engine.open()
    engine.append_user_text(sid, TURNS[0])
    engine.start_reply(sid)
    assert engine.remote.replying(sid) and engine.remote.stats["requests"] == 1  # (at once)
    assert engine.reply_tokens(sid) == []  # (its pieces wait for the decision)
    while engine.replying(sid):
        engine.step()
    reply = engine.tokenizer.decode(engine.reply_tokens(sid))
    assert reply == expected[0] and engine.history(sid)[-1] == {"role": "assistant", "content": reply}
    (prefix, *_), stats = engine.take_relayed(sid), engine.remote.stats
    if rule is ANY:
        assert prefix and reply.startswith(prefix)
        assert stats["requests"] == 2  # (the one without it was cancelled, or its reply taken back)
    else:
        assert prefix == "" and stats["requests"] == 1 and stats["cancelled"] == 0
    engine.close(sid)


@pytest.mark.slow
async def test_by_default_the_request_waits_for_the_prefix(llm_url: str, speaker: DialogEngine) -> None:
    engine = relay(llm_url, speaker, ANY)
    sid = engine.open()
    engine.append_user_text(sid, TURNS[0])
    engine.start_reply(sid)
    assert not engine.remote.replying(sid) and engine.remote.stats["requests"] == 0
    while engine.replying(sid):
        engine.step()
    assert engine.remote.stats["requests"] == 1 and engine.take_relayed(sid)[0]
    engine.close(sid)


@pytest.mark.slow
def test_a_reply_that_ended_is_asked_again_with_a_prefix(llm_url: str) -> None:
    """The remote model's own reply came whole before the local model decided: `restart_reply` takes it
    back and asks for the reply continuing the prefix; after the user spoke again it keeps it."""
    remote = remote_engine(llm_url)
    sid = remote.open()
    remote.append_user_text(sid, TURNS[0])
    remote.start_reply(sid)
    while remote.replying(sid):
        remote.step()
    alone = remote.tokenizer.decode(remote.reply_tokens(sid))
    assert alone and len(remote.history(sid)) == 3  # (system, user, assistant)
    words = alone.split()
    assert remote.restart_reply(sid, " ".join(words[:2]))
    while remote.replying(sid):
        remote.step()
    again = remote.tokenizer.decode(remote.reply_tokens(sid))
    assert again == alone and remote.history(sid)[1:] == [  # (greedy: the same words, given or not)
        {"role": "user", "content": TURNS[0]},
        {"role": "assistant", "content": again},
    ]
    remote.append_user_text(sid, TURNS[1])
    assert not remote.restart_reply(sid, "No.")
    assert [m["content"] for m in remote.history(sid)[-2:]] == [again, TURNS[1]]
    remote.close(sid)


@pytest.mark.slow
def test_words_taken_back_are_taken_back_on_both_sides(speaker: DialogEngine) -> None:
    """`dialog.mode = "relay"`: the recognizer's corrected words replace those taken back in the remote
    transcript and in the local model's context alike (its P(end of turn) is the turn signal)."""
    engine = relay("http://127.0.0.1:9", speaker, ANY)  # (no request is made)
    assert_taken_back_as_if_said_right(engine, [" capital of", " Spain"], [" capital of", " Spain"])
