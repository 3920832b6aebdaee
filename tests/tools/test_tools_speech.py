"""Tools with real speech, through the whole server and the native protocol: the question clips asked of a
server that runs read-only calls early (`[tools] speculate`) and of one that does not, the tool a real MCP
server over streamable HTTP (`bench/orders_mcp.py`); then a model that calls the state-changing tool, with
pauses in mid-sentence. In-process servers on the session's models (`bench tools` runs the same passes on
`duplexd serve` children)."""

from __future__ import annotations

from pathlib import Path

import pytest

from duplexd.bench import scenarios as sc
from duplexd.bench.dual_path import questions
from duplexd.bench.tool_llm import ScriptedToolLlm
from duplexd.bench.tools import ask, orders_server, unsafe_pass
from duplexd.config import ToolsConfig

pytestmark = pytest.mark.slow


async def test_spoken_questions_take_early_results_and_state_changing_calls_wait_for_the_turn(
    tool_server, clips, tmp_path: Path
) -> None:
    asked = questions(clips, quick=True)
    pause_clip = next(c.path for c in clips if c.path.name == sc.PAUSE_CLIP)
    log = tmp_path / "calls.jsonl"
    with ScriptedToolLlm() as llm, orders_server(300, log) as url:
        async with (
            tool_server(llm.url, ToolsConfig(mcp_servers=f"orders={url}")) as (on, on_runner),
            tool_server(llm.url, ToolsConfig(mcp_servers=f"orders={url}", speculate=False)) as (off, _),
        ):
            runs = await ask({"on": on, "off": off}, 300, asked)
            llm.prefer = "cancel_order"
            safety = await unsafe_pass(on, asked, pause_clip, log, pauses=(0.6,))  # (bench tools: 0.4, 0.6, 0.8)
    by_mode = {mode: {r.clip: r for r in runs if r.mode == mode} for mode in ("on", "off")}
    for clip in by_mode["on"]:
        yes, no = by_mode["on"][clip], by_mode["off"][clip]
        assert yes.tool == no.tool == "lookup_order" and yes.early and not no.early
        if yes.turn_text == no.turn_text:  # lossless: the same words, the same call and the same reply
            assert yes.arguments == no.arguments and yes.reply_text == no.reply_text
        assert yes.reply_text.startswith("Here is what I found. Order ")
    assert on_runner.stats["early_used"] >= len(asked)
    assert safety["conversations"] == len(asked) + 1
    assert safety["cancel_calls"] >= safety["conversations"]  # (a pause may end a turn: more calls, each after one)
    assert safety["held_by_drafts"] >= 1  # drafts did call it, and were held
    assert safety["early_calls_unsafe"] == 0
