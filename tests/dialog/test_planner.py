"""The step planner's rules on literal snapshots (no model): decode first, then prefill by urgency within the
budget, chunks that never span a queued piece, drafts only in steps with nothing else, parked drafts
skipped, and the admission check between decisions."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexd.dialog.planner import Offer, PlannerConfig, Priority, SessionView, StepPlan, StepPlanner, chunks

DRAFT = Priority.DRAFT


def view(
    sid: int,
    pending: int,
    *,
    head: int | None = None,
    replying: bool = False,
    reply: int = 0,
    priority: Priority = Priority.NORMAL,
    decode_limit: int | None = None,
    served: int = 0,
) -> SessionView:
    return SessionView(
        sid,
        priority,
        pending_tokens=pending,
        head_tokens=pending if head is None else head,
        replying=replying,
        reply_tokens=reply,
        decode_limit=decode_limit,
        served=served,
    )


def speaker(sid: int, **kwargs: object) -> SessionView:
    """A replying session whose queue is its last reply token: it decodes."""
    return view(sid, 1, replying=True, reply=3, **kwargs)  # type: ignore[arg-type]


def drive(
    sessions: Iterable[SessionView],
    budget: int = 128,
    chunk: int = 64,
    *,
    refuse: Collection[int] = (),
    heads: Mapping[int, int] | None = None,
) -> tuple[StepPlan, list[Offer]]:
    """Plan a step as the engine does, admitting every offer but those of `refuse`; `heads` gives a session's
    head piece as it is when its turn comes (default: as in its view)."""
    planner = StepPlanner(PlannerConfig(budget, chunk), sessions)
    offers = []
    while (sid := planner.next_session()) is not None:
        offer = planner.offer(None if heads is None else heads.get(sid))
        if offer is not None:
            offers.append(offer)
            planner.answer(offer.sid not in refuse)
    return planner.plan(), offers


def packed(sessions: Iterable[SessionView], budget: int = 128, chunk: int = 64) -> list[tuple[int, str, int]]:
    plan, _ = drive(sessions, budget, chunk)
    return [(w.sid, w.kind, w.tokens) for w in plan.work]


def test_every_speaking_session_decodes_first_whatever_the_budget() -> None:
    """A reply's next token never waits: three decode tokens go in over a budget of two. Prefill gets what
    decode leaves, in whole chunks (a chunk is not shrunk to fit)."""
    sessions = [view(1, 8), speaker(2), speaker(3), speaker(4)]
    decode = [(2, "decode", 1), (3, "decode", 1), (4, "decode", 1)]
    assert packed(sessions, budget=2) == decode
    assert packed(sessions, budget=10) == decode
    assert packed(sessions, budget=11) == [*decode, (1, "listen", 8)]


@pytest.mark.parametrize(
    ("sessions", "order"),
    [
        # replying sessions' prefill (their headers) before listening sessions', whatever their ids
        ([view(1, 5), view(2, 5, replying=True)], [2, 1]),
        # then the session served longest ago
        ([view(1, 5, served=7), view(2, 5, served=3), view(3, 5, served=5)], [2, 3, 1]),
        # then the oldest
        ([view(3, 5), view(1, 5), view(2, 5)], [1, 2, 3]),
        # urgency over fairness: a replying session served last step still goes before an idle listener
        ([view(1, 5, served=0), view(2, 5, replying=True, served=9)], [2, 1]),
    ],
)
def test_prefill_order(sessions: list[SessionView], order: list[int]) -> None:
    assert [sid for sid, *_ in packed(sessions)] == order


@pytest.mark.parametrize(
    ("pending", "head", "chunk", "tokens"),
    [
        (19, 19, 8, 8),  # one piece: a chunk at most
        (19, 3, 8, 3),  # the head piece is shorter: the chunk stops at its end
        (5, 5, 8, 5),
    ],
)
def test_a_prefill_chunk_is_at_most_prefill_chunk_and_never_spans_two_pieces(
    pending: int, head: int, chunk: int, tokens: int
) -> None:
    assert packed([view(1, pending, head=head)], chunk=chunk) == [(1, "listen", tokens)]


def test_a_queue_goes_in_the_chunks_state_key_predicts() -> None:
    """Step after step the planner cuts each piece as `chunks` does (`state_key` and `steps_to_reply` count on
    it: the same pieces, the same chunks, the same KV)."""
    pieces, chunk, cut = [19, 5, 16], 8, []
    while pieces:
        (work,) = packed([view(1, sum(pieces), head=pieces[0])], chunk=chunk)
        cut.append(work[2])
        pieces[0] -= work[2]
        if not pieces[0]:
            pieces.pop(0)
    assert cut == [n for piece in (19, 5, 16) for n in chunks(piece, chunk)] == [8, 8, 3, 5, 8, 8]


def test_a_chunk_over_the_budget_left_is_skipped_and_a_smaller_one_behind_it_goes_in() -> None:
    sessions = [view(1, 8, replying=True), view(2, 8, served=0), view(3, 2, served=1)]
    assert packed(sessions, budget=10, chunk=8) == [(1, "reply", 8), (3, "listen", 2)]


def test_one_chunk_always_fits_an_empty_step() -> None:
    """A budget below one chunk slows prefill to a chunk a step; it never stops it."""
    assert packed([view(1, 8), view(2, 8)], budget=3, chunk=8) == [(1, "listen", 8)]
    assert packed([view(1, 8), view(2, 2)], budget=3, chunk=8) == [(1, "listen", 8)]  # (and then it is spent)


def test_drafts_only_get_steps_with_no_real_work() -> None:
    draft_speaking, draft_listening = speaker(3, priority=DRAFT), view(4, 6, priority=DRAFT, served=0)
    plan, _ = drive([view(1, 6, served=5), draft_speaking, draft_listening])
    assert [(w.sid, w.kind) for w in plan.work] == [(1, "listen")]
    assert [s.sid for s in plan.ready] == [1] and not plan.drafts_only

    plan, _ = drive([view(1, 0), draft_speaking, draft_listening])  # (session 1: nothing queued)
    assert [(w.sid, w.kind, w.tokens) for w in plan.work] == [(3, "decode", 1), (4, "draft", 6)]
    assert [s.sid for s in plan.ready] == [3, 4] and plan.drafts_only


@pytest.mark.parametrize(
    ("session", "has_work"),
    [
        (speaker(1, decode_limit=3), False),  # parked: decoded its 3 tokens, waits to be adopted or freed
        (speaker(1, decode_limit=4), True),
        (speaker(1), True),  # no limit
        (view(1, 4, replying=False, reply=3, decode_limit=3), True),  # reply over: its end marker goes in
        (view(1, 0), False),
    ],
)
def test_a_draft_at_its_decode_limit_gets_no_work(session: SessionView, has_work: bool) -> None:
    assert session.has_work is has_work
    plan, _ = drive([session])
    assert bool(plan.work) is has_work and bool(plan.ready) is has_work


@pytest.mark.parametrize(
    ("session", "kind"),
    [
        (view(1, 1, replying=True, reply=2), "decode"),
        (view(1, 1, replying=True, reply=0), "reply"),  # the header's last token: the reply has no token yet
        (view(1, 2, replying=True, reply=2), "reply"),  # more than the last token queued: prefill
        (view(1, 1, replying=False, reply=2), "listen"),
        (view(1, 1, replying=True, reply=2, priority=DRAFT), "decode"),
        (view(1, 1, replying=True, reply=0, priority=DRAFT), "draft"),
    ],
)
def test_what_a_session_work_is_for(session: SessionView, kind: str) -> None:
    assert [k for _, k, _ in packed([session])] == [kind]


def test_offers_name_the_sessions_an_admission_must_leave_alone() -> None:
    """While decode is offered every decoding session is protected (also those offered later); prefill
    offers name the sessions already in the step."""
    _, offers = drive([speaker(1), speaker(2), view(3, 4), view(4, 4)])
    assert [(o.sid, o.tokens, o.in_step) for o in offers] == [
        (1, 1, {1, 2}),
        (2, 1, {1, 2}),
        (3, 4, {1, 2}),
        (4, 4, {1, 2, 3}),
    ]


def test_refused_work_waits_and_leaves_its_budget_to_others() -> None:
    plan, offers = drive([view(1, 8), view(2, 8)], budget=8, chunk=8, refuse={1})
    assert [(w.sid, w.tokens) for w in plan.work] == [(2, 8)]
    assert [(o.sid, o.in_step) for o in offers] == [(1, set()), (2, set())]


def test_a_speaker_refused_its_decode_is_offered_its_token_as_prefill() -> None:
    """(It is still ready, and its one queued token is a chunk; it competes with the other prefill.)"""
    _, offers = drive([speaker(1), speaker(2), view(3, 4)], refuse={1})
    assert [(o.sid, o.tokens) for o in offers] == [(1, 1), (2, 1), (1, 1), (3, 4)]


def test_a_head_changed_by_an_earlier_admission_is_the_one_cut() -> None:
    """The baseline's admission preempts sessions, queueing their context again before their words: the
    chunk is cut from the head as it is when the session's turn comes, not as it was in the snapshot."""
    plan, _ = drive([view(1, 4), view(2, 4)], chunk=64, heads={2: 30})
    assert [(w.sid, w.tokens) for w in plan.work] == [(1, 4), (2, 30)]


def test_no_session_with_work_plans_an_empty_step() -> None:
    plan, offers = drive([view(1, 0), speaker(2, decode_limit=1)])
    assert plan == StepPlan((), (), drafts_only=False) and offers == []


def test_the_planner_is_driven_in_order() -> None:
    planner = StepPlanner(PlannerConfig(8, 8), [view(1, 4)])
    with pytest.raises(RuntimeError):
        planner.offer()
    with pytest.raises(RuntimeError):
        planner.answer(True)
    assert planner.next_session() == 1
    with pytest.raises(RuntimeError):
        planner.plan()
    assert planner.offer() is not None
    with pytest.raises(RuntimeError):
        planner.next_session()
    planner.answer(True)
    assert planner.next_session() is None
    assert planner.plan().work[0].tokens == 4


@pytest.mark.parametrize(("field", "value"), [("step_token_budget", 0), ("prefill_chunk", 0)])
def test_config_is_validated(field: str, value: int) -> None:
    sizes = {"step_token_budget": 8, "prefill_chunk": 8, field: value}
    with pytest.raises(ValueError, match=field):
        PlannerConfig(**sizes)


@st.composite
def snapshots(draw: st.DrawFn) -> list[SessionView]:
    out = []
    for sid in range(1, draw(st.integers(0, 8)) + 1):
        pending = draw(st.integers(0, 40))
        out.append(
            view(
                sid,
                pending,
                head=draw(st.integers(1, pending)) if pending else 0,
                replying=draw(st.booleans()),
                reply=draw(st.integers(0, 3)),
                priority=draw(st.sampled_from(Priority)),
                decode_limit=draw(st.none() | st.integers(1, 3)),
                served=draw(st.integers(0, 5)),
            )
        )
    return out


@settings(max_examples=300, deadline=None)
@given(snapshots(), st.integers(1, 24), st.integers(1, 16))
def test_invariants_of_any_step(sessions: list[SessionView], budget: int, chunk: int) -> None:
    plan, _ = drive(sessions, budget, chunk)
    working = [s for s in sessions if s.has_work]
    real = [s for s in working if s.priority is Priority.NORMAL]
    assert list(plan.ready) == (real or working) and plan.drafts_only == (bool(working) and not real)
    sids = [w.sid for w in plan.work]
    assert len(sids) == len(set(sids)) and set(sids) <= {s.sid for s in plan.ready}
    assert bool(plan.work) == bool(plan.ready)  # a step with work ready is never empty
    decode = [w.sid for w in plan.work if w.kind == "decode"]
    assert decode == [s.sid for s in plan.ready if s.decodes]  # every speaker, first, in order
    rank = {"decode": 0, "reply": 1, "listen": 1, "draft": 1}
    assert [rank[w.kind] for w in plan.work] == sorted(rank[w.kind] for w in plan.work)
    by_sid = {s.sid: s for s in sessions}
    prefill = [w for w in plan.work if w.kind != "decode"]
    for w in prefill:
        assert 1 <= w.tokens <= min(chunk, by_sid[w.sid].head_tokens)
        assert w.tokens == min(chunk, by_sid[w.sid].head_tokens)
    replying_first = [by_sid[w.sid].replying for w in prefill]
    assert replying_first == sorted(replying_first, reverse=True)
    # Within the budget, but for the one chunk an empty step always takes (and decode, which never waits).
    if decode:
        assert sum(w.tokens for w in prefill) <= max(0, budget - len(decode))
    elif prefill:
        assert sum(w.tokens for w in prefill[1:]) <= max(0, budget - prefill[0].tokens)
    # Nothing left out that would still fit.
    left = budget - sum(w.tokens for w in plan.work)
    assert all(min(chunk, s.head_tokens) > left for s in plan.ready if s.sid not in sids)
