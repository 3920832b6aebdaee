"""`duplexd loadtest`: how each way a connection attempt can end is counted (pure), the progress line, the
report (JSON + HTML with its plots); against real servers: two real-time users, one over the admission
limit or over the connections per address; a server that closes handshakes unanswered."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
from pathlib import Path

import pytest
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosedError, InvalidMessage, InvalidStatus
from websockets.frames import Close
from websockets.http11 import Response

from duplexd.clients import loadtest
from duplexd.clients.loadtest import Outcome, UserResult
from duplexd.clients.stream import SessionRefused
from duplexd.config import AdmissionConfig, SecurityConfig, ServerConfig


def _http(status: int, body: bytes = b"", **headers: str) -> InvalidStatus:
    return InvalidStatus(Response(status, "", Headers(headers), body))


@pytest.mark.parametrize(
    ("exc", "outcome"),
    [
        (
            SessionRefused({"type": "error", "code": "overloaded", "retry_after_ms": 1500}),
            Outcome("overloaded", refused=True, retry_after_ms=1500),
        ),
        (SessionRefused({"type": "error", "code": "unsupported_version"}), Outcome("unsupported_version")),
        (_http(429, **{"Retry-After": "2"}), Outcome("http_429", refused=True, retry_after_ms=2000)),
        (
            _http(503, b'{"error": {"code": "loading"}, "retry_after_ms": 700}'),
            Outcome("http_503", refused=True, retry_after_ms=700),
        ),
        (_http(503), Outcome("http_503", refused=True)),
        (_http(401, b'{"error": {"code": "unauthorized"}}'), Outcome("http_401")),
        (InvalidMessage("did not receive a valid HTTP response"), Outcome("no_http_response")),
        (TimeoutError(), Outcome("timeout")),
        (ConnectionRefusedError(111, "refused"), Outcome("connection_refused")),
        (ConnectionClosedError(None, None), Outcome("closed_1006")),
        (
            ExceptionGroup("tasks", [ConnectionClosedError(Close(1011, "internal"), None)]),
            Outcome("closed_1011"),
        ),
        (ValueError("?"), Outcome("ValueError")),
    ],
)
def test_every_way_an_attempt_ends_has_a_cause(exc: BaseException, outcome: Outcome) -> None:
    assert loadtest.outcome_of(exc) == outcome


@pytest.mark.parametrize(
    ("elapsed_s", "done", "line"),
    [
        (0.2, 0, "    0/10 s, 0/4 users done"),
        (9.6, 1, "   10/10 s, 1/4 users done"),
        (15.0, 3, "   10/10 s, ending sessions: 3/4 users done"),  # never 15/10 s
    ],
)
def test_progress_stops_at_the_duration(elapsed_s: float, done: int, line: str) -> None:
    assert loadtest.progress_line(elapsed_s, 10.0, done, 4) == line


def _users() -> list[UserResult]:
    a = UserResult(0, admitted=True, admitted_at_s=0.1, frames=3, turns_spoken=1, replies=1)
    a.lags_ms, a.lag_at_s = [1.0 / 3, 250.0, 19.028999999999957], [0.2, 0.3, 0.4]
    a.word_latency_s, a.eos_to_first_audio_s = [0.1 + 0.2, 1.0 / 3], [2.0 / 3]
    a.reply_s, a.stall_s, a.underrun_s = 1.1 + 2.2, 0.1 + 0.2, 0.1 + 0.2
    b = UserResult(1, admitted=False, refusals=2, refusal_causes={"overloaded": 1, "http_429": 1})
    b.refused_at_s, b.refused_retry_after_ms = [0.5, 2.5], 2000
    c = UserResult(2, admitted=False, error="no_http_response", error_at_s=0.7)
    return [a, b, c]


def test_the_report_counts_every_attempt_rounds_its_figures_and_plots(tmp_path: Path) -> None:
    users = _users()
    result = {
        **loadtest.summarize(users, offered=3, duration_s=10.0),
        "admission_trace": [{"t": 1.0, "limit": 2, "sessions": 1}, {"t": 2.0, "limit": 1, "sessions": 1}],
        "users": [loadtest._user_dict(u) for u in users],
    }
    assert result["attempts"] == 4 == result["sessions_admitted"] + result["refusals"] + result["errors"]
    assert result["refusals_by_cause"] == {"http_429": 1, "overloaded": 1}
    assert result["errors_by_cause"] == {"no_http_response": 1} and result["refused"] == 1
    assert result["frame_lag_p50_ms"] == 19.0 and result["deadline_miss_ratio"] == 0.3333
    assert result["token_stall_ratio"] == 0.0909 and result["users"][0]["reply_s"] == 3.3
    out = tmp_path / "load.json"
    page = loadtest.write_report(result, out)
    text = out.read_text()
    assert not re.search(r"\d\.\d{5,}", text), "unrounded figures in the JSON"
    assert "lags_ms" not in text and json.loads(text)["errors_by_cause"] == {"no_http_response": 1}
    html = page.read_text()
    pngs = re.findall(r'<img src="data:image/png;base64,([^"]+)" alt="([^"]+)"', html)
    assert [alt for _, alt in pngs] == [
        "frame lag over time",
        "latency distributions",
        "admitted and refused over time",
    ]
    for data, _ in pngs:  # real images, not placeholders
        png = base64.b64decode(data)
        assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert "no plot" not in html and "no_http_response" in html


@pytest.mark.slow
async def test_a_server_that_closes_handshakes_unanswered_is_counted_not_fatal(clips) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        result = await loadtest.run(f"ws://127.0.0.1:{port}/v1/stream", 3, 6.0, clips, ramp=False)
    assert result["sessions_admitted"] == 0 and result["refused"] == 0
    assert result["errors_by_cause"] == {"no_http_response": 3} and result["attempts"] == 3


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
    "loop_lag_p99_ms",
    "loop_lag_max_ms",
)


@pytest.mark.slow
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
    assert result["refusals_by_cause"] == {"overloaded": refused[0]["refusals"]} and result["errors"] == 0
    assert result["admission_trace"] and all(p["limit"] == 1 for p in result["admission_trace"])
    assert 0 < result["partial_word_latency_p50_s"] <= result["partial_word_latency_p90_s"] < 10
    (user,) = [u for u in result["users"] if u["admitted"]]
    assert user["turns_spoken"] >= 1 and user["frames"] >= 50  # (an ack every ~100 ms of 10 s of audio)
    assert result["frame_lag_p50_ms"] > 0 and 0 <= result["deadline_miss_ratio"] <= 1
    assert result["replies"] >= 1 and result["eos_to_first_audio_p50_s"] > 0  # the server answered
    assert result["collapsed"] == 0
    assert 0 <= result["loop_lag_p99_ms"] <= result["loop_lag_max_ms"]  # (the server's event loop, from /healthz)
    out = tmp_path / "load.json"
    html = loadtest.write_report(result, out)
    assert json.loads(out.read_text())["sessions_admitted"] == 1
    page = html.read_text()
    assert "sessions_admitted" in page and page.count('<img src="data:image/png;base64,') == 3


@pytest.mark.slow
async def test_a_refusal_at_the_handshake_is_retried_after_its_hint(make_server, clips) -> None:
    config = ServerConfig(
        admission=AdmissionConfig(retry_after_ms=3000), security=SecurityConfig(max_connections_per_ip=1)
    )
    srv = await make_server(config)
    result = await loadtest.run(srv.url, 2, 8.0, clips, ramp=False)
    assert result["sessions_admitted"] == 1 and result["refused"] == 1 and result["errors"] == 0
    (refused,) = [u for u in result["users"] if not u["admitted"]]
    assert refused["refusal_causes"] == {"http_429": refused["refusals"]} and refused["refused_retry_after_ms"] == 3000
    assert refused["refusals"] == result["refusals"] >= 1


def test_cli_refuses_nonsense(tmp_path: Path) -> None:
    from duplexd.cli import _cmd_loadtest
    from duplexd.errors import UsageError

    args = argparse.Namespace(url="ws://x", sessions=0, duration=10.0, ramp=False, clips=None, out=tmp_path / "x")
    with pytest.raises(UsageError, match="--sessions must be >= 1"):  # main() prints it as one line, exit 2
        _cmd_loadtest(args)
