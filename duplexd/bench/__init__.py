"""Benchmarks: `duplexd bench NAME`, NAME as in `cli.BENCHMARKS` (each writes JSON and prints a short
table), and the loss simulator (`duplexd relay`). Bench imports the runtime and the clients; only the CLI
imports bench (tests/test_layers.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_result(out: Path, result: dict[str, Any], table: str) -> None:
    """A benchmark's end: its JSON to `out` (its folder made if need be), its short table to the terminal."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table)
    print(f"wrote {out}")
