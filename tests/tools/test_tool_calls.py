"""The pure parts of tools: call keys, transcript turns and their chat messages, Realtime tool parsing and
rendering, and which URLs a session's MCP tools may reach."""

from __future__ import annotations

import json

import pytest

from duplexd.config import ToolsConfig
from duplexd.tools.calls import ToolCall, call_key, call_turn, chat_messages, check_turn, result_turn
from duplexd.transport import realtime as rt
from duplexd.transport.realtime_items import chat_tool_choice, function_specs, render


def test_the_same_call_has_the_same_key_whatever_its_key_order_and_spacing() -> None:
    assert call_key("f", '{"a": 1, "b": [2, 3]}') == call_key("f", '{ "b":[2,3],"a":1 }')
    assert call_key("f", '{"a": 1}') != call_key("g", '{"a": 1}')
    assert call_key("f", '{"a": 1}') != call_key("f", '{"a": 2}')
    assert call_key("f", "not json") == call_key("f", "not json") != call_key("f", "not  json")


def test_a_tool_exchange_becomes_the_chat_apis_messages() -> None:
    call = ToolCall("c1", "lookup", '{"id": "7"}')
    turns = [("user", "Where is 7?"), ("assistant", "Let me look."), call_turn(call), result_turn("c1", "shipped")]
    turns += [("assistant", "It shipped."), call_turn(ToolCall("c2", "lookup", "{}")), result_turn("c2", "none")]
    messages = chat_messages("Be kind.", turns)
    assert messages == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Where is 7?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"id": "7"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "shipped"},
        {
            "role": "assistant",
            "content": "It shipped.",
            "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "none"},
    ]
    # A call with no words before it: an assistant message of its own, content null.
    assert chat_messages("", [("user", "x"), call_turn(call)])[-1]["content"] is None


@pytest.mark.parametrize(
    ("role", "text"),
    [("system", "x"), ("tool", "x"), ("tool", json.dumps({"call_id": "c"})), ("tool_call", json.dumps({"name": "f"}))],
)
def test_a_malformed_turn_is_refused(role: str, text: str) -> None:
    with pytest.raises(ValueError):
        check_turn(role, text)


def test_realtime_tools_are_parsed_as_openai_takes_them() -> None:
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    mcp = {"type": "mcp", "server_label": "shop", "server_url": "http://127.0.0.1:9000/mcp"}
    update = rt.parse_session(
        {"type": "realtime", "tools": [weather, mcp], "tool_choice": {"type": "function", "name": "get_weather"}}
    )
    assert update.tools == (weather, mcp) and update.ignored == ()
    assert [s.name for s in function_specs(update.tools)] == ["get_weather"]
    assert chat_tool_choice(update.tool_choice) == {"type": "function", "function": {"name": "get_weather"}}
    assert rt.parse_session({"type": "realtime", "tools": []}).tools == ()
    for bad in (
        [{"type": "function"}],
        [{"type": "function", "name": "has space"}],
        [{"type": "web"}],
        [mcp | {"server_label": ""}],
    ):
        with pytest.raises(rt.RealtimeError):
            rt.parse_session({"type": "realtime", "tools": bad})
    with pytest.raises(rt.RealtimeError):
        rt.parse_session({"type": "realtime", "tool_choice": "sometimes"})


def test_rendered_items_keep_a_tool_exchange_and_leave_out_an_orphan_output() -> None:
    items = [
        {"id": "u", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"id": "a", "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ""}]},
        {"id": "f", "type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"id": "o", "type": "function_call_output", "call_id": "c1", "output": "Sunny."},
        {"id": "x", "type": "function_call_output", "call_id": "gone", "output": "?"},
        {"id": "m", "type": "mcp_call", "name": "lookup", "arguments": "{}", "output": "shipped", "server_label": "s"},
    ]
    _, turns = render(items, "")
    assert turns == [
        ("user", "Weather?"),
        ("assistant", ""),
        call_turn(ToolCall("c1", "get_weather", "{}")),
        result_turn("c1", "Sunny."),
        call_turn(ToolCall("m", "lookup", "{}")),
        result_turn("m", "shipped"),
    ]


def test_a_sessions_mcp_tools_reach_only_the_urls_the_server_allows() -> None:
    assert not ToolsConfig().session_mcp_allows("http://127.0.0.1:9000/mcp")
    local = ToolsConfig(session_mcp="http://127.0.0.1:, https://tools.example/")
    assert local.session_mcp_allows("http://127.0.0.1:9000/mcp") and local.session_mcp_allows("https://tools.example/x")
    assert not local.session_mcp_allows("http://10.0.0.1/mcp") and not local.session_mcp_allows("file:///etc/passwd")
    assert ToolsConfig(session_mcp="*").session_mcp_allows("https://anywhere/mcp")
    assert not ToolsConfig(session_mcp="*").session_mcp_allows("ftp://anywhere/mcp")


def test_a_response_s_own_tools_are_checked_and_logged_as_not_honoured() -> None:
    weather = {"type": "function", "name": "get_weather"}
    response = rt._parse_response({"tools": [weather], "tool_choice": "required"})
    assert set(response.ignored) == {"response.tools", "response.tool_choice"}
    assert rt._parse_response({"tools": [], "tool_choice": "auto"}).ignored == ()  # (OpenAI's defaults)
    with pytest.raises(rt.RealtimeError):
        rt._parse_response({"tools": [{"type": "function"}]})


def test_the_configured_read_only_names_let_a_tool_run_early() -> None:
    from concurrent.futures import Future

    from duplexd.tools.calls import ToolResult, ToolSpec
    from duplexd.tools.runner import ToolRunner

    class Host:
        specs = [ToolSpec("search", server="docs"), ToolSpec("delete", server="docs"), ToolSpec("list", server="fs")]

        def call(self, spec: ToolSpec, arguments: str) -> Future[ToolResult]:
            raise AssertionError("not called")

    runner = ToolRunner(Host(), ToolsConfig(read_only="search, fs.list"))
    assert [runner.may_run_early(s) for s in Host.specs] == [True, False, True]
    assert not ToolRunner(Host(), ToolsConfig(read_only="search", speculate=False)).may_run_early(Host.specs[0])
