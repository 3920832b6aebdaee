"""The resume event log: numbered, bounded, acknowledged, replayed."""

from __future__ import annotations

import json

from duplexd.transport.resume import EventLog


def test_events_are_numbered_kept_until_acked_and_replayed_after_a_position() -> None:
    log = EventLog(max_events=8)
    texts = [log.add({"type": "x", "i": i}) for i in range(5)]
    assert [json.loads(t)["n"] for t in texts] == [1, 2, 3, 4, 5] and log.last == 5
    log.ack(2)
    assert log.since(0) == texts[2:] and log.since(3) == texts[3:]
    assert log.lost_since(0) == 0


def test_the_bound_forgets_the_oldest_and_a_resume_says_how_many_were_lost() -> None:
    log = EventLog(max_events=3)
    texts = [log.add({"type": "x"}) for _ in range(5)]
    assert log.since(0) == texts[2:]  # (never more than 3 kept)
    assert log.lost_since(0) == 2 and log.lost_since(1) == 1 and log.lost_since(4) == 0
    nothing = EventLog(max_events=0)
    nothing.add({"type": "x"})
    assert nothing.since(0) == [] and nothing.lost_since(0) == 1
