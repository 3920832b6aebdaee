"""McpHub: the MCP servers configured in `[tools] mcp_servers`, connected with the official `mcp` SDK over
streamable HTTP or stdio, on a thread of their own.

The SDK's client is asyncio (anyio) code whose context must be entered and left in one task, so each
server's session is held open by one owner task on the hub's event loop, for the server's whole life;
calls come from the LLM worker's thread (`call` -> a `concurrent.futures.Future`), run as tasks on that
loop, and never raise: a timeout (`call_timeout_s`, after which the SDK tells the server the request is
cancelled), a tool's error, arguments that are not a JSON object, a server gone, a result over
`max_result_chars` (cut, and said so) all become the `ToolResult` the model reads. Cancelling the future
cancels the task, and the SDK sends the server `notifications/cancelled`. At most `max_concurrent_calls`
run at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from duplexd.config import ToolsConfig
from duplexd.tools.calls import ToolResult, ToolSpec

log = logging.getLogger(__name__)


class McpUnavailable(RuntimeError):
    """A configured MCP server could not be started or listed (at startup): one readable line."""


@dataclass(slots=True)
class _Server:
    label: str
    target: str
    headers: dict[str, str] = field(default_factory=dict)  # (streamable HTTP: e.g. Authorization)
    client: Any = None  # mcp.Client, while connected
    stop: asyncio.Event | None = None
    task: asyncio.Task[None] | None = None


class McpHub:
    def __init__(self, config: ToolsConfig) -> None:
        self.config = config
        self.specs: list[ToolSpec] = []  # the configured servers' tools
        self._servers: dict[str, _Server] = {label: _Server(label, target) for label, target in config.servers()}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="duplexd-tools", daemon=True)
        self._limit: asyncio.Semaphore | None = None

    def start(self) -> None:
        """Start each configured server (or connect to it), and list its tools. Raises `McpUnavailable`."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        try:
            future.result(self.config.connect_timeout_s + 5)
        except McpUnavailable:
            self.close()
            raise
        except TimeoutError:
            self.close()
            raise McpUnavailable(
                f"MCP servers did not list their tools within {self.config.connect_timeout_s:g} s"
            ) from None

    async def _start(self) -> None:
        self._limit = asyncio.Semaphore(self.config.max_concurrent_calls)
        for server in list(self._servers.values()):
            self.specs += await self._open(server)

    def open(self, label: str, url: str, headers: dict[str, str] | None = None) -> Future[list[ToolSpec]]:
        """Connect to one more server (a Realtime session's `mcp` tool; `label` unique) and list its tools;
        raises `McpUnavailable` through the future. `close_server(label)` leaves it."""
        if label in self._servers:
            raise ValueError(f"MCP server {label!r} is connected already")
        server = self._servers[label] = _Server(label, url, dict(headers or {}))
        return asyncio.run_coroutine_threadsafe(self._open(server), self._loop)

    def close_server(self, label: str) -> None:
        server = self._servers.pop(label, None)
        if server is not None and server.stop is not None:
            self._loop.call_soon_threadsafe(server.stop.set)

    async def _open(self, server: _Server) -> list[ToolSpec]:
        ready: asyncio.Future[BaseException | None] = self._loop.create_future()
        server.stop = asyncio.Event()
        server.task = asyncio.create_task(self._hold(server, ready), name=f"mcp-{server.label}")
        try:
            error = await asyncio.wait_for(asyncio.shield(ready), self.config.connect_timeout_s)
        except TimeoutError:
            error = TimeoutError(f"no answer within {self.config.connect_timeout_s:g} s")
        if error is None:
            try:
                tools = (await server.client.list_tools()).tools
            except Exception as exc:
                error = exc
        if error is not None:
            server.stop.set()
            self._servers.pop(server.label, None)
            raise McpUnavailable(f"MCP server {server.label!r} ({_shown(server.target)}): {_reason(error)}")
        specs = [
            ToolSpec(
                tool.name,
                tool.description or "",
                dict(tool.input_schema or {"type": "object", "properties": {}}),
                server.label,
                read_only=tool.annotations is not None and tool.annotations.read_only_hint is True,
            )
            for tool in tools
        ]
        shown = ", ".join(f"{s.name}{' (read-only)' if s.read_only else ''}" for s in specs)
        log.info("MCP server %r: %d tools: %s", server.label, len(specs), shown)
        return specs

    async def _hold(self, server: _Server, ready: asyncio.Future[BaseException | None]) -> None:
        """The server's session, entered and left in this one task (the SDK's rule)."""
        from mcp import Client, StdioServerParameters
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        try:
            async with contextlib.AsyncExitStack() as stack:
                target: Any = server.target
                if target.startswith("stdio:"):
                    command = shlex.split(target[len("stdio:") :])
                    target = StdioServerParameters(command=command[0], args=command[1:], env=dict(os.environ))
                elif server.headers:
                    http = await stack.enter_async_context(create_mcp_http_client(headers=server.headers))
                    target = streamable_http_client(target, http_client=http)
                client = await stack.enter_async_context(
                    Client(target, read_timeout_seconds=self.config.call_timeout_s)
                )
                server.client = client
                ready.set_result(None)
                assert server.stop is not None
                await server.stop.wait()
        except Exception as exc:
            if not ready.done():
                ready.set_result(exc)
            else:
                log.error("MCP server %r: connection lost: %s", server.label, _reason(exc))
        finally:
            server.client = None

    def call(self, spec: ToolSpec, arguments: str) -> Future[ToolResult]:
        return asyncio.run_coroutine_threadsafe(self._call(spec, arguments), self._loop)

    async def _call(self, spec: ToolSpec, arguments: str) -> ToolResult:
        t0 = time.perf_counter()
        try:
            args = json.loads(arguments or "{}")
        except ValueError:
            args = None
        if not isinstance(args, dict):
            return ToolResult("The arguments are not a JSON object.", error=True, done_at=time.perf_counter())
        server = self._servers.get(spec.server)
        assert self._limit is not None
        async with self._limit:
            if server is None or server.client is None:
                return ToolResult(f"The tool's server ({spec.server}) is not connected.", error=True, done_at=t0)
            try:
                async with asyncio.timeout(self.config.call_timeout_s + 1):  # (the SDK's own comes first)
                    result = await server.client.call_tool(
                        spec.name, args, read_timeout_seconds=self.config.call_timeout_s
                    )
            except TimeoutError:
                now = time.perf_counter()
                message = f"The tool did not answer within {self.config.call_timeout_s:g} s."
                return ToolResult(message, error=True, elapsed_s=now - t0, done_at=now)
            except Exception as exc:  # MCPError (a timeout, an unknown tool), a server gone
                now = time.perf_counter()
                message = getattr(exc, "message", None) or _reason(exc)
                return ToolResult(f"The tool call failed: {message}", error=True, elapsed_s=now - t0, done_at=now)
        text = "\n".join(getattr(part, "text", "") for part in result.content if getattr(part, "text", None))
        if not text and getattr(result, "structured_content", None) is not None:
            text = json.dumps(result.structured_content)
        limit = self.config.max_result_chars
        if len(text) > limit:
            text = text[:limit] + f" [cut: the result was {len(text)} characters]"
        now = time.perf_counter()
        return ToolResult(text, error=bool(result.is_error), elapsed_s=now - t0, done_at=now)

    def close(self) -> None:
        """Leave every session (stdio servers are stopped), then the hub's loop."""
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            servers = list(self._servers.values())
            for server in servers:
                if server.stop is not None:
                    server.stop.set()
            tasks = [s.task for s in servers if s.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=5)

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        except Exception as exc:
            log.warning("MCP servers did not close cleanly: %s", _reason(exc))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _reason(exc: BaseException) -> str:
    """One line for an exception (an exception group: its first leaf's)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _shown(target: str) -> str:
    return target if target.startswith("stdio:") else target.split("?")[0]
