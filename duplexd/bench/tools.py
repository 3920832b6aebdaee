"""`duplexd bench tools`: speculative tool execution. Spoken questions whose answer needs a read-only tool,
with the tool taking 300 and 800 ms, asked of two servers side by side: `on` (`[tools] speculate = true`: a
draft made at the user's pause starts the read-only call, the reply takes its result) and `off` (the draft
holds the call until the turn is final). Both have speculative listening on; only the tool's early start
differs.

The model is the scripted tool-calling server (`bench/tool_llm.py`, in this process: the stand-in for a
remote tool-capable model), which asks `lookup_order` for the user's longest word; the tool is a real MCP
server (`bench/orders_mcp.py`) over streamable HTTP, one per latency, answering after that long. Two real
`duplexd serve` children (`backend = "remote"`, `[tools] mcp_servers`) per latency. Every question clip (one
speaker, <= 8 s, after 0.5 s of silence) is asked of each, the order alternating from clip to clip.
Latencies are client-side, from the end of speech (Silero VAD over the audio) to the first reply audio.

Then the safety pass: the model asks the state-changing `cancel_order` instead, for every question and for
the pause clip said with a 0.4, 0.6 and 0.8 s pause in mid-sentence, on the `on` server: `early_calls_unsafe` counts
cancellations the MCP server recorded before the client heard `turn.ended` (minus 0.1 s for the event's way
to the client), and must be 0.

Keys per latency and mode: `eos_to_first_audio_p50_s` / `_p90_s`, `turn_end_to_first_audio_p50_s`,
`tool_ready_at_turn_end_rate` (replies whose tool result was there when the turn ended: started early and
not waited for), `early_rate` (replies that took an early result), `wasted_tool_calls` (early calls no reply
took, from the server's /healthz); `targets.speculation_gain` per latency (1 - on / off, target >= 0.40 at
800 ms) and `early_calls_unsafe`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duplexd.bench import scenarios as sc
from duplexd.bench import write_result
from duplexd.bench.dual_path import first_audio, questions, until_reply_done
from duplexd.bench.server import child_process, health, server_process
from duplexd.bench.tool_llm import ScriptedToolLlm
from duplexd.clients.clips import load_clips
from duplexd.clients.converse import ConversationResult, converse_pcm
from duplexd.clients.stats import percentile
from duplexd.netutil import free_port

LATENCIES_MS = (300, 800)
MODES = ("on", "off")
PAUSES_S = (0.4, 0.6, 0.8)
UNSAFE_SLACK_S = 0.1  # (`turn.ended`'s way from the server's turn end to this client, at most)


@dataclass(slots=True)
class Run:
    mode: str
    latency_ms: int
    clip: str
    turn_text: str
    reply_text: str
    tool: str | None
    arguments: str | None
    early: bool
    waited_ms: float | None
    eos_to_first_audio_s: float | None
    turn_end_to_first_audio_s: float | None


@contextlib.contextmanager
def orders_server(latency_ms: int, log: Path):
    """The orders MCP server over streamable HTTP, its lookups taking `latency_ms`; yields its URL."""
    import socket

    port = free_port()

    def up() -> None:
        socket.create_connection(("127.0.0.1", port), 1).close()

    env = {**os.environ, "DUPLEXD_ORDERS_DELAY_S": str(latency_ms / 1000), "DUPLEXD_ORDERS_LOG": str(log)}
    cmd = [sys.executable, "-m", "duplexd.bench.orders_mcp", "--http", "--port", str(port)]
    with child_process(cmd, name="orders MCP server", up=up, env=env, timeout_s=60):
        yield f"http://127.0.0.1:{port}/mcp"


def _measure(mode: str, latency_ms: int, clip: str, result: ConversationResult, eos_s: float) -> Run:
    turn_text, eos_to_audio, turn_to_audio = first_audio(result, eos_s)
    calls = [r.event for r in result.of_type("reply.tool") if r.event["reply"] == 1]
    call = calls[0] if calls else None
    return Run(
        mode=mode,
        latency_ms=latency_ms,
        clip=clip,
        turn_text=turn_text,
        reply_text="".join(r.event["text"] for r in result.of_type("reply.delta") if r.event["reply"] == 1),
        tool=None if call is None else call["name"],
        arguments=None if call is None else call["arguments"],
        early=bool(call and call["early"]),
        waited_ms=None if call is None else call["waited_ms"],
        eos_to_first_audio_s=eos_to_audio,
        turn_end_to_first_audio_s=turn_to_audio,
    )


def _say(clip_path: Path) -> tuple[np.ndarray, float]:
    audio = np.concatenate([sc.silence(0.5), sc.load(clip_path)])
    return audio, sc.speech_end_s(audio)


async def ask(ports: dict[str, int], latency_ms: int, clips: list[Any]) -> list[Run]:
    runs: list[Run] = []
    modes = list(ports)
    for i, clip in enumerate(clips):
        audio, eos_s = _say(clip.path)
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            url = f"ws://127.0.0.1:{ports[mode]}/v1/stream"
            result = await converse_pcm(url, audio, sc.RATE, max_s=60, until=until_reply_done)
            r = _measure(mode, latency_ms, clip.path.name, result, eos_s)
            runs.append(r)
            print(
                f"  {latency_ms:>3} ms {clip.path.name} {mode:>3}: eos->audio {r.eos_to_first_audio_s} s, "
                f"{r.tool} early={r.early} waited {r.waited_ms} ms",
                flush=True,
            )
    return runs


async def unsafe_pass(
    port: int, clips: list[Any], pause_clip: Path | None, log: Path, pauses: tuple[float, ...] = PAUSES_S
) -> dict[str, Any]:
    """Every question, and `pause_clip` with `pauses` in mid-sentence, asked of a server whose model calls the
    state-changing tool: cancellations the MCP server saw before the client heard the turn end."""
    said: list[tuple[str, np.ndarray, float]] = [(c.path.name, *_say(c.path)) for c in clips]
    for pause_s in pauses if pause_clip is not None else ():
        assert pause_clip is not None
        paused, _ = sc.with_pause(sc.load(pause_clip), *sc.PAUSE_AT_S, pause_s, 0.5)
        audio = np.concatenate([sc.silence(0.5), paused])
        said.append((f"{pause_clip.name} +{pause_s}s pause", audio, sc.speech_end_s(audio)))
    wall = time.time() - time.monotonic()  # (the MCP server logs wall-clock time)
    calls = unsafe = 0
    for name, audio, _ in said:
        before = len(_logged(log))
        result = await converse_pcm(
            f"ws://127.0.0.1:{port}/v1/stream", audio, sc.RATE, max_s=60, until=until_reply_done
        )
        await asyncio.sleep(0.5)  # (a call made after the reply's end would be logged by now)
        turn_ends = [wall + r.t for r in result.of_type("turn.ended")]
        mine = [e for e in _logged(log)[before:] if e["tool"] == "cancel_order"]
        calls += len(mine)
        early = [e for e in mine if not any(t - UNSAFE_SLACK_S <= e["t"] for t in turn_ends)]
        unsafe += len(early)
        print(f"  cancel_order: {name}: {len(turn_ends)} turn(s), {len(mine)} call(s), {len(early)} early", flush=True)
    stats = (await asyncio.to_thread(health, port)).get("tools") or {}
    return {
        "conversations": len(said),
        "cancel_calls": calls,
        "held_by_drafts": stats.get("held"),
        "early_calls_unsafe": unsafe,
    }


def _logged(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


# What the embedded SmolLM2-135M does with tools: its chat template has no tool format, so the tools go in
# the system prompt in the convention of tool-tuned chat models (a JSON call inside <tool_call> tags).
PROBE_SYSTEM = (
    "You are a helpful assistant with tools. To use a tool, reply with only "
    '<tool_call>{"name": TOOL, "arguments": {...}}</tool_call>. Otherwise answer in one short sentence. Tools: '
    '[{"name": "lookup_order", "description": "Look up the status of an order by its id.", '
    '"parameters": {"order_id": "string"}}, {"name": "get_weather", "description": "The weather in a city.", '
    '"parameters": {"city": "string"}}]'
)
PROBE_NEEDS = [  # (question, tool, its argument's value)
    ("Where is my order 48213?", "lookup_order", "48213"),
    ("Can you check the status of order 7731?", "lookup_order", "7731"),
    ("Has order 55501 shipped yet?", "lookup_order", "55501"),
    ("Track my order number 90210 please.", "lookup_order", "90210"),
    ("What is the weather in Paris?", "get_weather", "paris"),
    ("Is it raining in London right now?", "get_weather", "london"),
    ("How warm is it in Lisbon today?", "get_weather", "lisbon"),
    ("What's the forecast for Tokyo?", "get_weather", "tokyo"),
]
PROBE_PLAIN = [
    "Hello, how are you?",
    "What is the capital of France?",
    "Tell me a short joke.",
    "Thank you, that is all.",
]


def smollm2_probe() -> dict[str, Any]:
    """SmolLM2-135M's replies to questions that need a tool and ones that do not, the tools described in its
    system prompt: how often it writes a well-formed call to the right tool with the right argument."""
    import re

    from duplexd.dialog.engine import DialogEngine, EngineConfig

    engine = DialogEngine.load(EngineConfig(max_sessions=len(PROBE_NEEDS) + len(PROBE_PLAIN), max_reply_sentences=0))
    questions = [q for q, _, _ in PROBE_NEEDS] + PROBE_PLAIN
    sids = [engine.open(PROBE_SYSTEM) for _ in questions]
    for sid, q in zip(sids, questions, strict=True):
        engine.append_user_text(sid, q)
        engine.start_reply(sid)
    while any(engine.replying(sid) for sid in sids):
        engine.step()
    replies = [engine.tokenizer.decode(engine.reply_tokens(sid), skip_special_tokens=True).strip() for sid in sids]

    def call(text: str) -> dict[str, Any] | None:
        m = re.search(r"<tool_call>(.*?)(</tool_call>|$)", text, re.S)
        try:
            parsed = json.loads(m.group(1)) if m else None
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None

    right = formed = 0
    for (_, tool, value), text in zip(PROBE_NEEDS, replies, strict=False):
        c = call(text)
        formed += c is not None
        args = c.get("arguments") if c else None
        right += bool(c and c.get("name") == tool and isinstance(args, dict) and value in json.dumps(args).lower())
    false_calls = sum(call(t) is not None or "<tool_call>" in t for t in replies[len(PROBE_NEEDS) :])
    return {
        "chat_template_has_tool_format": False,
        "needs_tool": len(PROBE_NEEDS),
        "well_formed_calls": formed,
        "right_calls": right,
        "plain_questions": len(PROBE_PLAIN),
        "calls_on_plain_questions": false_calls,
        "replies": dict(zip(questions, replies, strict=True)),
    }


def summarize(runs: list[Run], wasted: dict[str, dict[str, int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        out[mode] = {}
        for latency in sorted({r.latency_ms for r in runs}):
            rs = [r for r in runs if r.mode == mode and r.latency_ms == latency]
            if not rs:
                continue
            entry: dict[str, Any] = {"n": len(rs), "tool_calls": sum(r.tool is not None for r in rs)}
            for name in ("eos_to_first_audio", "turn_end_to_first_audio"):
                values = [v for r in rs if (v := getattr(r, f"{name}_s")) is not None]
                entry[f"{name}_p50_s"] = percentile(values, 50)
                entry[f"{name}_p90_s"] = percentile(values, 90)
            called = [r for r in rs if r.tool is not None]
            entry["early_rate"] = round(sum(r.early for r in called) / len(called), 3) if called else None
            ready = [r.early and (r.waited_ms or 0) == 0 for r in called]
            entry["tool_ready_at_turn_end_rate"] = round(sum(ready) / len(called), 3) if called else None
            waits = [r.waited_ms for r in called if r.waited_ms is not None]
            entry["tool_waited_p50_ms"] = percentile(waits, 50)
            entry["wasted_tool_calls"] = wasted.get(mode, {}).get(str(latency))
            out[mode][str(latency)] = entry
    return out


def targets(summary: dict[str, Any], unsafe: int) -> dict[str, Any]:
    gain = {}
    for latency, on in summary.get("on", {}).items():
        off = summary.get("off", {}).get(latency, {}).get("eos_to_first_audio_p50_s")
        mine = on.get("eos_to_first_audio_p50_s")
        gain[latency] = None if off in (None, 0) or mine is None else round(1 - mine / off, 3)
    return {"speculation_gain": gain, "gain_target_at_800_ms": 0.40, "early_calls_unsafe": unsafe}


def run(
    data: Path | None, config: Path | None, quick: bool, latencies: tuple[int, ...] = LATENCIES_MS
) -> dict[str, Any]:
    every = load_clips(data)
    clips = questions(every, quick)
    pause_clip = next((c.path for c in every if c.path.name == sc.PAUSE_CLIP), None)
    runs: list[Run] = []
    wasted: dict[str, dict[str, int]] = {mode: {} for mode in MODES}
    unsafe: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, ScriptedToolLlm() as llm:
        for latency in latencies:
            log = Path(tmp) / f"calls-{latency}.jsonl"
            with contextlib.ExitStack() as stack:
                url = stack.enter_context(orders_server(latency, log))
                remote = {
                    "dialog.backend": "remote",
                    "dialog.remote_url": llm.url,
                    "dialog.remote_model": "scripted-tools",
                    "tools.mcp_servers": f"orders={url}",
                }
                ports = {
                    mode: stack.enter_context(
                        server_process(config, settings={**remote, "tools.speculate": str(mode == "on").lower()})
                    )
                    for mode in MODES
                }
                runs += asyncio.run(ask(ports, latency, clips))
                for mode, port in ports.items():
                    wasted[mode][str(latency)] = (health(port).get("tools") or {}).get("wasted")
                if latency == latencies[0]:  # the safety pass, once
                    llm.prefer = "cancel_order"
                    unsafe = asyncio.run(unsafe_pass(ports["on"], clips, pause_clip, log))
                    llm.prefer = None
    summary = summarize(runs, wasted)
    probe = smollm2_probe()
    return {
        "benchmark": "tools",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "latencies_ms": list(latencies),
        **summary,
        "safety": unsafe,
        "targets": targets(summary, int(unsafe.get("early_calls_unsafe") or 0)),
        "model": "scripted tool-calling server (bench/tool_llm.py), a stand-in for a remote tool-capable model",
        "smollm2": probe,
        "runs": [asdict(r) for r in runs],
    }


def table(result: dict[str, Any]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        "| tool latency | speculation | eos -> first audio p50 / p90 | turn ended -> first audio p50 | early "
        "| ready at turn end | wasted |",
        "|---|---|---|---|---|---|---|",
    ]
    for latency in map(str, result["latencies_ms"]):
        for mode in MODES:
            e = result.get(mode, {}).get(latency)
            if e is None:
                continue
            lines.append(
                f"| {latency} ms | {mode} | {s(e['eos_to_first_audio_p50_s'])} / {s(e['eos_to_first_audio_p90_s'])} "
                f"| {s(e['turn_end_to_first_audio_p50_s'])} | {e['early_rate']} | {e['tool_ready_at_turn_end_rate']} "
                f"| {e['wasted_tool_calls']} |"
            )
    lines.append(f"safety: {result['safety']}")
    probe = {k: v for k, v in result["smollm2"].items() if k != "replies"}
    lines.append(f"SmolLM2-135M with the tools in its system prompt: {probe}")
    lines.append(f"targets: {result['targets']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    latencies = tuple(int(x) for x in args.tool_latencies.split(",")) if args.tool_latencies else LATENCIES_MS
    result = run(args.data, args.config, args.quick, latencies)
    write_result(args.out, result, table(result))
    return 0
