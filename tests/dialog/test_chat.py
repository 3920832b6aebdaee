"""`duplexd chat` end to end: a real process, the real model, lines on stdin, the reply on stdout."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_chat_answers_line_by_line() -> None:
    from duplexd.dialog.weights import load_weights
    from duplexd.errors import EngineError

    try:
        load_weights()  # fetch/convert here, so the subprocess below only loads
    except (EngineError, OSError) as exc:
        pytest.skip(f"SmolLM2 GGUF not cached and could not be downloaded: {exc}")
    done = subprocess.run(
        [sys.executable, "-m", "duplexd", "chat"],
        input="What is the capital of France?\n/stats\n/reset\n/stats\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "Paris" in lines[0]
    assert lines[1].startswith("tokens seen ") and "of 2048 (sinks 4)" in lines[1]
    seen_before = int(lines[1].split()[2].rstrip(","))
    assert lines[2] == "(new conversation)"
    seen_after = int(lines[3].split()[2].rstrip(","))
    assert seen_after < seen_before  # a fresh conversation (its system prompt is ingested on the next turn)


def test_streamer_waits_for_whole_characters() -> None:
    from duplexd.dialog.chat import _Streamer
    from duplexd.dialog.weights import load_weights
    from duplexd.errors import EngineError

    try:
        tokenizer = load_weights().tokenizer
    except (EngineError, OSError) as exc:
        pytest.skip(f"SmolLM2 GGUF not cached and could not be downloaded: {exc}")

    class Engine:
        pass

    engine = Engine()
    engine.tokenizer = tokenizer  # type: ignore[attr-defined]
    text = "Grüße 🙂 done"
    streamer = _Streamer(engine)  # type: ignore[arg-type]
    pieces = [streamer.push([token]) for token in tokenizer.encode(text)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
