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
    "pause_turn_text_wer",
    "pause_turn_sentence_ends",
    "false_barge_in_rate",
    "echo_false_barge_in_rate",
    "backchannel_false_barge_in_rate",
    "noise_false_barge_in_rate",
    "echo_talk_over_barge_in_rate",
    "barge_in_stop_p50_s",
    "barge_in_confirm_p50_s",
    "erle",
)


def test_bench_voice_quick(clips: list[Clip], tmp_path: Path, capsys) -> None:
    out = tmp_path / "voice.json"
    args = argparse.Namespace(data=clips[0].path.parent.parent, config=None, quick=True, out=out)
    assert voice.main(args) == 0
    result = json.loads(out.read_text())
    assert result["config_toml"] is None  # (no --config: the servers ran on the defaults and `settings`)
    for key in KEYS:
        assert result[key] is not None, key
    counts = dict(question=1, pause=1, backchannel=1, noise=3, echo=2, talk_over=1, talk_over_echo=1, repeat=1)
    assert result["counts"] == counts  # (echo: at -6 and at 0 dB; noise: a cough, a clatter, a throat clearing)
    (repeat,) = [r for r in result["runs"] if r["scenario"] == "repeat"]
    assert repeat["reply_text"] and 0.0 <= repeat["quotes"] <= 1.0  # (how well the reply quotes the question)
    assert result["repeat_barge_in_rate"] == float(repeat["interrupted"])
    questions = [r for r in result["runs"] if r["scenario"] == "question"]
    for r in questions:  # every question was answered, text before audio
        assert r["turns"] == 1 and r["reply_text"] and r["reply_audio_s"] > 0
        assert r["last_turn_text"] == r["turn_text"]  # (one turn: the last is the only one)
        assert 0 < r["eos_to_turn_end_s"] <= r["eos_to_first_token_s"] <= r["eos_to_first_audio_s"]
    assert 0 < result["tts_rtf"] < 1  # faster than real time
    (talk,) = [r for r in result["runs"] if r["scenario"] == "talk_over"]
    assert talk["paused"] >= 1 and 0 < talk["stop_s"] < talk["confirm_s"]  # paused on speech, before the words
    pauses = [r for r in result["runs"] if r["paused"]]
    assert all(r["resumed"] or r["interrupted"] for r in pauses)  # every pause ended one way or the other
    whole = result["premature_answered_whole_rate"]  # (None where no turn ended too soon)
    assert whole is None or 0.0 <= whole <= 1.0
    assert 0.0 <= result["premature_endpoint_rate"] <= 1.0 and 0.0 <= result["false_barge_in_rate"] <= 1.0
    echo = result["echo_cancellation"]  # (the `on` side gates echo: its cost over every session's microphone)
    assert echo["audio_s"] > 10 and 0 < echo["ms_per_s"] < 1000
    assert [r["room"] for r in result["runs"] if r["scenario"] == "echo"] == [e["room"] for e in result["erle"]]
    assert all(e["erle_no_drift_db"] > 10 for e in result["erle"])
    table = capsys.readouterr().out
    assert "first reply audio" in table and "premature endpoints" in table and "ERLE" in table


def test_bench_voice_baseline_runs_the_scenarios_again_with_the_features_off(clips: list[Clip]) -> None:
    result = voice.run(clips[0].path.parent.parent, None, True, baseline=True, scenarios=("echo",))
    assert result["counts"]["echo"] == 2 and result["off"]["counts"]["echo"] == 2
    assert result["settings"] == voice.FEATURES_ON and result["off"]["settings"] == voice.BASELINE_OFF
    assert result["echo_cancellation"]["audio_s"] > 0 and result["off"]["echo_cancellation"]["audio_s"] == 0
    assert "**off**" in voice.table(result)
    assert not any(r["paused"] for r in result["off"]["runs"])  # (off: the reply is never paused on speech)
