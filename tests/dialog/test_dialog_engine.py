"""The dialog engine on the real SmolLM2 weights: windowed decode, batch invariance, fork, interrupt, bounds.

References are independent of the engine's cache: `model.forward` recomputes full causal attention over the
whole token list for every new token.
"""

from __future__ import annotations

import pytest
import torch

from duplexd.bench.baseline import UnboundedEngine
from duplexd.dialog.engine import ChatFormat, DialogEngine, EngineConfig, UnknownSession, WindowConfig
from duplexd.dialog.gguf_weights import ChatTokenizer
from duplexd.dialog.kv_window import PoolFull
from duplexd.dialog.model import Transformer
from duplexd.errors import EngineError

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Why is the sky blue?",
]


@pytest.fixture(params=["smol", "tuned"], ids=["rowwise-float32", "as-loaded"])
def either(request: pytest.FixtureRequest) -> tuple[Transformer, ChatTokenizer]:
    """The reference model (float32, rowwise), and the model as this machine loads it (dtype and kernel
    measured): batch invariance must hold for both."""
    return request.getfixturevalue(request.param)


def make_engine(smol: tuple[Transformer, ChatTokenizer], **kwargs: object) -> DialogEngine:
    model, tokenizer = smol
    return DialogEngine(model, tokenizer, EngineConfig(**kwargs))  # type: ignore[arg-type]


def run_until_idle(engine: DialogEngine, replies: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
    replies = {} if replies is None else replies
    for _ in range(2000):
        if not engine.busy():
            return replies
        for sid, tokens in engine.step().items():
            replies.setdefault(sid, []).extend(tokens)
    raise AssertionError("the engine never went idle")


def ask(engine: DialogEngine, question: str, sid: int | None = None) -> tuple[int, list[int]]:
    sid = engine.open() if sid is None else sid
    engine.append_user_text(sid, question)
    engine.start_reply(sid)
    return sid, run_until_idle(engine).get(sid, [])


@torch.inference_mode()
def full_attention_reply(engine: DialogEngine, question: str, limit: int) -> list[int]:
    f = engine.format
    ids = engine.tokenizer.encode(f.system + f.user_open + question + f.user_close)
    out: list[int] = []
    for _ in range(limit):
        token = int(engine.model(torch.tensor([ids + out]))[0, -1].argmax())
        if token in (f.end_of_turn_id, engine.tokenizer.eos_id):
            break
        out.append(token)
    return out


def test_windowed_decode_equals_full_attention_while_it_fits(either) -> None:
    smol = either
    engine = make_engine(smol, max_sessions=1, max_reply_tokens=40)
    sid, reply = ask(engine, QUESTIONS[0])
    assert reply, "no reply"
    assert "Paris" in engine.tokenizer.decode(reply)
    assert reply == full_attention_reply(engine, QUESTIONS[0], limit=40)
    assert engine.resident_tokens(sid) == engine.tokens_seen(sid) <= engine.config.window.capacity


def test_batched_equals_alone_bit_for_bit(either) -> None:
    smol = either
    alone_engine = make_engine(smol, max_sessions=1, max_reply_tokens=24)
    alone, p_alone = [], []
    for i, q in enumerate(QUESTIONS):
        # Prefill chunks follow each session's own input (never its neighbours'), so give each session
        # the same input timing as below: the first gets its question at once, the others after their
        # system prompt is in.
        sid = alone_engine.open()
        if i:
            run_until_idle(alone_engine)
        alone_engine.append_user_text(sid, q)
        run_until_idle(alone_engine)
        p_alone.append(alone_engine.p_end_of_turn(sid))
        alone_engine.start_reply(sid)
        alone.append(run_until_idle(alone_engine)[sid])
        alone_engine.close(sid)

    engine = make_engine(smol, max_sessions=4, max_reply_tokens=24)
    sids = [engine.open() for _ in QUESTIONS]
    # Staggered, so steps mix prefill chunks and decode rows of different sessions.
    engine.append_user_text(sids[0], QUESTIONS[0])
    replies: dict[int, list[int]] = {}
    p_batched: dict[int, float | None] = {}
    for _ in range(3):
        engine.step()
    engine.append_user_text(sids[1], QUESTIONS[1])
    run_until_idle(engine)
    p_batched[sids[0]] = engine.p_end_of_turn(sids[0])
    p_batched[sids[1]] = engine.p_end_of_turn(sids[1])
    engine.start_reply(sids[0])
    for _ in range(3):
        for sid, tokens in engine.step().items():
            replies.setdefault(sid, []).extend(tokens)
    engine.append_user_text(sids[2], QUESTIONS[2])
    engine.start_reply(sids[1])
    for _ in range(4):
        for sid, tokens in engine.step().items():
            replies.setdefault(sid, []).extend(tokens)
    p_batched[sids[2]] = None
    engine.start_reply(sids[2])
    run_until_idle(engine, replies)

    assert [replies[s] for s in sids] == alone
    # Bitwise: the same float, not merely the same argmax.
    assert [p_batched[sids[0]], p_batched[sids[1]]] == p_alone[:2]
    assert engine.stats["steps"] < sum(len(r) for r in alone) + 3 * 10, "sessions were not batched"


def test_fork_does_not_disturb_the_parent(either) -> None:
    smol = either
    engine = make_engine(smol, max_sessions=3, max_reply_tokens=20)
    control, _ = ask(engine, QUESTIONS[1])
    control_reply = engine.reply_tokens(control)

    parent = engine.open()
    engine.append_user_text(parent, QUESTIONS[1])
    run_until_idle(engine)
    child = engine.fork(parent)
    engine.append_user_text(child, " Answer in French.")
    engine.start_reply(child)
    engine.start_reply(parent)
    replies = run_until_idle(engine)
    assert replies[parent] == control_reply
    assert replies[child] != control_reply
    assert engine.tokens_seen(child) > engine.tokens_seen(parent)


def test_interrupt_keeps_exactly_what_was_heard(smol) -> None:
    heard = 5
    engine = make_engine(smol, max_sessions=2, max_reply_tokens=40)
    sid = engine.open()
    engine.append_user_text(sid, QUESTIONS[2])
    engine.start_reply(sid)
    said: list[int] = []
    while len(said) < 12:
        said.extend(engine.step().get(sid, []))
    start = engine._sessions[sid].reply_start
    engine.interrupt(sid, heard_tokens=heard)
    assert not engine.replying(sid)
    assert engine.reply_tokens(sid) == said[:heard]
    assert engine.tokens_seen(sid) == start + heard
    run_until_idle(engine)
    close = engine.tokenizer.encode(engine.format.reply_close)
    assert engine.tokens_seen(sid) == start + heard + len(close)
    assert engine.tokenizer.decode(engine.context_tokens(sid)[start:]) == engine.tokenizer.decode(said[:heard]) + (
        engine.format.reply_close
    )

    # The same context reached without an interruption: the reply simply stopped after `heard` tokens.
    control_engine = make_engine(smol, max_sessions=1, max_reply_tokens=heard)
    control, control_reply = ask(control_engine, QUESTIONS[2])
    assert control_reply == said[:heard]
    for e, s in ((engine, sid), (control_engine, control)):
        e.append_user_text(s, " Thanks! And what colour is grass?")
        run_until_idle(e)
    p, q = engine.p_end_of_turn(sid), control_engine.p_end_of_turn(control)
    assert p is not None and q is not None and abs(p - q) < 1e-4
    assert engine.context_tokens(sid) == control_engine.context_tokens(control)
    _, after = ask(engine, "", sid)
    _, control_after = ask(control_engine, "", control)
    assert len(control_after) == heard  # the control engine's cap applies to every reply
    assert after[:heard] == control_after


def test_long_conversation_stays_bounded_and_fluent(smol) -> None:
    window = WindowConfig(sink_tokens=4, window_tokens=252)
    # (no_copy_ngram_tokens=0: this checks the window, not the guard. With the default 3-token copy ban
    # the reply is "The capital of the United States is New York City.": " capital of France" is the user's.)
    engine = make_engine(
        smol, window=window, max_sessions=1, max_reply_tokens=24, prefill_chunk=250, no_copy_ngram_tokens=0
    )
    sid = engine.open()
    filler = " The weather report said rain in the north and sun in the south, with mild winds." * 20
    most = 0
    while engine.tokens_seen(sid) < 20_000:
        engine.append_user_text(sid, filler)
        while engine.busy():
            engine.step()
            most = max(most, engine.resident_tokens(sid))
    assert most == window.capacity
    _, reply = ask(engine, " Now a question: what is the capital of France?", sid)
    assert "Paris" in engine.tokenizer.decode(reply)
    assert engine.tokens_seen(sid) > 20_000
    assert engine.resident_tokens(sid) <= window.capacity


def test_bad_input(smol) -> None:
    engine = make_engine(smol, max_sessions=2, window=WindowConfig(4, 60), prefill_chunk=32)
    sid = engine.open()
    run_until_idle(engine)
    seen = engine.tokens_seen(sid)
    engine.append_user_text(sid, "")
    assert not engine.busy() and engine.tokens_seen(sid) == seen
    engine.append_user_text(sid, " word" * 500)  # far longer than the window: chunked, not refused
    steps = 0
    while engine.busy():
        engine.step()
        steps += 1
    assert steps >= 500 // 32
    assert engine.tokens_seen(sid) >= seen + 500
    assert engine.p_end_of_turn(sid) is not None
    with pytest.raises(UnknownSession):
        engine.append_user_text(12345, "hi")
    with pytest.raises(UnknownSession):
        engine.close(12345)
    engine.open()
    with pytest.raises(PoolFull):
        engine.open()
    engine.close(sid)
    engine.open()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="prefill_chunk"):
        EngineConfig(window=WindowConfig(4, 16), prefill_chunk=32)
    with pytest.raises(ValueError, match="max_sessions"):
        EngineConfig(max_sessions=0)


@torch.inference_mode()
def test_context_tokens_are_the_resident_conversation(smol) -> None:
    engine = make_engine(smol, max_sessions=1, prefill_chunk=16, window=WindowConfig(sink_tokens=4, window_tokens=60))
    sid = engine.open("Be brief.")
    engine.append_user_text(sid, "Hello there, how are you today?" * 6)
    run_until_idle(engine)
    context = engine.context_tokens(sid)
    resident = engine.resident_tokens(sid)
    assert len(context) == resident and 32 < resident <= 64
    everything = engine.tokenizer.encode(ChatFormat.from_tokenizer(engine.tokenizer, "Be brief.").system)
    everything += engine.tokenizer.encode(engine.format.user_open + "Hello there, how are you today?" * 6)
    assert context == everything[:4] + everything[4 - resident :]  # the sinks and the window


@torch.inference_mode()
def test_interrupt_cuts_a_finished_reply_too(smol) -> None:
    heard = 4
    engine = make_engine(smol, max_sessions=1, max_reply_tokens=24)
    sid, said = ask(engine, QUESTIONS[1])
    assert not engine.replying(sid) and len(said) > heard
    engine.interrupt(sid, heard_tokens=heard)  # its audio was still playing when the user spoke
    run_until_idle(engine)
    assert engine.reply_tokens(sid) == said[:heard]
    control_engine = make_engine(smol, max_sessions=1, max_reply_tokens=heard)
    control, _ = ask(control_engine, QUESTIONS[1])
    assert engine.context_tokens(sid) == control_engine.context_tokens(control)
    # Once the user's next words are in (a Realtime client truncates after the user spoke), the reply is cut
    # under them: they follow what is left of it, token for token.
    engine.append_user_text(sid, " Thanks.")
    run_until_idle(engine)
    engine.interrupt(sid, heard_tokens=1)
    run_until_idle(engine)
    assert engine.reply_tokens(sid) == said[:1]
    control_engine = make_engine(smol, max_sessions=1, max_reply_tokens=1)
    control, _ = ask(control_engine, QUESTIONS[1])
    control_engine.append_user_text(control, " Thanks.")
    run_until_idle(control_engine)
    assert engine.context_tokens(sid) == control_engine.context_tokens(control)


def speculative_reply(
    engine: DialogEngine, first: str, tail: str, final_tail: str, limit: int
) -> tuple[list[int], bool]:
    """A conversation that drafts its reply as if the user had said `first + tail`, then hears `first +
    final_tail`; returns its reply and whether the draft was adopted."""
    sid = engine.open()
    engine.append_user_text(sid, first)
    run_until_idle(engine)
    draft = engine.fork(sid, decode_limit=limit)
    engine.append_user_text(draft, tail)
    key = engine.state_key(draft)
    engine.start_reply(draft)
    drafted = run_until_idle(engine).get(draft, [])
    assert engine.parked(draft) and len(drafted) == min(limit, len(engine.reply_tokens(draft)))
    engine.append_user_text(sid, final_tail)  # the user's real last words
    run_until_idle(engine)
    hit = engine.state_key(sid) == key
    if hit:
        engine.adopt(sid, draft)
        replies = run_until_idle(engine, {sid: list(drafted)})
    else:
        engine.close(draft)
        engine.start_reply(sid)
        replies = run_until_idle(engine)
    reply = replies.get(sid, [])
    assert reply == engine.reply_tokens(sid)
    engine.close(sid)
    return reply, hit


def test_an_adopted_draft_is_the_reply_token_for_token(either) -> None:
    smol = either
    engine = make_engine(smol, max_sessions=4, max_reply_tokens=30)
    for question in QUESTIONS:
        head, tail = question.split(" ", 1)
        reference = engine.open()
        engine.append_user_text(reference, head)
        run_until_idle(engine)
        engine.append_user_text(reference, " " + tail)
        run_until_idle(engine)
        engine.start_reply(reference)
        expected = run_until_idle(engine)[reference]
        engine.close(reference)
        reply, hit = speculative_reply(engine, head, " " + tail, " " + tail, limit=6)
        assert hit and reply == expected
        # A draft for other words is never used: the reply is the one those words get.
        reply, hit = speculative_reply(engine, head, " " + tail + " Be brief.", " " + tail, limit=6)
        assert not hit and reply == expected


def test_the_key_depends_on_how_the_words_arrived(smol) -> None:
    """Chunks are cut at every append, so "a b" in one piece and "a" + " b" are different states."""
    engine = make_engine(smol, max_sessions=2)
    one, two = engine.open(), engine.open()
    engine.append_user_text(one, "Why is the sky blue?")
    engine.append_user_text(two, "Why is the sky")
    engine.append_user_text(two, " blue?")
    assert engine.state_key(one) != engine.state_key(two)
    before = engine.state_key(one)
    run_until_idle(engine)
    assert engine.state_key(one) == before  # the key names the state once the queue is in


def test_drafts_only_get_steps_without_real_work(smol) -> None:
    engine = make_engine(smol, max_sessions=4, max_reply_tokens=12)
    talker = engine.open()
    engine.append_user_text(talker, QUESTIONS[0])
    run_until_idle(engine)
    draft = engine.fork(talker, decode_limit=100)
    engine.start_reply(draft)
    engine.start_reply(talker)
    listener = engine.open()
    engine.append_user_text(listener, QUESTIONS[2])
    schedules = []
    while engine.busy():
        engine.step()
        schedules.append(engine.last_schedule)
    kinds = [{p.name for _, p in s} for s in schedules]
    assert all(k in ({"NORMAL"}, {"DRAFT"}) for k in kinds), kinds
    first_draft = kinds.index({"DRAFT"})
    assert all(k == {"NORMAL"} for k in kinds[:first_draft]) and all(k == {"DRAFT"} for k in kinds[first_draft:])
    assert engine.stats["draft_steps"] == len(kinds) - first_draft


def test_steps_to_reply_counts_what_is_left_before_the_first_token(smol) -> None:
    engine = make_engine(smol, max_sessions=3, prefill_chunk=4)
    sid = engine.open()
    engine.append_user_text(sid, "Why is the sky blue?")
    run_until_idle(engine)
    header = -(-len(engine.tokenizer.encode(engine.format.user_close)) // 4)
    assert engine.steps_to_reply(sid) == header  # the assistant header's chunks
    behind = engine.fork(sid, decode_limit=4)
    engine.append_user_text(behind, " Tell me please, in two sentences or less.")  # more than 4 tokens: 2+ chunks
    assert engine.steps_to_reply(behind) >= 3
    engine.start_reply(behind)
    assert engine.steps_to_reply(behind) >= 3
    run_until_idle(engine)
    assert engine.steps_to_reply(behind) == 0 and engine.parked(behind)


def test_speaking_sessions_decode_first_on_a_recorded_schedule(smol) -> None:
    """Deadline-first packing under a tight token budget: every replying session gets its decode token in
    every step until its reply is done (listening prefill never displaces it), replying sessions' prefill
    (their headers) comes before listening sessions' prefill, and a step stays within its budget."""
    engine = make_engine(smol, max_sessions=5, max_reply_tokens=12, prefill_chunk=8, step_token_budget=10)
    speakers = [engine.open() for _ in range(2)]
    for sid, question in zip(speakers, QUESTIONS, strict=False):
        engine.append_user_text(sid, question)
    run_until_idle(engine)
    for sid in speakers:
        engine.start_reply(sid)
    listeners = [engine.open() for _ in range(2)]
    for sid in listeners:
        engine.append_user_text(sid, " ".join(QUESTIONS))  # many chunks of prefill, competing for the budget
    packed, replies = [], {}
    while engine.busy():
        for sid, tokens in engine.step().items():
            replies.setdefault(sid, []).extend(tokens)
        packed.append(engine.last_packed)
    rank = {"decode": 0, "reply": 1, "listen": 2, "draft": 3}
    for step in packed:
        ranks = [rank[kind] for _, kind, _ in step]
        assert ranks == sorted(ranks), step
        assert sum(n for *_, n in step) <= 10 or len(step) == 1, step
    for sid in speakers:
        # Its header (6 tokens) goes in before any listener's words: both fit the first two steps' budget.
        assert any((sid, "reply") == (s, kind) for step in packed[:2] for s, kind, _ in step), packed[:2]
        decoding = [i for i, step in enumerate(packed) if (sid, "decode", 1) in step]
        assert decoding == list(range(decoding[0], decoding[-1] + 1)), f"session {sid} missed a decode step"
        assert len(decoding) >= len(replies[sid]) - 1  # the first token comes from the header's prefill
    listener_steps = [i for i, step in enumerate(packed) if any(sid in listeners for sid, *_ in step)]
    assert listener_steps[0] < max(max(i for i, s in enumerate(packed) if (sp, "decode", 1) in s) for sp in speakers)


def test_the_unbounded_baseline_stays_in_its_budget_by_preempting_and_recomputing(smol) -> None:
    """`UnboundedEngine` (the baseline of `duplexd bench collapse`): resident rows never exceed the budget;
    when a step needs more, the session with the most rows is dropped and recomputed from its tokens, and
    its conversation goes on with the same reply."""
    config = {"window": WindowConfig(4, 508), "max_sessions": 3, "max_reply_tokens": 12}
    reference = make_engine(smol, **config)
    expected = [ask(reference, q)[1] for q in QUESTIONS]
    budget = int(2.5 * reference.kv_rows() / len(QUESTIONS))  # two conversations fit, not three
    model, tokenizer = smol
    engine = UnboundedEngine(model, tokenizer, EngineConfig(**config), kv_budget_tokens=budget)  # type: ignore[arg-type]
    sids = [engine.open() for _ in QUESTIONS]
    for sid, question in zip(sids, QUESTIONS, strict=True):
        engine.append_user_text(sid, question)
        engine.start_reply(sid)
    replies: dict[int, list[int]] = {}
    for _ in range(2000):
        if not engine.busy():
            break
        for sid, tokens in engine.step().items():
            replies.setdefault(sid, []).extend(tokens)
        assert engine.kv_rows() <= budget
    assert engine.stats["preemptions"] > 0 and engine.stats["recomputed_tokens"] > 0
    assert [replies[sid] for sid in sids] == expected


def test_each_conversation_can_have_its_own_reply_limit(smol) -> None:
    """Servers that share one engine each keep their `dialog.max_reply_tokens`: the limit is per
    conversation (given at `open`), and a fork (a draft) inherits it."""
    engine = make_engine(smol, max_sessions=3, max_reply_tokens=12)
    question = "Tell me a long story about a dragon."
    _, long = ask(engine, question)
    short = engine.open(max_reply_tokens=4)
    engine.append_user_text(short, question)
    run_until_idle(engine)
    draft = engine.fork(short)
    engine.start_reply(draft)
    _, brief = ask(engine, "", short)
    assert len(long) == 12 and brief == long[:4]
    assert engine.reply_tokens(draft) == brief  # the draft stopped where its conversation does


def test_each_conversation_can_have_its_own_sentence_limit(smol) -> None:
    """The same for `dialog.max_reply_sentences`: a storyteller server (0: no limit) sharing the engine with a
    voice server (the default, 2) gets its whole story, and a draft inherits its conversation's limit."""
    engine = make_engine(smol, max_sessions=3, max_reply_tokens=48, max_reply_sentences=1)
    question = "Tell me a long story about a dragon."
    _, brief = ask(engine, question)
    story = engine.open(max_reply_sentences=0)
    engine.append_user_text(story, question)
    run_until_idle(engine)
    draft = engine.fork(story)
    engine.start_reply(draft)
    _, long = ask(engine, "", story)
    text = engine.tokenizer.decode
    assert len(long) == 48 and long[: len(brief)] == brief  # the same words, past the first sentence's end
    assert text(brief).rstrip().endswith((".", "!", "?")) and len(text(long)) > len(text(brief))
    assert engine.reply_tokens(draft) == long  # the draft ran as far as its conversation does


def test_a_rewritten_context_is_the_conversation_it_describes(smol) -> None:
    """`rewrite` replaces a conversation by another: its KV, its next reply, token for token, are those of
    a session that lived through the described turns (here: one that asked and heard the same replies)."""
    engine = make_engine(smol)
    lived, first = ask(engine, QUESTIONS[0])
    said = engine.tokenizer.decode(first)
    engine.append_user_text(lived, "Thanks")
    run_until_idle(engine)

    edited, _ = ask(engine, QUESTIONS[2])  # (another conversation, then rewritten into the first one)
    engine.rewrite(edited, None, [("user", QUESTIONS[0]), ("assistant", said)], open_user="Thanks")
    assert not engine.replying(edited)
    run_until_idle(engine)
    assert engine.context_tokens(edited) == engine.context_tokens(lived)
    assert engine.state_key(edited) != engine.state_key(lived)  # (keys follow history: no false draft hits)
    for sid in (lived, edited):
        engine.start_reply(sid)
    replies = run_until_idle(engine)
    assert replies[edited] == replies[lived] and replies[lived]

    # Another system prompt, a turn left out: the context is exactly what the turns render.
    engine.rewrite(edited, "You are terse.", [("user", QUESTIONS[1])])
    run_until_idle(engine)
    expected = ChatFormat.from_tokenizer(engine.tokenizer, "You are terse.").system + engine.format.user_open
    assert engine.tokenizer.decode(engine.context_tokens(edited)) == expected + QUESTIONS[1]

    engine.start_reply(edited)
    with pytest.raises(EngineError):  # (not while it replies)
        engine.rewrite(edited, None, [])
    with pytest.raises(ValueError):
        engine.rewrite(lived, None, [("tool", "x")])


def test_steps_run_on_the_configured_threads_whatever_a_library_set(smol) -> None:
    """silero-vad's package sets torch's threads to 1 when imported; the engine's steps keep their own."""
    engine = make_engine(smol, threads=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # (what `import silero_vad` does)
        sid = engine.open()
        engine.append_user_text(sid, "Hello there.")
        run_until_idle(engine)
        assert engine.stats["threads"] == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


CUT_QUESTIONS = [
    "The child almost hurt the small dog.",
    "The birch canoe slid on the smooth planks.",
    "What is the capital of France and why is it famous?",
    "How do I make a good cup of tea?",
]


def test_a_prompt_cut_into_any_chunks_gets_bitwise_the_same_cache_and_reply(either) -> None:
    """A draft prefills the user's words as they are recognized; the reply without it prefills them at the
    end of the turn, in other chunks. Drafts are lossless only if a token's numbers do not depend on the
    chunk it came in: the same keys and values bit for bit, and so the same reply."""
    engine = make_engine(either, max_sessions=2, max_reply_tokens=24, prefill_chunk=16, no_copy_ngram_tokens=0)
    for question in CUT_QUESTIONS:
        whole = engine.open()
        engine.append_user_text(whole, question)  # (chunks of up to 16 tokens)
        run_until_idle(engine)
        by_word = engine.open()
        for i, word in enumerate(question.split(" ")):
            engine.append_user_text(by_word, (" " if i else "") + word)
            engine.step()  # (one or two tokens a chunk)
        run_until_idle(engine)
        a, b = engine._sessions[whole], engine._sessions[by_word]
        assert a.window.n == b.window.n
        rows = slice(0, a.window.n)
        assert torch.equal(engine.pool.k[:, a.slot, :, rows], engine.pool.k[:, b.slot, :, rows]), question
        assert torch.equal(engine.pool.v[:, a.slot, :, rows], engine.pool.v[:, b.slot, :, rows]), question
        replies = {}
        for sid in (whole, by_word):
            engine.start_reply(sid)
            replies[sid] = run_until_idle(engine).get(sid, [])
        assert replies[whole] and replies[whole] == replies[by_word], question
        engine.close(whole)
        engine.close(by_word)


def test_retracted_user_words_leave_the_context_as_if_never_said(smol) -> None:
    """The recognizer's final can decide an utterance's words again after they were appended: taken back
    (still queued, or already in the KV) and replaced, the conversation is the one that heard the final
    words only, bit for bit, and its reply is that one's."""
    engine = make_engine(smol, max_sessions=3, max_reply_tokens=16, prefill_chunk=16)
    control = engine.open()
    for text in ("What is the", " capital of France?"):
        engine.append_user_text(control, text)
    in_kv = engine.open()
    engine.append_user_text(in_kv, "What is the")
    engine.append_user_text(in_kv, " capital of Spain")
    queued = engine.open()
    engine.append_user_text(queued, "What is the")
    run_until_idle(engine)
    before = engine.context_tokens(in_kv)
    assert not engine.retract_user_text(in_kv, [" of Spain", " capital"])  # (not its last appends, as given)
    assert not engine.retract_user_text(in_kv, [" capital of France?"])
    assert engine.context_tokens(in_kv) == before
    assert engine.retract_user_text(in_kv, [" capital of Spain"])  # prefilled: cut from the KV
    engine.append_user_text(queued, " capital of")
    engine.append_user_text(queued, " Spain")
    assert engine.retract_user_text(queued, [" capital of", " Spain"])  # still queued
    for sid in (in_kv, queued):
        engine.append_user_text(sid, " capital of France?")
    run_until_idle(engine)
    p = engine.p_end_of_turn(control)
    assert p is not None
    for sid in (in_kv, queued):
        assert engine.context_tokens(sid) == engine.context_tokens(control)
        assert engine.p_end_of_turn(sid) == pytest.approx(p, abs=1e-6)
    replies = {}
    for sid in (control, in_kv, queued):
        engine.start_reply(sid)
        assert not engine.retract_user_text(sid, [" capital of France?"])  # (the turn is closed)
        replies[sid] = run_until_idle(engine).get(sid, [])
    assert replies[control] and replies[in_kv] == replies[control] == replies[queued]


def test_a_withdrawn_reply_leaves_the_turn_open_as_if_it_had_never_ended(smol) -> None:
    """The user went on after a pause the endpointer took for the turn's end (`turn.continue_turn_ms`): the
    reply is taken back whole, the turn's close with it, whether the reply was still being decoded, had
    ended, or had not yet been prefilled; the conversation that then hears the rest of the question is the
    one that heard it whole, bit for bit, and so is its reply."""
    engine = make_engine(smol, max_sessions=4, max_reply_tokens=12, prefill_chunk=16)
    control = engine.open()
    engine.append_user_text(control, "What is the capital")
    engine.append_user_text(control, " of France?")
    run_until_idle(engine)
    replying, finished, queued = engine.open(), engine.open(), engine.open()
    for sid in (replying, finished, queued):
        engine.append_user_text(sid, "What is the capital")
    run_until_idle(engine)
    engine.start_reply(finished)
    run_until_idle(engine)
    engine.start_reply(replying)
    while len(engine.reply_tokens(replying)) < 3:
        engine.step()
    engine.start_reply(queued)  # (its turn's end not prefilled yet)
    for sid in (replying, finished, queued):
        assert engine.withdraw_reply(sid)
        assert not engine.replying(sid) and engine.reply_tokens(sid) == []
        engine.append_user_text(sid, " of France?")
    run_until_idle(engine)
    p = engine.p_end_of_turn(control)
    assert p is not None
    for sid in (replying, finished, queued):
        assert engine.context_tokens(sid) == engine.context_tokens(control)
        assert engine.p_end_of_turn(sid) == pytest.approx(p, abs=1e-6)
    replies = {}
    for sid in (control, replying, finished, queued):
        engine.start_reply(sid)
        replies[sid] = run_until_idle(engine).get(sid, [])
    assert replies[control] and all(r == replies[control] for r in replies.values())
    engine.append_user_text(control, " Thanks.")  # (the user spoke after the reply: it is theirs now)
    assert not engine.withdraw_reply(control)
