"""What `duplexd` prints when it cannot do what was asked: one line on stderr that says what is wrong and what
to do, and a non-zero exit (2 for a usage error), never a traceback. Real processes, real sockets; no model
is loaded."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from duplexd.cli import build_parser
from duplexd.clients.stream import Line, Received, StreamOutput


def _duplexd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "duplexd", *args], capture_output=True, text=True, timeout=60)


def _error_line(run: subprocess.CompletedProcess[str], exit_code: int) -> str:
    """The one line `run` printed on stderr, after checking the exit code and that it is the only line."""
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == exit_code, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Page(BaseHTTPRequestHandler):
    """A plain web server: 200 and a page for every GET (as duplexd's own `/` answers)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = b"<!doctype html><title>not a WebSocket</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def wav(tmp_path: Path) -> Path:
    path = tmp_path / "quiet.wav"
    sf.write(path, np.zeros(1600, np.int16), 16_000)
    return path


def test_stream_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.wav"
    line = _error_line(_duplexd("stream", str(missing)), 2)
    assert line == f"duplexd: error: no audio file at {missing}: give the path of a WAV or FLAC file"


def test_stream_a_file_that_is_not_audio_is_a_usage_error(tmp_path: Path) -> None:
    text = tmp_path / "notes.wav"
    text.write_text("not audio\n")
    line = _error_line(_duplexd("stream", str(text)), 2)
    assert line.startswith(f"duplexd: error: cannot read {text} as audio (")
    assert line.endswith("give a WAV or FLAC file")


def test_stream_to_a_server_that_is_not_running(wav: Path) -> None:
    url = f"ws://127.0.0.1:{_free_port()}/v1/stream"
    line = _error_line(_duplexd("stream", str(wav), "--url", url), 1)
    assert line.startswith(f"duplexd: error: cannot connect to {url}: connection refused;")
    assert "duplexd serve" in line and "--url" in line


def test_stream_to_a_web_page_instead_of_the_stream_endpoint(wav: Path, http_port: int) -> None:
    url = f"ws://127.0.0.1:{http_port}/"
    line = _error_line(_duplexd("stream", str(wav), "--url", url), 1)
    assert line.startswith(f"duplexd: error: {url} answered HTTP 200 instead of opening a WebSocket")
    assert "ws://HOST:PORT/v1/stream" in line


def test_stream_to_an_http_url_is_a_usage_error_that_names_the_ws_url(wav: Path, http_port: int) -> None:
    url = f"http://127.0.0.1:{http_port}/v1/stream"
    line = _error_line(_duplexd("stream", str(wav), "--url", url), 2)
    assert line.startswith(f"duplexd: error: --url {url} is not a WebSocket URL")
    assert line.endswith(f"use ws://127.0.0.1:{http_port}/v1/stream")


def test_loadtest_checks_the_server_before_starting_users(tmp_path: Path, http_port: int) -> None:
    out = tmp_path / "load.json"
    url = f"ws://127.0.0.1:{_free_port()}/v1/stream"
    line = _error_line(_duplexd("loadtest", "--sessions", "2", "--url", url, "--out", str(out)), 1)
    assert line.startswith(f"duplexd: error: cannot connect to {url}: connection refused;")
    http = f"http://127.0.0.1:{http_port}/v1/stream"
    line = _error_line(_duplexd("loadtest", "--sessions", "2", "--url", http, "--out", str(out)), 2)
    assert line.endswith(f"use ws://127.0.0.1:{http_port}/v1/stream")
    line = _error_line(_duplexd("loadtest", "--sessions", "0", "--out", str(out)), 2)
    assert line == "duplexd: error: --sessions must be >= 1 and --duration > 0"
    assert not out.exists()  # no report of N failed users


@pytest.mark.parametrize("model", ["/nonexistent/model", "someone/not-in-the-cache"])
def test_serve_with_a_wrong_asr_model_is_a_config_error(tmp_path: Path, model: str) -> None:
    config = tmp_path / "duplexd.toml"
    config.write_text(f'[asr]\nmodel = "{model}"\n')
    # -v after the command: the flag is accepted there, and it fails before any model loads.
    run = _duplexd("serve", "-v", "--port", str(_free_port()), "--config", str(config))
    line = _error_line(run, 2)
    assert "bad configuration: asr.model must be a CTranslate2 Whisper folder or a model id in the local" in line
    assert f"got {model!r}" in line


def test_serve_with_an_asr_folder_that_is_not_a_model(tmp_path: Path) -> None:
    config = tmp_path / "duplexd.toml"
    config.write_text(f'[asr]\nmodel = "{tmp_path}"\n')
    line = _error_line(_duplexd("serve", "--config", str(config)), 2)
    assert line.endswith(f"got {str(tmp_path)!r}: the folder has no model.bin")


def test_chat_with_a_missing_model_is_one_line() -> None:
    line = _error_line(_duplexd("chat", "--model", "/nonexistent/model"), 1)
    assert "could not load the dialog model: no Hugging Face model folder at /nonexistent/model" in line


@pytest.mark.parametrize(
    ("argv", "verbose", "log_json"),
    [
        (["serve"], False, False),
        (["serve", "-v"], True, False),
        (["-v", "serve"], True, False),
        (["--log-json", "stream", "x.wav", "--verbose"], True, True),
        (["loadtest", "--sessions", "1", "--out", "x.json", "--log-json"], False, True),
    ],
)
def test_log_flags_work_before_and_after_the_command(argv: list[str], verbose: bool, log_json: bool) -> None:
    args = build_parser().parse_args(argv)
    assert (args.verbose, args.log_json) == (verbose, log_json)


def test_stream_help_documents_its_arguments_and_the_default_url() -> None:
    run = _duplexd("stream", "--help")
    assert run.returncode == 0, run.stderr
    help_text = " ".join(run.stdout.split())  # argparse wraps lines at the terminal width
    assert "the audio to send: a WAV or FLAC file" in help_text
    assert "(default ws://127.0.0.1:8000/v1/stream)" in help_text
    assert "--acks" in help_text and "frame.ack" in help_text


PARTIAL = {"type": "transcript.partial", "utterance": 1, "text": "and so my"}
FINAL = {"type": "transcript.final", "utterance": 1, "text": "And so, my fellow Americans."}
ACK = {"type": "frame.ack", "seq": 7}
ERROR = {"type": "error", "code": "overloaded", "message": "try later"}


TTY = {"json_lines": False, "acks": False, "tty": True, "width": 200}


def shown(events: list[dict[str, object]], **how: bool | int) -> list[Line]:
    output = StreamOutput(**how)
    return [line for i, e in enumerate(events) for line in output.show(Received(0.1 * i, e))] + output.close()


@pytest.mark.parametrize(
    ("event", "tty", "expected"),
    [
        (PARTIAL, True, [Line("\r\x1b[2K… and so my", end=""), Line("")]),
        # (on a terminal a final stays in the line in progress until it is known whether speech goes on
        # with it; the stream's end finishes the line)
        (
            FINAL,
            True,
            [Line("\r\x1b[2KAnd so, my fellow Americans.", end=""), Line("\r\x1b[2KAnd so, my fellow Americans.")],
        ),
        (ERROR, True, [Line("\nserver error overloaded: try later", stderr=True)]),
        (PARTIAL, False, []),  # a pipe or a file gets the finals only, one per line
        (FINAL, False, [Line("And so, my fellow Americans.")]),
        (ERROR, False, [Line("server error overloaded: try later", stderr=True)]),
        (ACK, True, []),
        (ACK, False, []),
    ],
)
def test_stream_output_has_terminal_escapes_only_on_a_terminal(
    event: dict[str, object], tty: bool, expected: list[Line]
) -> None:
    assert shown([event], json_lines=False, acks=False, tty=tty) == expected


def test_a_terminal_rewrites_one_line_for_an_utterance_and_the_ones_that_continue_it() -> None:
    # JFK, its pauses breaths: the line in progress holds the finals so far (their ends repaired as they
    # read joined) and then the newest partial; it ends once speech does not go on with it.
    events = [
        {"type": "transcript.partial", "utterance": 1, "text": "And so my"},
        {"type": "transcript.final", "utterance": 1, "text": "And so my fellow Americans."},
        {"type": "transcript.partial", "utterance": 2, "text": "ask not"},
        {
            "type": "transcript.final",
            "utterance": 2,
            "text": "ask not.",
            "continues": 1,
            "previous_text": "And so my fellow Americans",
        },
        {"type": "transcript.final", "utterance": 3, "text": "Thank you."},
    ]
    assert [(line.text.removeprefix("\r\x1b[2K"), line.end) for line in shown(events, **TTY)] == [
        ("… And so my", ""),
        ("And so my fellow Americans.", ""),
        ("And so my fellow Americans. … ask not", ""),
        ("And so my fellow Americans ask not.", ""),
        ("And so my fellow Americans ask not.", "\n"),  # (utterance 3 does not continue it: the line is done)
        ("Thank you.", ""),
        ("Thank you.", "\n"),  # (the stream's end)
    ]


def test_a_terminal_shows_the_newest_end_of_a_line_in_progress_wider_than_itself() -> None:
    # (a line that wraps cannot be rewritten in place: the escape clears only the terminal's last row)
    output = StreamOutput(**(TTY | {"width": 20}))
    (line,) = output.show(
        Received(0.0, {"type": "transcript.partial", "utterance": 1, "text": "a b c d e f g h i j k"})
    )
    assert line == Line("\r\x1b[2K… c d e f g h i j k", end="")  # (19 columns)
    assert output.close() == [Line("")]  # (the stream ended on a partial: the prompt starts on a line of its own)


@pytest.mark.parametrize("tty", [True, False])
def test_stream_json_lines_leave_out_frame_acks_unless_asked(tty: bool) -> None:
    assert [line.text for line in shown([PARTIAL, ACK, FINAL], json_lines=True, acks=False, tty=tty)] == [
        '{"type": "transcript.partial", "utterance": 1, "text": "and so my"}',
        '{"type": "transcript.final", "utterance": 1, "text": "And so, my fellow Americans."}',
    ]
    assert shown([ACK], json_lines=True, acks=True, tty=tty) == [Line('{"type": "frame.ack", "seq": 7}')]
