"""A Realtime session's own `mcp` tools (`session.tools` entries of type `mcp`, as OpenAI's API takes them):
the servers they name are connected through the server's MCP hub, each listed as an `mcp_list_tools` item,
and their tools given to the model beside the session's functions (duplexd calls them: `mcp_call` items).

Only where `[tools] session_mcp` allows the URL (else the tool is logged and not connected: a client must not
make the server connect wherever it names), and only with a remote model that takes tools. `allowed_tools`
(a list, or `{tool_names}`) narrows a server's tools; `require_approval` other than `never` (or `{never:
{tool_names}}` for those tools) leaves a tool out, logged: duplexd has no approval flow. Connections are
per session, made off the event loop (the hub's thread), and left when the session ends or the tool goes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from duplexd.tools.calls import ToolSpec

if TYPE_CHECKING:
    from duplexd.tools.mcp import McpHub
    from duplexd.transport.realtime_out import RealtimeOut

log = logging.getLogger(__name__)

MAX_SERVERS = 8  # a session's own MCP servers at once


class SessionMcp:
    def __init__(
        self,
        session_id: str,
        hub: McpHub | None,
        out: RealtimeOut,
        send: Callable[[dict[str, Any]], None],
        changed: Callable[[], None],
    ) -> None:
        """`send`: an event to the client; `changed`: the session's tools changed (give them to the model)."""
        self._session_id, self._hub, self._out, self._send, self._changed = session_id, hub, out, send, changed
        self._servers: dict[str, tuple[str, asyncio.Task[None] | None]] = {}  # label -> (url, connecting)
        self._specs: dict[str, tuple[ToolSpec, ...]] = {}  # label -> its tools the model may call

    def specs(self) -> tuple[ToolSpec, ...]:
        return tuple(spec for specs in self._specs.values() for spec in specs)

    def update(self, tools: tuple[dict[str, Any], ...]) -> list[str]:
        """The session's tools are now `tools`: connect the `mcp` servers not connected yet, leave those gone.
        Returns what is not honoured (for the session's log line)."""
        ignored: list[str] = []
        wanted: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(tools):
            if tool["type"] != "mcp":
                continue
            url = tool.get("server_url")
            hub = self._hub
            if (
                not isinstance(url, str)
                or hub is None
                or not hub.config.session_mcp_allows(url)
                or len(wanted) >= MAX_SERVERS
            ):
                ignored.append(
                    f"session.tools[{i}] (mcp: {'not allowed here' if hub is not None else 'no tools here'})"
                )
                continue
            wanted[tool["server_label"]] = tool
        for label in [
            label
            for label in self._servers
            if label not in wanted or wanted[label].get("server_url") != self._servers[label][0]
        ]:
            self._leave(label)
        for label, tool in wanted.items():
            if label not in self._servers:
                task = asyncio.get_running_loop().create_task(self._connect(label, tool))
                self._servers[label] = (tool["server_url"], task)
        return ignored

    async def _connect(self, label: str, tool: dict[str, Any]) -> None:
        from duplexd.tools.mcp import McpUnavailable

        hub = self._hub
        assert hub is not None
        item_id = self._out.ids.new("item")
        item: dict[str, Any] = {
            "id": item_id,
            "object": "realtime.item",
            "type": "mcp_list_tools",
            "server_label": label,
            "tools": [],
        }
        after = self._out.items.last
        self._send(self._out.event("conversation.item.added", previous_item_id=after, item=dict(item)))
        self._send(self._out.event("mcp_list_tools.in_progress", item_id=item_id))
        headers = {str(k): str(v) for k, v in (tool.get("headers") or {}).items()}
        if isinstance(tool.get("authorization"), str):
            headers["Authorization"] = f"Bearer {tool['authorization']}"
        try:
            specs = await asyncio.wrap_future(hub.open(f"{label}@{self._session_id}", tool["server_url"], headers))
        except McpUnavailable as exc:
            log.warning("session %s: %s", self._session_id, exc)
            self._send(self._out.event("mcp_list_tools.failed", item_id=item_id))
            self._servers[label] = (tool["server_url"], None)
            return
        item["tools"] = [
            {
                "name": s.name,
                "description": s.description,
                "input_schema": s.parameters,
                "annotations": {"readOnlyHint": s.read_only},
            }
            for s in specs
        ]
        self._send(self._out.event("mcp_list_tools.completed", item_id=item_id))
        self._send(self._out.event("conversation.item.done", previous_item_id=after, item=dict(item)))
        self._out.items.add(item)
        self._specs[label] = _usable(specs, tool, self._session_id)
        self._servers[label] = (tool["server_url"], None)
        self._changed()

    def _leave(self, label: str) -> None:
        _, task = self._servers.pop(label)
        if task is not None:
            task.cancel()
        self._specs.pop(label, None)
        if self._hub is not None:
            self._hub.close_server(f"{label}@{self._session_id}")

    def close(self) -> None:
        for label in list(self._servers):
            self._leave(label)


def _usable(specs: list[ToolSpec], tool: dict[str, Any], session_id: str) -> tuple[ToolSpec, ...]:
    """The server's tools the model may call: within `allowed_tools`, and needing no approval."""
    allowed = tool.get("allowed_tools")
    if isinstance(allowed, dict):
        allowed = allowed.get("tool_names")
    approval = tool.get("require_approval", "always")
    free: set[str] | None = None  # None: every tool
    if isinstance(approval, dict):
        free = set((approval.get("never") or {}).get("tool_names") or [])
    elif approval != "never":
        free = set()
    out = []
    for spec in specs:
        if isinstance(allowed, list) and spec.name not in allowed:
            continue
        if free is not None and spec.name not in free:
            log.info(
                "session %s: MCP tool %r needs approval, which duplexd has no flow for: not given to the model",
                session_id,
                spec.name,
            )
            continue
        out.append(spec)
    return tuple(out)
