"""`duplexd loadtest` against a real server: two real-time users, one over the admission limit."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from duplexd.clients import loadtest
from duplexd.config import AdmissionConfig, ServerConfig

pytestmark = pytest.mark.slow

KEYS = (
    "sessions_offered",
    "sessions_admitted",
    "frame_lag_p50_ms",
    "frame_lag_p99_ms",
    "deadline_miss_ratio",
    "eos_to_first_audio_p50_s",
    "refused",
    "collapsed",
    "partial_word_latency_p90_s",
    "admission_trace",
)


async def test_loadtest_measures_what_each_user_got(make_server, clips, tmp_path: Path) -> None:
    srv = await make_server(ServerConfig(admission=AdmissionConfig(period_s=3600.0, retry_after_ms=1500)))
    srv.server.admission.limit = 1.0  # one session fits: the second user is refused
    result = await loadtest.run(srv.url, 2, 10.0, clips, ramp=True)
    for key in KEYS:
        assert key in result, key
    assert result["sessions_offered"] == 2 and result["sessions_admitted"] == 1 and result["refused"] == 1
    refused = [u for u in result["users"] if not u["admitted"]]
    assert refused[0]["refused_retry_after_ms"] == 1500
    assert refused[0]["refusals"] >= 2  # it came back after the hint, and was refused again
    assert result["admission_trace"] and all(p["limit"] == 1 for p in result["admission_trace"])
    assert 0 < result["partial_word_latency_p50_s"] <= result["partial_word_latency_p90_s"] < 10
    (user,) = [u for u in result["users"] if u["admitted"]]
    assert user["turns_spoken"] >= 1 and user["frames"] >= 50  # (an ack every ~100 ms of 10 s of audio)
    assert result["frame_lag_p50_ms"] > 0 and 0 <= result["deadline_miss_ratio"] <= 1
    assert result["replies"] >= 1 and result["eos_to_first_audio_p50_s"] > 0  # the server answered
    assert result["collapsed"] == 0
    out = tmp_path / "load.json"
    html = loadtest.write_report(result, out)
    assert json.loads(out.read_text())["sessions_admitted"] == 1
    page = html.read_text()
    assert "sessions_admitted" in page and "<img" in page and (tmp_path / "load.lag.png").stat().st_size > 1000


def test_cli_refuses_nonsense(tmp_path: Path) -> None:
    from duplexd.cli import _cmd_loadtest
    from duplexd.errors import UsageError

    args = argparse.Namespace(url="ws://x", sessions=0, duration=10.0, ramp=False, clips=None, out=tmp_path / "x")
    with pytest.raises(UsageError, match="--sessions must be >= 1"):  # main() prints it as one line, exit 2
        _cmd_loadtest(args)
