"""Just enough of the Chrome DevTools Protocol to drive one page of a headless Chromium from a test.

`launch_chromium()` starts the browser with a fake microphone that plays a WAV file and yields a `Page`:
`evaluate()` runs JavaScript in it, `wait_for()` polls an expression, and every uncaught exception and
console/log error of the page is collected in `Page.problems`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed


class CdpError(Exception):
    """A CDP command failed, or JavaScript evaluated through it threw."""


class Page:
    """One attached page target: commands by id over the DevTools WebSocket, events collected."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.problems: list[str] = []  # uncaught exceptions, console.error/assert, log entries of level error
        self.console: list[str] = []  # every console message, for failure reports

    async def read_loop(self) -> None:
        """Route responses to their commands and collect events, until the connection closes."""
        try:
            async for raw in self._ws:
                msg = json.loads(raw)
                if "id" in msg:
                    future = self._pending.pop(msg["id"], None)
                    if future is not None and not future.done():
                        if "error" in msg:
                            future.set_exception(CdpError(f"{msg['error'].get('message')}: {msg['error']}"))
                        else:
                            future.set_result(msg.get("result", {}))
                else:
                    self._on_event(msg.get("method", ""), msg.get("params", {}))
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(CdpError("the DevTools connection closed"))
            self._pending.clear()

    def _on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            description = details.get("exception", {}).get("description") or details.get("text", "")
            where = f"{details.get('url', '')}:{details.get('lineNumber', -1) + 1}"
            self.problems.append(f"uncaught exception at {where}: {description}")
        elif method == "Runtime.consoleAPICalled":
            text = " ".join(_remote_text(arg) for arg in params.get("args", []))
            self.console.append(f"console.{params['type']}: {text}")
            if params["type"] in ("error", "assert"):
                self.problems.append(f"console.{params['type']}: {text}")
        elif method == "Log.entryAdded":
            entry = params["entry"]
            self.console.append(f"log.{entry['level']} ({entry.get('source')}): {entry.get('text')}")
            if entry["level"] == "error":
                self.problems.append(f"log error ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")

    async def send(self, method: str, params: dict[str, Any] | None = None, *, timeout_s: float = 30) -> dict[str, Any]:
        self._next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        await self._ws.send(json.dumps({"id": self._next_id, "method": method, "params": params or {}}))
        return await asyncio.wait_for(future, timeout_s)

    async def evaluate(self, expression: str, *, user_gesture: bool = False) -> Any:
        """The value of a JavaScript expression (JSON-like values only; promises are awaited)."""
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True, "userGesture": user_gesture},
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CdpError(details.get("exception", {}).get("description") or details.get("text"))
        return result["result"].get("value")

    async def wait_for(self, expression: str, *, timeout_s: float, poll_s: float = 0.25) -> Any:
        """Poll until `expression` is truthy and return its value; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true after {timeout_s} s: {expression}")
            await asyncio.sleep(poll_s)

    async def navigate(self, url: str, *, timeout_s: float = 30) -> None:
        await self.send("Page.navigate", {"url": url})
        await self.wait_for(
            f"location.href === {json.dumps(url)} && document.readyState === 'complete'", timeout_s=timeout_s
        )


def _remote_text(arg: dict[str, Any]) -> str:
    if "value" in arg:
        return str(arg["value"])
    return str(arg.get("description", arg.get("type", "?")))


def chromium_args(executable: str, profile: Path, fake_mic_wav: Path) -> list[str]:
    return [
        executable,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--remote-debugging-port=0",
        "--use-fake-ui-for-media-stream",  # grant the microphone without a prompt
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={fake_mic_wav}%noloop",  # play the file once, then silence
        "--autoplay-policy=no-user-gesture-required",
        "about:blank",
    ]


async def _devtools_port(profile: Path, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> int:
    """Chromium writes the port it chose (--remote-debugging-port=0) to <profile>/DevToolsActivePort."""
    active = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CdpError(f"chromium exited with {proc.returncode}: {_tail(log)}")
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            return int(active.read_text().splitlines()[0])
        await asyncio.sleep(0.1)
    raise CdpError(f"chromium did not open its DevTools port in {timeout_s} s: {_tail(log)}")


def _tail(log: Path, chars: int = 2000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return "(no log)"


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def _start_chromium(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as log_file:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the renderer, GPU and utility children too
        )


@contextlib.asynccontextmanager
async def launch_chromium(executable: str, workdir: Path, fake_mic_wav: Path) -> AsyncIterator[Page]:
    """A headless Chromium (profile and log under `workdir`) attached to its first page; killed on exit."""
    profile = workdir / "profile"
    profile.mkdir(parents=True, exist_ok=True)
    log = workdir / "chromium.log"
    proc = await asyncio.to_thread(_start_chromium, chromium_args(executable, profile, fake_mic_wav), log)
    try:
        port = await _devtools_port(profile, proc, log, timeout_s=30)
        targets = await asyncio.to_thread(_get_json, f"http://127.0.0.1:{port}/json/list")
        target = next(t for t in targets if t["type"] == "page")
        async with connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
            page = Page(ws)
            reader = asyncio.create_task(page.read_loop())
            try:
                for domain in ("Runtime", "Log", "Page"):
                    await page.send(f"{domain}.enable")
                yield page
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                    await reader
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of this browser's group is left
