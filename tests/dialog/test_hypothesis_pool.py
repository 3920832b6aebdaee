"""The hypothesis pool's bookkeeping: keyed drafts, bounds, pruning, and no draft for other words."""

from __future__ import annotations

import pytest

from duplexd.dialog.speculation import Draft, HypothesisPool


def draft(sid: int, owner: int = 1, base: int = 100, key: int = 200, text: str = " x") -> Draft:
    return Draft(sid=sid, owner=owner, base=base, key=key, text=text)


def test_take_returns_only_the_draft_for_that_exact_state() -> None:
    pool = HypothesisPool()
    pool.add(draft(10, key=201, text=" blue?"))
    pool.add(draft(11, key=202, text=" blue"))
    assert pool.take(1, 999) is None  # the user said something else: a miss, nothing leaks
    assert pool.take(2, 201) is None  # another conversation's state never matches this one's drafts
    hit = pool.take(1, 202)
    assert hit is not None and hit.sid == 11 and hit.text == " blue"
    assert pool.take(1, 202) is None  # taken once
    assert [d.sid for d in pool.clear(1)] == [10] and len(pool) == 0


def test_bounds_evict_the_oldest() -> None:
    pool = HypothesisPool(per_owner=2, total=3)
    assert pool.add(draft(1, key=1)) == []
    assert pool.add(draft(2, key=2)) == []
    assert [d.sid for d in pool.add(draft(3, key=3))] == [1]  # per conversation
    assert pool.add(draft(4, owner=2, key=4)) == []
    assert [d.sid for d in pool.add(draft(5, owner=3, key=5))] == [2]  # in all
    assert len(pool) == 3 and pool.has(1, 3) and not pool.has(1, 1)
    oldest = pool.oldest()
    assert oldest is not None and oldest.sid == 3


def test_prune_keeps_what_the_new_state_can_still_reach() -> None:
    pool = HypothesisPool(per_owner=4)
    pool.add(draft(1, base=100, key=201))  # forked at 100, assumes words w1
    pool.add(draft(2, base=100, key=202))  # forked at 100, assumes words w2
    pool.add(draft(3, base=150, key=250))  # forked from a state the conversation has left
    assert [d.sid for d in pool.prune(1, 100)] == [3]  # still at 100: both drafts' words may come
    assert [d.sid for d in pool.prune(1, 202)] == [1]  # the user said w2
    assert [d.sid for d in pool.drafts(1)] == [2]
    assert [d.sid for d in pool.prune(1, 300)] == [2]  # and then more: nothing is reachable


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError):
        HypothesisPool(per_owner=0)
