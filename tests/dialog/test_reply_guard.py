"""The reply guard with the real SmolLM2 (issue 17): turns whose replies looped until the token cap before
the guard now end short, `duplexd chat`'s piped lines included, and a draft is still its reply token for
token while the guard bans tokens and ends the reply."""

from __future__ import annotations

import io

import pytest

from duplexd.bench.data import normalize
from duplexd.bench.replies import loops
from duplexd.dialog.chat import run_chat
from duplexd.dialog.engine import DialogEngine, EngineConfig
from duplexd.dialog.guard import sentences

pytestmark = pytest.mark.slow

LOOPED = ["What should I cook for dinner tonight?", "How do I boil an egg?"]  # unguarded: loops to the cap
UNGUARDED = {"max_reply_sentences": 0, "no_repeat_ngram_tokens": 0, "no_copy_ngram_tokens": 0, "max_reply_tokens": 96}


def unguarded(smol, monkeypatch: pytest.MonkeyPatch, sessions: int) -> DialogEngine:
    """The engine as it was before the guard: no banned tokens, no end but the model's own or the cap."""
    monkeypatch.setattr("duplexd.dialog.engine.reply_end", lambda before, after, max_sentences: None)
    return DialogEngine(*smol, EngineConfig(max_sessions=sessions, **UNGUARDED))  # type: ignore[arg-type]


def replies(engine: DialogEngine, questions: list[str]) -> list[list[int]]:
    sids = [engine.open() for _ in questions]
    for sid, question in zip(sids, questions, strict=True):
        engine.append_user_text(sid, question)
        engine.start_reply(sid)
    while engine.busy():
        engine.step()
    out = [engine.reply_tokens(sid) for sid in sids]
    for sid in sids:
        engine.close(sid)
    return out


def test_replies_that_looped_end_after_two_sentences(smol, monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = smol
    with monkeypatch.context() as m:
        before = replies(unguarded(smol, m, 2), LOOPED)
    assert all(
        len(r) == 96 and loops(normalize(tok.decode(r)), hit_cap=True) for r in before
    )  # (the test means something)
    engine = DialogEngine(model, tok, EngineConfig(max_sessions=2))
    for reply in replies(engine, LOOPED):
        text = tok.decode(reply)
        assert 0 < len(reply) < engine.config.max_reply_tokens, text
        assert not loops(normalize(text), hit_cap=False), text
        done, _ = sentences(text + " ")
        assert len(done) <= engine.config.max_reply_sentences, text


def test_piped_chat_lines_do_not_loop(smol) -> None:
    """`echo ... | duplexd chat`: one conversation, a turn per line."""
    model, tok = smol
    engine = DialogEngine(model, tok, EngineConfig(max_sessions=1))
    out = io.StringIO()
    run_chat(engine, io.StringIO("\n".join([*LOOPED, "Tell me about octopuses."]) + "\n"), out, interactive=False)
    lines = [line for line in out.getvalue().split("\n") if line.strip()]
    assert lines, out.getvalue()
    for line in lines:
        assert not loops(normalize(line), hit_cap=False), out.getvalue()
    assert len(normalize(out.getvalue())) < 3 * 45, out.getvalue()


def test_a_guarded_draft_is_the_reply_token_for_token(smol, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user says "How do I" then " boil an egg?"; a draft forked after the first words and given the
    rest is adopted after 4 tokens: the reply is the one the conversation gets alone, token for token."""
    model, tok = smol
    head, tail = "How do I", " boil an egg?"
    with monkeypatch.context() as m:
        (before,) = replies(unguarded(smol, m, 1), [head + tail])
    engine = DialogEngine(model, tok, EngineConfig(max_sessions=2))

    def idle() -> None:
        while engine.busy():
            engine.step()

    reference = engine.open()
    for words in (head, tail):
        engine.append_user_text(reference, words)
        idle()
    engine.start_reply(reference)
    idle()
    expected = engine.reply_tokens(reference)
    engine.close(reference)
    assert 0 < len(expected) < len(before)  # the guard ended it (and banned its "Boil:" repeats)

    sid = engine.open()
    engine.append_user_text(sid, head)
    idle()
    draft = engine.fork(sid, decode_limit=4)
    engine.append_user_text(draft, tail)
    key = engine.state_key(draft)
    engine.start_reply(draft)
    idle()
    assert engine.parked(draft) and len(engine.reply_tokens(draft)) == 4
    engine.append_user_text(sid, tail)
    idle()
    assert engine.state_key(sid) == key
    engine.adopt(sid, draft)
    idle()
    assert engine.reply_tokens(sid) == expected
