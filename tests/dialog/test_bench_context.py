"""`duplexd bench context`'s measurement on the real SmolLM2: a rebuilt context answers like the lived one.
No timing is asserted (timings live in the benchmark's output), only that each row measures what it says."""

from __future__ import annotations

import pytest

from duplexd.bench import context
from duplexd.dialog.engine import DialogEngine

pytestmark = pytest.mark.slow


def test_rows_compare_a_rebuilt_context_with_the_lived_one(smol, monkeypatch) -> None:
    monkeypatch.setattr(context, "POINTS", (0, 2))
    monkeypatch.setattr(context, "REPEATS", 1)
    engine = DialogEngine(*smol)
    rows = context.measure(engine)
    assert [r["turns"] for r in rows] == [0, 2]
    assert rows[1]["context_tokens"] > rows[0]["context_tokens"] > 0
    assert all(r["same_reply"] and r["next_turn_s"] > 0 and r["rebuilt_s"] > 0 for r in rows)
    assert engine.sessions == 0  # every session it opened is closed
    assert "| 2 |" in context.table(rows)
