"""Tool calls through the remote dialog backend, against a real MCP server (the `mcp` SDK's, over stdio) and
the scripted tool-calling model (`bench/tool_llm.py`, the stand-in for a remote tool-capable model): the
tool loop, client-executed calls, and speculative execution of read-only tools by drafts."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from duplexd.bench.orders_mcp import status_of
from duplexd.bench.tool_llm import ScriptedToolLlm
from duplexd.config import ToolsConfig
from duplexd.dialog.engine import Priority
from duplexd.dialog.remote import RemoteConfig, RemoteDialogEngine
from duplexd.tools.calls import ToolSpec
from duplexd.tools.mcp import McpHub, McpUnavailable
from duplexd.tools.runner import ToolRunner

ORDERS = f"orders=stdio:{sys.executable} -m duplexd.bench.orders_mcp"


@pytest.fixture(scope="module")
def orders_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("orders") / "calls.jsonl"


@pytest.fixture(scope="module")
def hub(orders_log: Path) -> Iterator[McpHub]:
    mp = pytest.MonkeyPatch()
    mp.setenv("DUPLEXD_ORDERS_LOG", str(orders_log))
    mp.setenv("DUPLEXD_ORDERS_DELAY_S", "0.4")
    hub = McpHub(ToolsConfig(mcp_servers=ORDERS, call_timeout_s=5.0))
    hub.start()
    mp.undo()
    yield hub
    hub.close()


@pytest.fixture
def llm() -> Iterator[ScriptedToolLlm]:
    with ScriptedToolLlm() as server:
        yield server


def _engine(llm: ScriptedToolLlm, hub: McpHub, **tools: object) -> tuple[RemoteDialogEngine, ToolRunner]:
    engine = RemoteDialogEngine(RemoteConfig(url=llm.url, model="scripted", system_prompt="Be helpful."))
    runner = ToolRunner(hub, ToolsConfig(mcp_servers=ORDERS, **tools))  # type: ignore[arg-type]
    engine.attach_tools(runner)
    return engine, runner


def _reply(engine: RemoteDialogEngine, sid: int, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while engine.replying(sid):
        assert time.monotonic() < deadline, "the reply did not end"
        engine.step()
    return engine.tokenizer.decode(engine.reply_tokens(sid))


def _calls(log: Path, tool: str, order_id: str) -> list[dict]:
    if not log.exists():
        return []
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["tool"] == tool and e["order_id"] == order_id]


def test_the_hub_lists_the_servers_tools_with_their_read_only_hints(hub: McpHub) -> None:
    specs = {s.name: s for s in hub.specs}
    assert set(specs) == {"lookup_order", "cancel_order"}
    assert specs["lookup_order"].read_only and not specs["cancel_order"].read_only
    assert specs["lookup_order"].server == "orders"
    assert specs["lookup_order"].parameters["properties"]["order_id"]["type"] == "string"


def test_a_server_that_cannot_start_is_one_readable_error() -> None:
    hub = McpHub(ToolsConfig(mcp_servers="broken=stdio:/nonexistent/mcp-server", connect_timeout_s=5))
    with pytest.raises(McpUnavailable, match="MCP server 'broken'"):
        hub.start()


def test_a_reply_calls_a_server_tool_and_answers_with_its_result(llm, hub, orders_log) -> None:
    engine, runner = _engine(llm, hub)
    sid = engine.open()
    engine.append_user_text(sid, "Where is my order 48213?")
    engine.start_reply(sid)
    text = _reply(engine, sid)
    assert text == f"Here is what I found. Order 48213 is {status_of('48213')}."
    [event] = engine.take_tool_events(sid)
    assert (event.call.name, json.loads(event.call.arguments), event.server) == (
        "lookup_order",
        {"order_id": "48213"},
        "orders",
    )
    assert event.result is not None and not event.result.error and not event.early
    first, second = llm.requests[0], llm.requests[1]
    assert {t["function"]["name"] for t in first["tools"]} == {"lookup_order", "cancel_order"}
    assert second["messages"][-2]["tool_calls"][0]["function"]["name"] == "lookup_order"
    assert second["messages"][-1] == {
        "role": "tool",
        "tool_call_id": event.call.call_id,
        "content": f"Order 48213 is {status_of('48213')}.",
    }
    # The exchange stays in the transcript: the next request sends it.
    history = engine.history(sid)
    assert [m["role"] for m in history[-4:]] == ["user", "assistant", "tool", "assistant"]
    assert runner.stats["calls"] == 1 and runner.stats["early_calls"] == 0
    engine.close(sid)


def test_a_draft_runs_a_read_only_call_early_and_the_reply_uses_its_result(llm, hub, orders_log) -> None:
    engine, runner = _engine(llm, hub)
    plain = engine.open()
    engine.append_user_text(plain, "Where is my order 55501?")
    engine.start_reply(plain)
    expected = _reply(engine, plain)

    sid = engine.open()
    engine.append_user_text(sid, "Where is my order 55501?")
    draft = engine.fork(sid, priority=Priority.DRAFT, decode_limit=16)
    engine.start_reply(draft)
    deadline = time.monotonic() + 10
    while len(_calls(orders_log, "lookup_order", "55501")) < 3:  # the plain reply's start + done, the draft's start
        assert time.monotonic() < deadline, "the draft did not start the read-only call"
        engine.step()
    started = time.time()
    engine.adopt(sid, draft)  # the turn is final: the draft is the reply
    engine.start_reply(sid)  # (a no-op: it replies already)
    assert _reply(engine, sid) == expected  # lossless: the reply made without speculation
    [event] = engine.take_tool_events(sid)
    assert event.early and event.result is not None and not event.result.error
    assert runner.stats["early_calls"] == 1 and runner.stats["early_used"] == 1 and runner.stats["wasted"] == 0
    assert _calls(orders_log, "lookup_order", "55501")[-1]["t"] < started + 5


def test_a_dropped_drafts_early_result_serves_the_identical_call_of_the_reply(llm, hub, orders_log) -> None:
    engine, runner = _engine(llm, hub)
    sid = engine.open()
    engine.append_user_text(sid, "Track order 31337 please")
    draft = engine.fork(sid, priority=Priority.DRAFT, decode_limit=16)
    engine.start_reply(draft)
    deadline = time.monotonic() + 10
    while not _calls(orders_log, "lookup_order", "31337"):
        assert time.monotonic() < deadline
        engine.step()
    engine.close(draft)  # (the worker drops a draft whose words the user did not end on)
    engine.start_reply(sid)
    text = _reply(engine, sid)
    assert text == f"Here is what I found. Order 31337 is {status_of('31337')}."
    [event] = engine.take_tool_events(sid)
    assert event.early  # the draft's call, not a second one
    assert len([e for e in _calls(orders_log, "lookup_order", "31337") if e["event"] == "start"]) == 1
    assert runner.stats["early_used"] == 1 and runner.stats["wasted"] == 0


def _draft_call(engine: RemoteDialogEngine, sid: int, log: Path, order_id: str) -> None:
    """A draft of `sid`'s reply starts its (read-only) call, and is dropped."""
    draft = engine.fork(sid, priority=Priority.DRAFT, decode_limit=16)
    engine.start_reply(draft)
    deadline = time.monotonic() + 10
    while not _calls(log, "lookup_order", order_id):
        assert time.monotonic() < deadline
        engine.step()
    engine.close(draft)


def test_an_early_call_the_reply_does_not_make_is_wasted_and_cancelled(llm, hub, orders_log) -> None:
    engine, runner = _engine(llm, hub)
    sid = engine.open()
    engine.append_user_text(sid, "Where is order 7070")
    _draft_call(engine, sid, orders_log, "7070")
    engine.append_user_text(sid, " or rather order 8080808")  # the user went on: another call
    engine.start_reply(sid)
    _reply(engine, sid)
    [event] = engine.take_tool_events(sid)
    assert json.loads(event.call.arguments) == {"order_id": "8080808"} and not event.early
    assert runner.stats["wasted"] == 1 and runner.stats["early_used"] == 0
    # One still running when the conversation ends is cancelled at the MCP server.
    engine.append_user_text(sid, "And order 9191?")
    _draft_call(engine, sid, orders_log, "9191")
    engine.close(sid)
    deadline = time.monotonic() + 5
    while len(_calls(orders_log, "lookup_order", "9191")) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [e["event"] for e in _calls(orders_log, "lookup_order", "9191")] == ["start", "cancelled"]
    assert runner.stats["wasted"] == 2


def test_a_state_changing_tool_never_runs_before_the_turn_is_final(llm, hub, orders_log) -> None:
    engine, runner = _engine(llm, hub)
    sid = engine.open()
    engine.append_user_text(sid, "Please cancel order 90210")
    draft = engine.fork(sid, priority=Priority.DRAFT, decode_limit=16)
    engine.start_reply(draft)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # the draft has its call by now, held
        engine.step()
    assert _calls(orders_log, "cancel_order", "90210") == []
    assert runner.stats["held"] >= 1
    assert not engine.busy()  # (a held draft does not keep the worker stepping)
    final = time.time()
    engine.adopt(sid, draft)
    text = _reply(engine, sid)
    assert text == "Here is what I found. Order 90210 is cancelled."
    [call] = _calls(orders_log, "cancel_order", "90210")
    assert call["t"] >= final
    [event] = engine.take_tool_events(sid)
    assert not event.early
    # A dropped draft's held call never runs at all.
    sid2 = engine.open()
    engine.append_user_text(sid2, "Please cancel order 4444")
    draft = engine.fork(sid2, priority=Priority.DRAFT, decode_limit=16)
    engine.start_reply(draft)
    for _ in range(100):
        engine.step()
    engine.close(draft)
    engine.close(sid2)
    time.sleep(0.3)
    assert _calls(orders_log, "cancel_order", "4444") == []


def test_speculate_off_holds_every_call_of_a_draft(llm, hub, orders_log) -> None:
    engine, runner = _engine(llm, hub, speculate=False)
    sid = engine.open()
    engine.append_user_text(sid, "Where is order 60606")
    draft = engine.fork(sid, priority=Priority.DRAFT, decode_limit=16)
    engine.start_reply(draft)
    for _ in range(100):
        engine.step()
    assert _calls(orders_log, "lookup_order", "60606") == [] and runner.stats["held"] == 1
    engine.adopt(sid, draft)
    assert _reply(engine, sid).endswith(f"Order 60606 is {status_of('60606')}.")


def test_a_client_tool_call_ends_the_reply_and_its_result_continues_it(llm, hub) -> None:
    engine, _ = _engine(llm, hub)
    sid = engine.open()
    engine.set_tools(sid, [ToolSpec("lookup_order", "The client's own order lookup.")])  # hidden by the server's
    engine.set_tools(
        sid, [ToolSpec("get_weather", "Weather in a city.")], {"type": "function", "function": {"name": "get_weather"}}
    )
    engine.append_user_text(sid, "What is the weather in Paris?")
    engine.start_reply(sid)
    assert _reply(engine, sid) == ""
    [event] = engine.take_tool_events(sid)
    assert event.server == "" and event.call.name == "get_weather" and event.result is None
    assert llm.requests[-1]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    # The client runs it and gives the result: the transcript, rewritten with it, is answered.
    turns = [
        ("user", "What is the weather in Paris?"),
        ("tool_call", json.dumps({"call_id": event.call.call_id, "name": "get_weather", "arguments": "{}"})),
        ("tool", json.dumps({"call_id": event.call.call_id, "output": "Sunny, 21 C."})),
    ]
    engine.rewrite(sid, None, turns)
    engine.set_tools(sid, [ToolSpec("get_weather", "Weather in a city.")])  # (tool_choice back to auto)
    engine.start_reply(sid)
    assert _reply(engine, sid) == "Here is what I found. Sunny, 21 C."


def test_a_call_that_times_out_is_the_models_error_not_a_crash(llm, orders_log, monkeypatch) -> None:
    monkeypatch.setenv("DUPLEXD_ORDERS_LOG", str(orders_log))
    monkeypatch.setenv("DUPLEXD_ORDERS_DELAY_S", "3")
    slow = McpHub(ToolsConfig(mcp_servers=ORDERS, call_timeout_s=0.5))
    slow.start()
    try:
        engine, _ = _engine(llm, slow)
        sid = engine.open()
        engine.append_user_text(sid, "Where is order 12121?")
        engine.start_reply(sid)
        text = _reply(engine, sid)
        [event] = engine.take_tool_events(sid)
        assert event.result is not None and event.result.error
        assert text.startswith("Here is what I found. The tool call failed")
    finally:
        slow.close()


def test_calls_beyond_the_turns_limit_are_answered_with_an_error(llm, hub) -> None:
    engine, runner = _engine(llm, hub, max_calls_per_turn=1)
    sid = engine.open()
    engine.append_user_text(sid, "Where is order 1?")
    engine.start_reply(sid)
    _reply(engine, sid)
    assert runner.stats["calls"] == 1


def test_an_oversized_result_is_cut_and_marked(orders_log, monkeypatch) -> None:
    monkeypatch.setenv("DUPLEXD_ORDERS_LOG", str(orders_log))
    small = McpHub(ToolsConfig(mcp_servers=ORDERS, max_result_chars=64))
    small.start()
    try:
        spec = next(s for s in small.specs if s.name == "lookup_order")
        result = small.call(spec, json.dumps({"order_id": "9" * 200})).result(10)
        assert not result.error and result.output.startswith("Order 999")
        whole = f"Order {'9' * 200} is {status_of('9' * 200)}."
        assert result.output == whole[:64] + f" [cut: the result was {len(whole)} characters]"
    finally:
        small.close()
