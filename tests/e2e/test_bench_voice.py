"""`duplexd bench voice --quick` end to end: a real server child process, real conversations; the result
carries every key the issue asks for, with values that are measurements (no timing is asserted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from duplexd.bench import voice
from duplexd.clients.clips import Clip

pytestmark = pytest.mark.slow

KEYS = (
    "eos_to_first_token_p50_s",
    "eos_to_first_token_p90_s",
    "eos_to_first_audio_p50_s",
    "eos_to_first_audio_p90_s",
    "tts_rtf",
    "premature_endpoint_rate",
    "false_barge_in_rate",
)


def test_bench_voice_quick(clips: list[Clip], tmp_path: Path, capsys) -> None:
    out = tmp_path / "voice.json"
    args = argparse.Namespace(data=clips[0].path.parent.parent, config=None, quick=True, out=out)
    assert voice.main(args) == 0
    result = json.loads(out.read_text())
    for key in KEYS:
        assert result[key] is not None, key
    assert result["counts"] == {"question": 1, "pause": 1, "backchannel": 1, "echo": 1, "talk_over": 1}
    questions = [r for r in result["runs"] if r["scenario"] == "question"]
    for r in questions:  # every question was answered, text before audio
        assert r["turns"] == 1 and r["reply_text"] and r["reply_audio_s"] > 0
        assert 0 < r["eos_to_turn_end_s"] <= r["eos_to_first_token_s"] <= r["eos_to_first_audio_s"]
    assert 0 < result["tts_rtf"] < 1  # faster than real time
    assert 0.0 <= result["premature_endpoint_rate"] <= 1.0 and 0.0 <= result["false_barge_in_rate"] <= 1.0
    table = capsys.readouterr().out
    assert "first reply audio" in table and "premature endpoints" in table
