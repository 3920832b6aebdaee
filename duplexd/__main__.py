from __future__ import annotations

from duplexd.cli import run

run()
