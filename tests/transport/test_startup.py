"""Start fast, stop fast: the port answers while the models load, and a stopped server is gone at once.

The listener alone is tested in process (no models); `duplexd serve` as a real child process."""

from __future__ import annotations

import asyncio
import http
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.http11 import Response

from duplexd.config import SecurityConfig, TransportConfig
from duplexd.netutil import free_port
from duplexd.transport.listener import Listener, response


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


async def test_a_loading_listener_answers_every_route_then_hands_over() -> None:
    listener = await Listener.open(TransportConfig(host="127.0.0.1", port=0), SecurityConfig())
    base = f"http://127.0.0.1:{listener.port}"
    try:
        status, _, body = await asyncio.to_thread(get, base + "/healthz")
        assert status == 200 and json.loads(body)["status"] == "loading"  # alive: probes must not restart it
        status, headers, body = await asyncio.to_thread(get, base + "/readyz")
        assert status == 503 and headers["Retry-After"] == "2"
        assert json.loads(body) | {"version": None} == {
            "ready": False,
            "status": "loading",
            "version": None,
            "retry_after_ms": 2000,
        }
        status, headers, body = await asyncio.to_thread(get, base + "/")
        assert status == 503 and headers["Content-Type"].startswith("text/html") and b"loading" in body
        with pytest.raises(InvalidStatus) as refused:  # a client is told to come back, not dropped
            async with connect(f"ws://127.0.0.1:{listener.port}/v1/stream"):
                pass
        assert refused.value.response.status_code == 503
        assert json.loads(refused.value.response.body)["error"]["code"] == "loading"

        def route(connection: object, request: object) -> Response:
            return response(http.HTTPStatus.OK, "text/plain", b"ready\n")

        async def handler(ws: object) -> None:
            raise AssertionError("the route answers every request")

        listener.attach(route, handler)  # the server is ready: its routes answer on the same port
        status, _, body = await asyncio.to_thread(get, base + "/healthz")
        assert status == 200 and body == b"ready\n"
    finally:
        await listener.close()


def _serve(port: int, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "duplexd", "serve", "--port", str(port), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _first_answer(proc: subprocess.Popen[str], port: int) -> dict:
    for _ in range(600):
        assert proc.poll() is None, proc.communicate()[1]
        try:
            return json.loads(get(f"http://127.0.0.1:{port}/healthz")[2])
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("the port never answered")


@pytest.mark.slow
def test_serve_answers_while_loading_then_serves_then_stops() -> None:
    port = free_port()
    proc = _serve(port)
    try:
        assert _first_answer(proc, port)["status"] == "loading"  # the models take seconds to load
        status, _, body = get(f"http://127.0.0.1:{port}/readyz")
        assert status == 503 and json.loads(body)["status"] == "loading"
        for _ in range(1200):
            health = json.loads(get(f"http://127.0.0.1:{port}/healthz")[2])
            if health["status"] != "loading":
                break
            time.sleep(0.1)
        assert health["status"] == "ok" and health["models"]["llm"]
        assert get(f"http://127.0.0.1:{port}/readyz")[0] == 200
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "stopped" in err and "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_while_loading_stops_without_waiting_for_the_models() -> None:
    port = free_port()
    proc = _serve(port)
    try:
        assert _first_answer(proc, port)["status"] == "loading"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "stopped" in err and "Traceback" not in err, err
    assert "engines warmed up" not in err  # it did not wait for the loading to finish
