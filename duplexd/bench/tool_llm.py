"""A scripted OpenAI-compatible chat completions server that calls tools: the stand-in for a remote
tool-capable model (the only boundary this machine cannot reach: the embedded SmolLM2 has no tool format).
It speaks the real streaming protocol (`stream: true`, SSE chunks with `tool_calls` deltas split across
chunks, `finish_reason: "tool_calls"`), and decides as a tool-using model would, deterministically:

- the last message is the user's and the request lists `cancel_order` and the user said "cancel": it calls
  `cancel_order`; else, if it lists `lookup_order` (or any tool, with `tool_choice: "required"`), it calls
  that, its first parameter KEY: the user's word with the most digits, else their longest (`{"order_id":
  "48213"}`): the same words give the same call, other words (a draft on half a sentence) another;
- the last message is a tool result: it answers with it ("Here is what I found. <output>");
- `tool_choice` names a function, or `prefer` a listed tool: it calls that one, the same way;
- otherwise, or with `tool_choice: "none"`: "Hello, how can I help you?".

`ttft_s` delays each response's first chunk (a remote model's time to first token). Every request body is
kept in `requests` (bounded), for tests to read.
"""

from __future__ import annotations

import json
import re
import threading
import time
import zlib
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["ScriptedToolLlm", "order_key"]

_MAX_BODY_BYTES = 1 << 20


def order_key(text: str) -> str:
    """The id the script looks up for these words: the word with the most digits, else the longest (the first
    of equals), in lowercase letters and digits."""
    words = [re.sub(r"[^a-z0-9]", "", w.lower()) for w in text.split()]
    words = [w for w in words if w]
    return max(words, key=lambda w: (sum(c.isdigit() for c in w), len(w))) if words else "none"


class ScriptedToolLlm:
    def __init__(self, *, ttft_s: float = 0.0, host: str = "127.0.0.1", port: int = 0) -> None:
        self.ttft_s = ttft_s
        self.prefer: str | None = None  # a tool it calls for every user turn, when the request lists it
        self.requests: deque[dict[str, Any]] = deque(maxlen=256)
        script = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if not self.path.endswith("/chat/completions") or not 0 < length <= _MAX_BODY_BYTES:
                    self._json(404 if length else 400, {"error": {"message": "POST /v1/chat/completions"}})
                    return
                try:
                    body = json.loads(self.rfile.read(length))
                    chunks = script.respond(body)
                except (ValueError, KeyError, TypeError) as exc:
                    self._json(400, {"error": {"message": f"bad request: {exc}"}})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                time.sleep(script.ttft_s)
                try:
                    for chunk in chunks:
                        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # (the client cancelled the reply)
                self.close_connection = True

            def _json(self, status: int, obj: object) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="scripted-llm", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> ScriptedToolLlm:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def respond(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks of the streamed response to a request (see the module docstring)."""
        self.requests.append(body)
        messages = body["messages"]
        last = messages[-1]
        tools = {t["function"]["name"]: t["function"] for t in body.get("tools") or []}
        names = list(tools)
        choice = body.get("tool_choice", "auto")
        if last["role"] == "tool":
            return _text(f"Here is what I found. {last['content']}")
        if last["role"] != "user" or choice == "none" or not names:
            return _text("Hello, how can I help you?")
        said = str(last.get("content") or "")
        if isinstance(choice, dict):  # (a named function: it must call that one)
            name = choice["function"]["name"]
        elif self.prefer in names:
            name = self.prefer
        elif "cancel_order" in names and "cancel" in said.lower():
            name = "cancel_order"
        elif "lookup_order" in names:
            name = "lookup_order"
        elif choice == "required":
            name = names[0]
        else:
            return _text("Hello, how can I help you?")
        properties = list(((tools.get(name) or {}).get("parameters") or {}).get("properties") or {})
        return _call(name, {properties[0]: order_key(said)} if properties else {})


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-scripted",
        "object": "chat.completion.chunk",
        "model": "scripted-tools",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _text(text: str) -> list[dict[str, Any]]:
    pieces = re.findall(r"\s*\S+", text)
    return [_chunk({"role": "assistant", "content": ""}), *(_chunk({"content": p}) for p in pieces), _chunk({}, "stop")]


def _call(name: str, arguments: dict[str, Any]) -> list[dict[str, Any]]:
    args = json.dumps(arguments)
    half = len(args) // 2
    call_id = f"call_{name}_{zlib.crc32(args.encode()):08x}"
    return [
        _chunk({"role": "assistant", "content": None}),
        _chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
                ]
            }
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": args[:half]}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": args[half:]}}]}),
        _chunk({}, "tool_calls"),
    ]
