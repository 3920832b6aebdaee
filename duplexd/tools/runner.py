"""ToolRunner: runs the server-side tools' calls for the dialog engine, and keeps the results of calls
started early (by a draft, during the user's turn) for the reply that makes the identical call.

Called on the LLM worker's thread; the calls themselves run on the MCP hub's own event loop
(`tools/mcp.py`) and come back as `concurrent.futures.Future`s that never raise: a timeout, a tool's
error, a server gone or an oversized result is a `ToolResult` with `error` set, which the model reads.

The early-call rule: a call may start before the turn is final only if its tool is known to be read-only
(the MCP server's `readOnlyHint`, or `[tools] read_only`) and `[tools] speculate` is on; `start` returns no
future for any other (the draft holds it until the turn is final). Early results are kept per conversation
(`owner`), keyed by the exact call (`ToolCall.key`: tool + canonical arguments), at most `cache_entries`;
the reply `claim`s one it uses, and `end_turn` cancels and counts those no reply took (`wasted`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Protocol

from duplexd.config import ToolsConfig
from duplexd.tools.calls import ToolCall, ToolResult, ToolSpec

log = logging.getLogger(__name__)


class ToolHost(Protocol):
    """Where the calls run (the MCP hub): its tools, and one call as a future."""

    @property
    def specs(self) -> list[ToolSpec]: ...

    def call(self, spec: ToolSpec, arguments: str) -> Future[ToolResult]: ...


class ToolRunner:
    def __init__(self, host: ToolHost, config: ToolsConfig) -> None:
        self.host = host
        self.config = config
        self.specs: list[ToolSpec] = []
        self._by_name: dict[str, ToolSpec] = {}
        for spec in host.specs:
            if (first := self._by_name.get(spec.name)) is not None:
                log.warning("tool %r of MCP server %r is hidden by the one of %r", spec.name, spec.server, first.server)
                continue
            self._by_name[spec.name] = spec
            self.specs.append(spec)
        self._lock = threading.Lock()  # (futures' callbacks run on the hub's thread)
        self._early: dict[int, OrderedDict[str, Future[ToolResult]]] = {}
        self.stats: dict[str, int] = {
            "calls": 0,  # started, early or not
            "early_calls": 0,  # started by a draft, during the user's turn
            "early_used": 0,  # ... whose result a reply took
            "wasted": 0,  # ... that no reply took (cancelled if still running)
            "held": 0,  # calls a draft made that were held until the turn was final
        }

    def spec_of(self, name: str) -> ToolSpec | None:
        """The configured servers' tool `name` (None: not one of theirs)."""
        return self._by_name.get(name)

    def read_only(self, spec: ToolSpec) -> bool:
        """Known to change nothing: its server's `readOnlyHint`, or `[tools] read_only` names it."""
        allowed = self.config.read_only_names
        return spec.read_only or spec.name in allowed or f"{spec.server}.{spec.name}" in allowed

    def may_run_early(self, spec: ToolSpec) -> bool:
        return self.config.speculate and self.read_only(spec)

    def start(
        self, owner: int, call: ToolCall, *, early: bool, spec: ToolSpec | None = None
    ) -> tuple[Future[ToolResult] | None, bool]:
        """The call's result to come, and whether it was started early. A reply's call (`early` False)
        takes an early result of the identical call if there is one (`claim`), else starts it; a draft's
        (`early` True) starts only if it may run before the turn is final (else (None, False): held),
        or joins the identical early call already running. `spec`: the tool (default: the configured
        servers' of that name; a session's own MCP tools are given)."""
        spec = spec or self._by_name[call.name]
        with self._lock:
            kept = self._early.get(owner)
            future = kept.get(call.key) if kept is not None else None
            if future is not None and not early:
                del kept[call.key]  # type: ignore[union-attr]
                self.stats["early_used"] += 1
                return future, True
            if future is not None:
                return future, True
            if early and not self.may_run_early(spec):
                self.stats["held"] += 1
                return None, False
            self.stats["calls"] += 1
            if early:
                self.stats["early_calls"] += 1
            future = self.host.call(spec, call.arguments)
            if early:
                kept = self._early.setdefault(owner, OrderedDict())
                kept[call.key] = future
                while len(kept) > self.config.cache_entries:
                    _, old = kept.popitem(last=False)
                    self._waste(old)
            return future, early

    def claim(self, owner: int, call: ToolCall) -> None:
        """A reply uses the early result of `call` it already holds (an adopted draft's): keep it out of
        `end_turn`'s count."""
        with self._lock:
            kept = self._early.get(owner)
            if kept is not None and kept.pop(call.key, None) is not None:
                self.stats["early_used"] += 1

    def end_turn(self, owner: int) -> None:
        """The conversation's reply is over: early results it did not take are dropped (cancelled)."""
        with self._lock:
            kept = self._early.pop(owner, None)
            for future in (kept or {}).values():
                self._waste(future)

    def refuse(self, message: str) -> Future[ToolResult]:
        """A call that is not made: the model reads `message` as its error."""
        future: Future[ToolResult] = Future()
        future.set_result(ToolResult(message, error=True, done_at=time.perf_counter()))
        return future

    def _waste(self, future: Future[ToolResult]) -> None:
        self.stats["wasted"] += 1
        future.cancel()
