"""Benchmarks: `duplexd bench asr | llm | voice | speculation | capacity | overload` (each writes JSON and
prints a short table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_result(out: Path, result: dict[str, Any], table: str) -> None:
    """A benchmark's end: its JSON to `out`, its short table to the terminal."""
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table)
    print(f"wrote {out}")
