"""The `duplexd` command as a user runs it: a real process, real signals, a real port."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from duplexd.cli import build_parser

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(port: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "duplexd", "serve", "--port", str(port), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_healthy(proc: subprocess.Popen[str], port: int) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                health = json.loads(r.read())
        except OSError:
            health = None
        if health is not None and health["status"] != "loading":
            return health
        time.sleep(0.2)
    raise TimeoutError("server did not come up")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_starts_logs_and_stops_cleanly_on_signal(sig: signal.Signals) -> None:
    port = _free_port()
    proc = _start(port)
    try:
        health = _wait_healthy(proc, port)
        assert health["status"] == "ok"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert f"http://localhost:{port}/" in out
    assert "models loaded" in err and "listening on" in err and "stopped" in err
    assert "Traceback" not in err


def test_serve_reports_a_busy_port_without_a_traceback() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _start(port)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
    assert "loaded" not in err  # the port is checked before any model loads (it was after ~15 s of them)


def test_serve_rejects_a_bad_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "duplexd.toml"
    bad.write_text("[asr]\nbeam_size = 0\n")
    proc = _start(_free_port(), "--config", str(bad))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "asr.beam_size must be >= 1, got 0" in err and "Traceback" not in err


def test_stream_command_prints_transcripts(clip_by_name) -> None:
    port = _free_port()
    proc = _start(port)
    try:
        _wait_healthy(proc, port)
        clip = clip_by_name["clip02_libri_1272-128104-0000.wav"]
        url = f"ws://127.0.0.1:{port}/v1/stream"
        command = [sys.executable, "-m", "duplexd", "stream", str(clip.path), "--url", url, "--speed", "2"]
        run = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=120)
        plain = subprocess.run(command, capture_output=True, text=True, timeout=120)  # stdout is a pipe
        command[command.index(str(clip.path))] = str(clip_by_name["clip01_jfk.wav"].path)
        jfk = subprocess.run(command, capture_output=True, text=True, timeout=120)
        command[command.index(url)] = f"ws://127.0.0.1:{port}/"  # the web page, not the stream endpoint
        page = subprocess.run(command, capture_output=True, text=True, timeout=60)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert run.returncode == 0, run.stderr
    events = [json.loads(line) for line in run.stdout.splitlines()]
    kinds = {e["type"] for e in events}
    assert {"session.started", "transcript.partial", "transcript.final", "session.ended"} <= kinds
    assert "frame.ack" not in kinds  # one per 20 ms frame: only with --acks
    final = " ".join(e["text"] for e in events if e["type"] == "transcript.final").lower()
    assert "quilter" in final and "gospel" in final
    # Into a pipe: the final transcripts, one per line, without the terminal's rewrite-in-place escapes.
    assert plain.returncode == 0, plain.stderr
    assert "\r" not in plain.stdout and "\x1b" not in plain.stdout
    lines = plain.stdout.splitlines()
    assert lines and all(lines)
    assert "quilter" in plain.stdout.lower() and "gospel" in plain.stdout.lower()
    # JFK breathes after "Americans", "ask not" and "for you": the server finalizes three or four utterances
    # and continues those he goes on with; each is joined to the line it continues, its end repaired (it was
    # a line of its own: "... can do for you." | "ask what you can do ..."). (Under load a continuation two
    # of whose passes read nothing past its context is decoded alone, "ask not" too: then two lines.)
    assert jfk.returncode == 0, jfk.stderr
    spoken = [re.sub(r"[^a-z ]", "", line.lower()) for line in jfk.stdout.splitlines()]
    assert len(spoken) <= 2, jfk.stdout
    assert any("americans ask not" in line or "for you ask what" in line for line in spoken), jfk.stdout
    assert page.returncode == 1 and "Traceback" not in page.stderr
    assert page.stderr.splitlines() == [
        f"duplexd: error: ws://127.0.0.1:{port}/ answered HTTP 200 instead of opening a WebSocket: it is not the "
        "stream endpoint; duplexd serves it at ws://HOST:PORT/v1/stream"
    ]


def test_parser_knows_every_command() -> None:
    parser = build_parser()
    for argv in (["serve"], ["stream", "x.wav"], ["bench", "asr", "--out", "x.json"], ["models"]):
        assert parser.parse_args(argv).command == argv[0]
