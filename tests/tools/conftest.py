"""The whole server with tools, on the session's models: the remote backend on a (scripted) model's URL, the
MCP hub of a `[tools]` configuration started for it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from duplexd.config import ServerConfig, ToolsConfig
from duplexd.dialog.remote import RemoteConfig, RemoteDialogEngine
from duplexd.tools.mcp import McpHub
from duplexd.tools.runner import ToolRunner


@pytest.fixture
def tool_server(
    engines: Any,
) -> Callable[[str, ToolsConfig], contextlib.AbstractAsyncContextManager[tuple[int, ToolRunner]]]:
    """`async with tool_server(llm_url, tools) as (port, runner)`: a real server on port 0; its hub
    (`runner.host`) closes with it."""

    @contextlib.asynccontextmanager
    async def start(llm_url: str, tools: ToolsConfig) -> AsyncIterator[tuple[int, ToolRunner]]:
        from duplexd.transport.server import Server

        config = ServerConfig()
        config = dataclasses.replace(config, transport=dataclasses.replace(config.transport, port=0), tools=tools)
        dialog = dataclasses.replace(config.dialog, backend="remote", remote_url=llm_url)
        remote = RemoteDialogEngine(RemoteConfig.from_config(dialog))
        hub = McpHub(tools)
        await asyncio.to_thread(hub.start)
        runner = ToolRunner(hub, tools)
        remote.attach_tools(runner)
        server = Server(config, dataclasses.replace(engines, dialog=remote, tools=hub))
        stop = asyncio.Event()
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(server.run(stop, ready=ready))
        try:
            yield await asyncio.wait_for(ready, 30), runner
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    return start
