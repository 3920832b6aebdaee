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


def test_each_round_starts_where_the_last_rounds_first_program_ended(tmp_path) -> None:
    import soundfile as sf

    from duplexd.bench.peer import _rounds
    from duplexd.clients.clips import Clip

    clips = []
    for i in range(6):  # six 10 s clips: a 25 s program holds three of them (then its 1 s gaps)
        path = tmp_path / f"c{i}.wav"
        sf.write(path, np.zeros(16000 * 10, np.int16), 16000)
        clips.append(Clip(path, 10.0, f"clip {i}", 1))
    offline = {c.path: [Word(f"w{i}", 1.0, 1.5)] for i, c in enumerate(clips)}
    rounds = _rounds(clips, offline, n=2, rounds=2, stream_s=25.0)
    assert [[p.refs for p in batch] for batch in rounds] == [
        [["clip 0", "clip 1", "clip 2"], ["clip 3", "clip 4", "clip 5"]],  # round 1: two streams, 3 clips apart
        [["clip 3", "clip 4", "clip 5"], ["clip 0", "clip 1", "clip 2"]],  # round 2: after round 1's first program
    ]
    assert [w.start_s for w in rounds[0][0].words] == [1.0, 12.0, 23.0]  # (times within the program)
