"""`duplexd bench replies`: its metrics on literal replies, and its output on a small real run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from duplexd.bench import replies as bench
from duplexd.bench.data import normalize
from duplexd.clients.clips import load_clips


def test_loops_and_parrots() -> None:
    assert bench.loops(normalize("a creature of the sea, a creature of the sea, a creature of the sea"), False)
    assert not bench.loops(normalize("a creature of the sea, a creature of the sea"), False)
    assert bench.loops(normalize("I'm so sorry. I'm so sorry"), True)  # the cap cut it mid-repetition
    assert not bench.loops(normalize("I'm so sorry. I'm so sorry"), False)
    assert bench.parrot_share(normalize("The birch canoe slid"), normalize("The birch canoe slid.")) == 1.0
    assert bench.parrot_share(normalize("the the"), normalize("The the the the")) == 0.5  # (as often as said)
    assert bench.parrot_share(["x"], []) == 0.0
    turn = bench.Turn("typed", "What is the capital of France?")
    paris = bench.score(turn, "Paris.", tokens=3, cap=64)
    assert (paris.words, paris.loop, paris.parrot, paris.hit_cap) == (1, False, False, False)
    echo = bench.score(turn, "The capital of France?", tokens=64, cap=64)
    assert echo.parrot and echo.hit_cap and echo.parrot_share == 1.0


def test_summary_and_table() -> None:
    turn = bench.Turn("typed", "Hi")
    rows = [bench.score(turn, "Hello there. " * n, tokens=4, cap=64) for n in (1, 2, 3, 4)]
    s = bench.summary(rows)
    assert (s["replies"], s["loop_rate"], s["words_p50"], s["words_p90"]) == (4, 0.25, 5.0, 7.4)
    assert not s["meets_targets"]  # "hello there hello" three times in the last: a loop
    result = {**s, "targets": bench.TARGETS, "clips": s, "typed": bench.summary([])}
    assert "| all | 4 | 0.25 | 0.0 | 5.0 | 7.4 | 0.0 |" in bench.table(result)


@pytest.mark.slow
def test_a_quick_run_writes_every_figure(tmp_path: Path) -> None:
    try:
        clips = load_clips()
    except FileNotFoundError:
        pytest.skip("the shared speech clips are absent")
    out = tmp_path / "replies.json"
    args = argparse.Namespace(data=None, config=None, quick=True, out=out)
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    assert result["replies"] == len(result["runs"]) == 8
    assert [r["source"] for r in result["runs"][:4]] == [c.path.name for c in clips if c.text][:4]
    for key in ("loop_rate", "parrot_rate", "words_p50", "words_p90", "meets_targets", "clips", "typed", "config"):
        assert key in result
    assert result["config"]["max_reply_sentences"] == 2 and result["loop_rate"] == 0.0
    assert all(r["reply"] and r["tokens"] <= result["config"]["max_reply_tokens"] for r in result["runs"])
