"""Realtime function calling and server-side MCP tools, driven by the official `openai` client against the
whole server (real ASR, TTS, LLM worker) with the remote backend on the scripted tool-calling model and a
real MCP server (`bench/orders_mcp.py`, stdio)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest

from duplexd.bench.orders_mcp import status_of
from duplexd.bench.tool_llm import ScriptedToolLlm, order_key
from duplexd.config import ToolsConfig

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


async def _response(conn: Any) -> tuple[str, list[Any], Any]:
    """One response's text, its events, and its `response.done`; fails on any `error` event."""
    text, events = "", []
    async with asyncio.timeout(60):
        async for event in conn:
            events.append(event)
            assert event.type != "error", event
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type == "response.done":
                return text, events, event.response
    raise AssertionError("no response.done")


async def test_realtime_function_calls_and_mcp_calls_through_the_openai_client(
    tool_server, tmp_path, monkeypatch
) -> None:
    openai = pytest.importorskip("openai")

    monkeypatch.setenv("DUPLEXD_ORDERS_LOG", str(tmp_path / "calls.jsonl"))
    tools = ToolsConfig(mcp_servers=f"orders=stdio:{sys.executable} -m duplexd.bench.orders_mcp")
    with ScriptedToolLlm() as llm:
        async with tool_server(llm.url, tools) as (port, runner):
            client = openai.AsyncOpenAI(api_key="x", websocket_base_url=f"ws://127.0.0.1:{port}/v1")
            async with client.realtime.connect(model="duplexd") as conn:
                await conn.session.update(
                    session={
                        "type": "realtime",
                        "output_modalities": ["text"],
                        "tools": [WEATHER],
                        "tool_choice": {"type": "function", "name": "get_weather"},
                    }
                )
                user = {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Weather in Paris?"}],
                }
                await conn.conversation.item.create(item=user)
                await conn.response.create()
                text, events, done = await _response(conn)
                kinds = [e.type for e in events]
                assert "session.updated" in kinds and done.status == "completed" and text == ""
                [args_done] = [e for e in events if e.type == "response.function_call_arguments.done"]
                assert args_done.name == "get_weather"
                assert json.loads(args_done.arguments) == {"city": order_key("Weather in Paris?")}
                call = done.output[-1]
                assert (call.type, call.name, call.call_id) == ("function_call", "get_weather", args_done.call_id)
                assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
                assert kinds.index("response.function_call_arguments.done") < kinds.index("response.done")
                updated = next(e for e in events if e.type == "session.updated")
                assert updated.session.tools[0].name == "get_weather"

                # The client runs it, gives the output, and asks for the answer (tool_choice back to auto).
                await conn.session.update(session={"type": "realtime", "tool_choice": "auto"})
                output = {"type": "function_call_output", "call_id": args_done.call_id, "output": "Sunny, 21 C."}
                await conn.conversation.item.create(item=output)
                await conn.response.create()
                text, events, done = await _response(conn)
                assert text == "Here is what I found. Sunny, 21 C." and done.status == "completed"
                sent = llm.requests[-1]["messages"]
                assert [m["role"] for m in sent[-3:]] == ["user", "assistant", "tool"]
                assert sent[-2]["tool_calls"][0]["id"] == args_done.call_id and sent[-1]["content"] == "Sunny, 21 C."

                # A server-side (MCP) tool: duplexd calls it and answers; the call is an `mcp_call` item.
                user = {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Where is order 5150?"}],
                }
                await conn.conversation.item.create(item=user)
                await conn.response.create()
                text, events, done = await _response(conn)
                assert text == f"Here is what I found. Order 5150 is {status_of('5150')}."
                mcp_call = done.output[-1]
                assert (mcp_call.type, mcp_call.name, mcp_call.server_label) == ("mcp_call", "lookup_order", "orders")
                assert json.loads(mcp_call.arguments) == {"order_id": "5150"}
                assert mcp_call.output == f"Order 5150 is {status_of('5150')}." and mcp_call.error is None
                kinds = [e.type for e in events]
                assert "response.mcp_call.completed" in kinds and "response.mcp_call_arguments.done" in kinds
    assert not runner.host._thread.is_alive()  # (the hub closed with the server)


async def test_a_sessions_own_mcp_tool_is_listed_and_called_where_the_server_allows_it(tool_server, tmp_path) -> None:
    """`session.tools` of type `mcp` (as OpenAI's API takes them): a URL `[tools] session_mcp` allows is
    connected (streamable HTTP), listed as an `mcp_list_tools` item, and its tools called by duplexd; one it
    does not allow is accepted with no error and never connected."""
    openai = pytest.importorskip("openai")
    from duplexd.bench.tools import orders_server

    log = tmp_path / "calls.jsonl"
    with ScriptedToolLlm() as llm, orders_server(100, log) as url:
        async with tool_server(llm.url, ToolsConfig(session_mcp="http://127.0.0.1:")) as (port, _):
            client = openai.AsyncOpenAI(api_key="x", websocket_base_url=f"ws://127.0.0.1:{port}/v1")
            async with client.realtime.connect(model="duplexd") as conn:
                shop = {"type": "mcp", "server_label": "shop", "server_url": url, "require_approval": "never"}
                elsewhere = {"type": "mcp", "server_label": "far", "server_url": "http://10.255.255.1/mcp"}
                await conn.session.update(
                    session={"type": "realtime", "output_modalities": ["text"], "tools": [shop, elsewhere]}
                )
                listed = None
                async with asyncio.timeout(30):
                    async for event in conn:
                        assert event.type not in ("error", "mcp_list_tools.failed"), event
                        if event.type == "conversation.item.done" and event.item.type == "mcp_list_tools":
                            listed = event.item
                            break
                assert listed.server_label == "shop"
                assert {t.name for t in listed.tools} == {"lookup_order", "cancel_order"}
                user = {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Where is order 4242?"}],
                }
                await conn.conversation.item.create(item=user)
                await conn.response.create()
                text, _, done = await _response(conn)
                call = done.output[-1]
                assert (call.type, call.server_label, call.name) == ("mcp_call", "shop", "lookup_order")
                assert text == f"Here is what I found. Order 4242 is {status_of('4242')}."
                assert {t["function"]["name"] for t in llm.requests[-2]["tools"]} == {"lookup_order", "cancel_order"}
