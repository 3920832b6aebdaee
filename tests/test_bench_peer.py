"""The peer benchmark's transcript rebuild and word latency (the run itself is `python -m duplexd.bench.peer`)."""

from __future__ import annotations

import numpy as np

from duplexd.bench.asr import Program
from duplexd.bench.peer import PeerResult, peer_latencies
from duplexd.events import Word


def test_a_word_counts_from_the_first_snapshot_that_showed_it() -> None:
    program = Program(
        np.zeros(16000 * 4, np.int16), [Word("hello", 0.2, 0.6), Word("world", 0.7, 1.1)], ["hello world"]
    )
    result = PeerResult(started_at=100.0)
    result.snapshots = [
        (101.0, ["Hello"]),  # "hello" shown 0.4 s after its end was sent
        (101.5, ["Hello", "word"]),  # misheard: not yet "world"
        (102.0, ["Hello,", "world."]),  # punctuation and case do not matter
    ]
    assert result.text == "Hello, world."
    assert np.allclose(peer_latencies(result, program), [0.4, 0.9])


def test_words_the_peer_never_got_right_are_not_timed() -> None:
    program = Program(np.zeros(16000, np.int16), [Word("one", 0.1, 0.3), Word("two", 0.4, 0.6)], ["one two"])
    result = PeerResult(started_at=0.0)
    result.snapshots = [(1.0, ["one"]), (2.0, ["one", "too"])]
    assert np.allclose(peer_latencies(result, program), [0.7])
    assert peer_latencies(PeerResult(started_at=0.0), program) == []
