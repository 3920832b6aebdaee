"""Run a real `duplexd serve` in a child process for benchmarks (clients stay in this process)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from duplexd.netutil import free_port, ready_health


def health(port: int) -> dict[str, Any]:
    return ready_health(f"http://127.0.0.1:{port}/healthz")


@contextlib.contextmanager
def child_process(
    cmd: list[str],
    *,
    name: str,
    up: Callable[[], object],
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    poll_s: float = 0.2,
    niceness: int = 0,
) -> Iterator[subprocess.Popen[str]]:
    """Start `cmd`, wait until `up()` stops raising OSError (the service answers), stop it on exit.
    Its stderr goes to a file (a pipe nobody reads would stall a chatty server), quoted if it dies.
    `niceness` > 0: it runs at that lower CPU priority (it takes what the other processes leave)."""
    log = tempfile.TemporaryFile(mode="w+")
    lower = (lambda: os.nice(niceness)) if niceness else None  # (before exec: every thread it starts inherits it)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env, preexec_fn=lower)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{name} exited with {proc.returncode}: {log.read()[-2000:]}")
            try:
                up()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not come up") from None
                time.sleep(poll_s)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextlib.contextmanager
def server_process(
    config: Path | None = None, *, timeout_s: float = 120.0, settings: dict[str, str] | None = None
) -> Iterator[int]:
    """`settings`: `{"speculation.enabled": "false"}` and the like, on top of `config` (as environment)."""
    port = free_port()
    cmd = [sys.executable, "-m", "duplexd", "serve", "--port", str(port)]
    if config is not None:
        cmd += ["--config", str(config)]
    env = dict(os.environ)
    for name, value in (settings or {}).items():
        section, _, key = name.partition(".")
        env[f"DUPLEXD_{section.upper()}__{key.upper()}"] = value
    with child_process(cmd, name="duplexd serve", up=lambda: health(port), env=env, timeout_s=timeout_s):
        yield port


@contextlib.contextmanager
def serve_llm_process(
    *args: str, api_key: str = "", env: dict[str, str] | None = None, niceness: int = 0
) -> Iterator[int]:
    """A `duplexd serve-llm` child (more arguments: `--max-tokens 40`, ...) on a free port, which it
    yields once `/v1/models` answers; its API is at `http://127.0.0.1:PORT/v1`. `niceness` 19: it yields
    the CPU to the voice server beside it, as a model on its own machine would take none of it."""
    port = free_port()
    cmd = [sys.executable, "-m", "duplexd", "serve-llm", "--port", str(port), *args]
    headers = {}
    if api_key:
        cmd += ["--api-key", api_key]
        headers["Authorization"] = f"Bearer {api_key}"

    def up() -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=headers)
        with urllib.request.urlopen(request, timeout=5):
            pass

    with child_process(cmd, name="duplexd serve-llm", up=up, env=env, niceness=niceness):
        yield port
