"""Tools as the dialog carries them (pure): what a model may call, the calls it makes, their results, and
how they sit in a conversation's transcript.

A transcript is (role, text) turns. Besides "user" and "assistant", a tool exchange adds "tool_call" turns
(the call: its id, name and arguments, as JSON) after the assistant words that preceded it, and "tool"
turns (a result: the call's id and the output text, as JSON). `chat_messages` turns that into the
messages of OpenAI's chat completions API (an assistant message with `tool_calls`, then `tool` messages).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TOOL_ROLES",
    "ToolCall",
    "ToolEvent",
    "ToolResult",
    "ToolSpec",
    "call_key",
    "call_turn",
    "chat_messages",
    "result_turn",
]

TOOL_ROLES = ("tool_call", "tool")
MAX_ARGUMENTS_CHARS = 16 * 1024  # of one call's arguments, as streamed by the model


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool the model may call. `server`: the label of the MCP server that runs it ("": the client runs it,
    a Realtime `function` tool). `read_only`: safe to run before the user's turn is final (the MCP tool's
    `readOnlyHint`, or the configuration's allow-list)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    server: str = ""
    read_only: bool = False

    def chat(self) -> dict[str, Any]:
        """The tool as a chat completions request lists it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True, slots=True)
class ToolCall:
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    @property
    def key(self) -> str:
        return call_key(self.name, self.arguments)


@dataclass(frozen=True, slots=True)
class ToolResult:
    output: str  # the text the model reads (an error's message, when `error`)
    error: bool = False
    elapsed_s: float = 0.0  # from the call's start to its result
    done_at: float = 0.0  # `time.perf_counter()` when the result came


@dataclass(frozen=True, slots=True)
class ToolEvent:
    """What a reply did with a tool, for the client: a call it made and, for a server-side tool, its result
    (`early`: the call was started during the user's turn, by a draft, and the reply took its result)."""

    call: ToolCall
    server: str  # "" for a call the client executes
    result: ToolResult | None = None
    early: bool = False
    waited_s: float = 0.0  # how long the reply waited for the result (0: it was there when the reply needed it)


def call_key(name: str, arguments: str) -> str:
    """Equal for the same call: the tool and its arguments in a canonical JSON form (key order and
    whitespace do not matter); arguments that are not JSON count as written."""
    try:
        canonical = json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError):
        canonical = arguments
    return f"{name}\x00{canonical}"


def call_turn(call: ToolCall) -> tuple[str, str]:
    return "tool_call", json.dumps({"call_id": call.call_id, "name": call.name, "arguments": call.arguments})


def result_turn(call_id: str, output: str) -> tuple[str, str]:
    return "tool", json.dumps({"call_id": call_id, "output": output})


def check_turn(role: str, text: str) -> None:
    """Raises `ValueError` unless (role, text) is a transcript turn (see the module docstring)."""
    if role in ("user", "assistant"):
        return
    need = {"tool_call": ("call_id", "name", "arguments"), "tool": ("call_id", "output")}.get(role)
    if need is None:
        raise ValueError(f"a turn's role is 'user', 'assistant', 'tool_call' or 'tool', not {role!r}")
    try:
        d = json.loads(text)
    except ValueError:
        d = None
    if not isinstance(d, dict) or not all(isinstance(d.get(k), str) for k in need):
        raise ValueError(f"a {role!r} turn is a JSON object with string {', '.join(need)}")


def chat_messages(system: str, turns: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
    """The chat completions messages of a system prompt and a transcript's turns (see the module docstring).
    A call joins the assistant message just before it (or one of its own, with no words)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for role, text in turns:
        if role == "tool_call":
            d = json.loads(text)
            call = {
                "id": d["call_id"],
                "type": "function",
                "function": {"name": d["name"], "arguments": d["arguments"]},
            }
            last = out[-1]
            if last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if last.get("content") == "":
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif role == "tool":
            d = json.loads(text)
            out.append({"role": "tool", "tool_call_id": d["call_id"], "content": d["output"]})
        else:
            out.append({"role": role, "content": text})
    return out


def parse_streamed_calls(slots: Sequence[dict[str, str]]) -> list[ToolCall]:
    """The calls a stream's `tool_calls` deltas built up (by index), those with a name."""
    return [
        ToolCall(s["id"] or f"call_{i}", s["name"], s["arguments"] or "{}") for i, s in enumerate(slots) if s["name"]
    ]
