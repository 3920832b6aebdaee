"""`duplexd bench collapse` on a small scale: the bounded engine never exceeds its pool, the unbounded
baseline preempts when whole conversations outgrow the same pool, and the run's figures add up."""

from __future__ import annotations

import argparse

import pytest

from duplexd.bench import collapse

pytestmark = pytest.mark.slow


def test_a_small_collapse_run(gguf_file) -> None:
    args = argparse.Namespace(
        sessions=3, turns=3, reply_tokens=16, window=124, unbounded_window=508, runs=1, timeout=120.0
    )
    result = collapse.run(args)
    pool = 3 * 128
    assert result["pool_rows"] == pool
    bounded, unbounded = (next(r for r in result["runs"] if r["mode"] == m) for m in ("bounded", "unbounded"))
    assert bounded["finished"] and bounded["preemptions"] == 0 and bounded["peak_rows"] <= pool
    # Three conversations of three turns hold more than 384 rows: the baseline had to preempt.
    assert unbounded["preemptions"] > 0 and unbounded["recomputed_tokens"] > 0 and unbounded["peak_rows"] <= pool
    assert bounded["reply_tokens"] > 0 and unbounded["reply_tokens"] > 0
    assert result["bounded"]["runs"] == result["unbounded"]["runs"] == 1
    assert "bounded" in collapse.table(result) and "unbounded" in collapse.table(result)
