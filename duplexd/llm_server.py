"""`duplexd serve-llm`: the dialog engine alone, behind an OpenAI-compatible HTTP API.

    POST /v1/chat/completions   {"model", "messages", "stream", "max_tokens", ...}  (SSE when streaming)
    GET  /v1/models             the one model served
    GET  /v1/models/{id}

So a voice server on a small machine can use this engine on a bigger one (`[dialog] backend = "remote"`,
see `dialog/remote.py`), and any OpenAI client can use it. Every request is one engine session: the
`messages` are replayed into it (system prompt, user and assistant turns, as the conversation would have
left them), its reply decodes in the same batched step loop as every other request (one thread owns the
engine, as the voice server's LLM worker does), and the session is closed when the reply ends.

Decoding is greedy (the engine's only mode): `temperature` 0 (or absent), `top_p`, `seed` and `user` are
accepted and change nothing; what would change the reply and is not implemented (`temperature` > 0,
`n` > 1, tools, stop sequences, penalties, logprobs, JSON mode) is refused with an OpenAI-shaped 400.
A final assistant message is continued, as vLLM (`continue_final_message`) and llama.cpp's server do:
its text is the reply's first tokens, and only what follows is sent back. A
request without a system message gets the server's `[dialog] system_prompt`. A history longer than the
engine's KV window is read through that window (sinks + the most recent tokens), as in the voice server.

The HTTP/1.1 shell is deliberately tiny and strict: bounded head and body (`Content-Length` only, no
chunked uploads), timeouts on every read and write, one request per connection (`Connection: close`).
The parsing and the request validation are pure functions (`parse_head`, `parse_chat_request`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from duplexd.dialog.detok import ReplyText
from duplexd.dialog.engine import DialogEngine
from duplexd.errors import DuplexdError

log = logging.getLogger(__name__)

__all__ = [
    "ApiError",
    "ChatRequest",
    "HttpLimits",
    "LlmHttpServer",
    "LlmService",
    "RequestHead",
    "parse_chat_request",
    "parse_head",
]


# --- errors ---------------------------------------------------------------------------------------------


class ApiError(DuplexdError):
    """A request this server answers with an error: an HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        allow: str | None = None,
    ) -> None:
        super().__init__(message)
        self.allow = allow  # (405: the method the path takes)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# --- HTTP/1.1, the pure part -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_head_bytes: int = 16 * 1024
    max_body_bytes: int = 1024 * 1024
    head_timeout_s: float = 10.0
    """From the connection's first byte to the end of the request head."""
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    """Longest wait for a client to take a piece of the response (a client that stops reading is dropped)."""
    max_connections: int = 256

    def __post_init__(self) -> None:
        for name in ("max_head_bytes", "max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"HttpLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("head_timeout_s", "body_timeout_s", "write_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HttpLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str
    path: str  # without the query string
    headers: Mapping[str, str]  # lower-case names

    @property
    def content_length(self) -> int:
        return int(self.headers.get("content-length", "0"))


_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def parse_head(data: bytes, limits: HttpLimits) -> RequestHead:
    """The request line and headers (`data` ends with the blank line). Raises `ApiError` (400, 413, 417, 501,
    505)."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise _bad("the request head is not ASCII") from None
    lines = text.split("\r\n")
    if lines[-2:] != ["", ""]:
        raise _bad("the request head does not end with an empty line")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0] or not set(parts[0]) <= _TOKEN_CHARS or not parts[1].startswith("/"):
        raise _bad("malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise ApiError(505, f"unsupported HTTP version {version!r}", type="invalid_request_error")
    headers: dict[str, str] = {}
    for line in lines[1:-2]:
        name, sep, value = line.partition(":")
        if not sep or not name or not set(name) <= _TOKEN_CHARS:
            raise _bad("malformed header line")  # (also obsolete line folding, which starts with a space)
        name = name.lower()
        value = value.strip(" \t")
        if name in headers and name in ("content-length", "host", "authorization", "transfer-encoding"):
            raise _bad(f"repeated header {name!r}")
        headers[name] = value if name not in headers else f"{headers[name]}, {value}"
    if headers.get("expect", "100-continue").lower() != "100-continue":
        raise ApiError(417, f"unsupported expectation {headers['expect']!r}")
    if "transfer-encoding" in headers:
        raise ApiError(501, "request bodies must have a Content-Length (no Transfer-Encoding)", type="server_error")
    length = headers.get("content-length", "0")
    if not length.isdigit() or len(length) > 18:
        raise _bad("bad Content-Length")
    if int(length) > limits.max_body_bytes:
        raise ApiError(413, f"the request body is over {limits.max_body_bytes} bytes", code="request_too_large")
    return RequestHead(method, target.split("?", 1)[0], headers)


def response_head(status: int, headers: Mapping[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"]
    lines += [f"{k}: {v}" for k, v in {**headers, "Connection": "close"}.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def json_response(status: int, body: object, headers: Mapping[str, str] | None = None) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}
    return response_head(status, head) + data


# --- the chat request, the pure part -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated `/v1/chat/completions` request."""

    model: str
    system: str | None  # None: the server's system prompt
    turns: tuple[tuple[str, str], ...]  # ("user" | "assistant", text), alternating, from a user turn to one
    stream: bool
    max_tokens: int
    include_usage: bool = False
    prefix: str = ""  # a final assistant message: the reply continues it (its text is not sent back)


_IGNORED = frozenset({"user", "seed", "store", "metadata", "service_tier", "top_p", "parallel_tool_calls"})
_CHECKED = frozenset(
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "n",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "response_format",
        "continue_final_message",
        "add_generation_prompt",
    }
)


def parse_chat_request(body: bytes, *, model: str, max_tokens: int) -> ChatRequest:
    """Validate a request body for the one `model` served; `max_tokens` is the server's reply limit (a
    request may ask for fewer). Raises `ApiError` naming the offending parameter."""
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _bad("the request body is not valid JSON") from None
    if not isinstance(req, dict):
        raise _bad("the request body must be a JSON object")
    for key in req:
        if key not in _IGNORED and key not in _CHECKED:
            raise _bad(f"unrecognized request argument: {key}", param=key)
    name = req.get("model")
    if not isinstance(name, str) or not name:
        raise _bad("model must be a non-empty string", param="model")
    if name != model:
        raise ApiError(404, f"the model {name!r} does not exist (this server has {model!r})", code="model_not_found")
    _unsupported(req)
    stream = req.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream must be a boolean", param="stream")
    options = req.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(options, dict) or not set(options) <= {"include_usage"}:
            raise _bad("stream_options supports include_usage only", param="stream_options")
        include_usage = options.get("include_usage") is True
    limit = max_tokens
    for key in ("max_tokens", "max_completion_tokens"):
        value = req.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _bad(f"{key} must be an integer >= 1", param=key)
        limit = min(limit, value)
    system, turns = _messages(req.get("messages"))
    prefix = _continued(req, turns)
    if prefix is not None:
        turns = turns[:-1]
    return ChatRequest(name, system, turns, bool(stream), limit, include_usage, prefix or "")


def _unsupported(req: Mapping[str, Any]) -> None:
    """Parameters that would change the reply, refused unless they ask for what greedy decoding does."""
    temperature = req.get("temperature")
    if temperature is not None and (not isinstance(temperature, int | float) or temperature != 0):
        raise _bad("only greedy decoding is served: temperature must be 0 (or absent)", param="temperature")
    if req.get("n") not in (None, 1):
        raise _bad("n must be 1", param="n")
    for key in ("presence_penalty", "frequency_penalty"):
        if req.get(key) not in (None, 0, 0.0):
            raise _bad(f"{key} is not supported (must be 0)", param=key)
    for key in ("tools", "functions", "logit_bias", "stop"):
        if req.get(key):  # (empty lists and objects ask for nothing)
            raise _bad(f"{key} is not supported", param=key)
    for key in ("tool_choice", "function_call"):
        if req.get(key) not in (None, "none", "auto"):
            raise _bad(f"{key} is not supported", param=key)
    if req.get("logprobs") or req.get("top_logprobs"):
        raise _bad("logprobs are not supported", param="logprobs")
    fmt = req.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _bad("only the text response_format is supported", param="response_format")


def _continued(req: Mapping[str, Any], turns: tuple[tuple[str, str], ...]) -> str | None:
    """The final assistant message's text, which the reply continues (None: the turns end with the user's).
    As vLLM (`continue_final_message: true`, `add_generation_prompt: false`) and llama.cpp's server (a
    final assistant message is continued) do; only the continuation is sent back."""
    for key in ("continue_final_message", "add_generation_prompt"):
        if req.get(key) is not None and not isinstance(req.get(key), bool):
            raise _bad(f"{key} must be a boolean", param=key)
    final_assistant = turns[-1][0] == "assistant"
    if req.get("continue_final_message") and not final_assistant:
        raise _bad("continue_final_message needs a final assistant message to continue", param="messages")
    if not final_assistant:
        return None
    if req.get("continue_final_message") is False or req.get("add_generation_prompt") is True:
        raise _bad(
            "the last message must be a user message, or an assistant message to continue "
            "(continue_final_message: true, add_generation_prompt: false)",
            param="messages",
        )
    return turns[-1][1]


def _messages(messages: object) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """An optional leading system (or developer) message, then user and assistant turns alternating, from a
    user turn to a user turn (or to an assistant message to continue): the transcripts a conversation
    builds, and what the engine can replay."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty array", param="messages")
    system: str | None = None
    turns: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        param = f"messages.[{i}]"
        if not isinstance(m, dict):
            raise _bad("each message must be an object", param=param)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(f"unsupported role {role!r} (system, developer, user or assistant)", param=f"{param}.role")
        if m.get("tool_calls") or m.get("function_call") or m.get("audio"):
            raise _bad("tool calls and audio in messages are not supported", param=param)
        text = _content(m.get("content"), f"{param}.content")
        if role in ("system", "developer"):
            if i != 0:
                raise _bad("a system message is only supported as the first message", param=param)
            system = text
            continue
        expected = "assistant" if turns and turns[-1][0] == "user" else "user"
        if role != expected:
            raise _bad(f"messages must alternate user and assistant turns (expected {expected})", param=param)
        turns.append((role, text))
    if not turns:
        raise _bad("the last message must be a user message", param="messages")
    return system, tuple(turns)


def _content(content: object, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad("only text content parts are supported", param=param)
            texts.append(part["text"])
        return "".join(texts)
    raise _bad("content must be a string or an array of text parts", param=param)


# --- the step loop ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Delta:
    text: str


@dataclass(frozen=True, slots=True)
class _Finished:
    reason: str  # "stop" | "length" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0


_Event = _Delta | _Finished


@dataclass(eq=False)
class _Job:
    request: ChatRequest
    events: asyncio.Queue[_Event]  # (put on the event loop only)
    sid: int | None = None
    text: ReplyText | None = None  # the reply decoded so far (on the worker's thread)
    shown: str = ""  # the text sent so far (after the prefix, for a continued message)
    prefix_tokens: int = 0  # reply tokens that are the continued message's, not decoded
    prefix_text: str = ""  # ... as they decode
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cancelled: bool = False  # (set on the loop, read by the thread)
    finished: bool = False


class LlmService:
    """Every request's session in one engine, stepped on one thread: requests arriving together are
    decoded together (one forward per step), as the voice server's sessions are. Everything that touches
    the engine (replaying a request's messages, the step, decoding the reply) runs on that thread, a
    cycle at a time; the event loop only queues requests and takes their events.

    At most `engine.config.max_sessions` requests run at once; one more is refused at once (429), not
    queued behind the others."""

    def __init__(self, engine: DialogEngine, model: str) -> None:
        self.engine = engine
        self.model = model
        self._running: set[_Job] = set()  # (the loop's) submitted, neither finished nor cancelled
        self._lock = threading.Lock()
        self._new: list[_Job] = []  # (under the lock) submitted, not yet taken by the thread
        self._jobs: list[_Job] = []  # (the thread's) with a session in the engine
        self._events: list[tuple[_Job, _Event]] = []  # (the thread's) to put on the loop after the cycle
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duplexd-llm")
        self.stats = {"requests": 0, "refused": 0, "cancelled": 0, "failed": 0}

    @property
    def max_tokens(self) -> int:
        return self.engine.config.max_reply_tokens

    def submit(self, request: ChatRequest) -> _Job:
        # (a cancelled request's session is closed before the next new one is opened: it does not count)
        if len(self._running) >= self.engine.config.max_sessions:
            self.stats["refused"] += 1
            raise ApiError(
                429,
                f"all {self.engine.config.max_sessions} sessions of this server are in use; retry shortly",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            )
        # One delta per step at most, then the end: the queue never fills, whatever the client reads.
        job = _Job(request, asyncio.Queue(maxsize=request.max_tokens + 2))
        with self._lock:
            self._new.append(job)
        self._running.add(job)
        self.stats["requests"] += 1
        self._wake.set()
        return job

    def cancel(self, job: _Job) -> None:
        """The client is gone: free the request's session before its next step."""
        if job in self._running:
            job.cancelled = True
            self._running.discard(job)
            self.stats["cancelled"] += 1
            self._wake.set()

    def close(self) -> None:
        """Wait out a step in flight (after `run` has ended): the engine may be used again after."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def run(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while True:
                    try:
                        more = await loop.run_in_executor(self._executor, self._cycle)
                    except Exception:
                        log.exception("dialog step failed: failing every request in it")
                        await asyncio.sleep(0.1)
                        continue
                    if not more:
                        break
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)  # (a step in flight ends on its own)

    def _deliver(self, events: list[tuple[_Job, _Event]]) -> None:
        for job, event in events:
            job.events.put_nowait(event)
            if isinstance(event, _Finished):
                job.finished = True
                self._running.discard(job)

    # -- on the worker's thread -------------------------------------------------------------------

    def _cycle(self) -> bool:
        """Start new requests, free cancelled ones, then one step and its text; False: nothing to step."""
        try:
            self._apply()
            if not self.engine.busy():
                return False
            try:
                self.engine.step()
            except Exception:
                for job in list(self._jobs):
                    self._finish(job, "error")
                raise
            self._dispatch()
            return True
        finally:
            events, self._events = self._events, []
            if events:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._deliver, events)

    def _apply(self) -> None:
        """Replay new requests into sessions; close those of cancelled ones."""
        for job in [j for j in self._jobs if j.cancelled]:
            self._finish(job, "error")
        with self._lock:
            new, self._new = self._new, []
        for job in new:
            if job.cancelled:
                continue
            try:
                job.sid = self._replay(job.request)
                job.prefix_tokens = len(self.engine.reply_tokens(job.sid))
                prefix_ids = self.engine.reply_tokens(job.sid)
                job.prefix_text = self.engine.tokenizer.decode(prefix_ids, skip_special_tokens=True)
            except Exception:  # (a slot is free: `submit` counted them; anything else is the engine's bug)
                log.exception("could not start a session for a request")
                self._events.append((job, _Finished("error")))
                continue
            self._jobs.append(job)

    def _replay(self, request: ChatRequest) -> int:
        engine = self.engine
        sid = engine.open(request.system)
        try:
            for role, text in request.turns:
                if role == "user":
                    engine.append_user_text(sid, text)
                else:
                    engine.append_assistant_text(sid, text)
            engine.start_reply(sid, request.prefix)
        except BaseException:
            engine.close(sid)
            raise
        return sid

    def _dispatch(self) -> None:
        """Hand each request its reply's new text; end those whose reply is over."""
        engine = self.engine
        for job in list(self._jobs):
            assert job.sid is not None
            tokens = engine.reply_tokens(job.sid)
            if len(tokens) > job.prefix_tokens and not job.prompt_tokens:
                job.prompt_tokens = engine.tokens_seen(job.sid)  # (the first reply token is not in yet)
            if len(tokens) - job.prefix_tokens >= job.request.max_tokens:
                self._send(job, tokens[: job.prefix_tokens + job.request.max_tokens], final=True)
                self._finish(job, "length")
            elif not engine.replying(job.sid):
                self._send(job, tokens, final=True)
                self._finish(job, "length" if len(tokens) >= engine.config.max_reply_tokens else "stop")
            else:
                self._send(job, tokens, final=False)

    def _send(self, job: _Job, tokens: list[int], *, final: bool) -> None:
        if job.text is None:
            decode = self.engine.tokenizer.decode
            job.text = ReplyText(lambda ids: decode(ids, skip_special_tokens=True))
        job.text.extend(tokens[len(job.text) :])
        text = job.text.text[len(job.prefix_text) :]  # (a continued message's own text is the client's)
        if not final and text.endswith("\ufffd"):  # a character's bytes span tokens: wait for the rest
            return
        if len(text) > len(job.shown):
            self._events.append((job, _Delta(text[len(job.shown) :])))
            job.shown = text
        job.completion_tokens = len(tokens) - job.prefix_tokens

    def _finish(self, job: _Job, reason: str) -> None:
        self._jobs.remove(job)
        if job.sid is not None:
            if not job.prompt_tokens:
                job.prompt_tokens = self.engine.tokens_seen(job.sid)
            self.engine.close(job.sid)
        if reason == "error":
            self.stats["failed"] += not job.cancelled
        self._events.append((job, _Finished(reason, job.prompt_tokens, job.completion_tokens)))


# --- the HTTP shell --------------------------------------------------------------------------------------


class LlmHttpServer:
    """One request per connection; every read and write bounded in size and time."""

    def __init__(self, service: LlmService, *, api_key: str = "", limits: HttpLimits | None = None) -> None:
        self.service = service
        self.limits = limits or HttpLimits()
        self._api_key = api_key.encode()
        self._connections = 0
        self.counters = {"connections": 0, "errors": 0}

    async def run(self, host: str, port: int, stop: asyncio.Event, ready: Callable[[int], None]) -> None:
        async with asyncio.TaskGroup() as tg:
            step_loop = tg.create_task(self.service.run())
            server = await asyncio.start_server(self._connection, host, port, limit=self.limits.max_head_bytes)
            async with server:
                ready(server.sockets[0].getsockname()[1])
                await stop.wait()
                server.close()
            step_loop.cancel()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counters["connections"] += 1
        self._connections += 1
        try:
            if self._connections > self.limits.max_connections:
                raise ApiError(503, "too many connections", type="server_error", code="overloaded")
            await self._request(reader, writer)
        except ApiError as exc:
            self.counters["errors"] += 1
            with contextlib.suppress(OSError, TimeoutError):
                await self._write(writer, json_response(exc.status, exc.body(), _allow(exc)))
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the client went away or stalled: nobody to answer
        finally:
            self._connections -= 1
            writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), self.limits.write_timeout_s)

    async def _request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        limits = self.limits
        try:
            data = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), limits.head_timeout_s)
        except asyncio.LimitOverrunError:
            raise ApiError(431, f"the request head is over {limits.max_head_bytes} bytes") from None
        except TimeoutError:
            raise ApiError(408, "the request head did not arrive in time") from None
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise _bad("the connection closed inside the request head") from None
            return  # (a connection opened and closed: a port probe)
        head = parse_head(data, limits)
        if head.headers.get("expect", "").lower() == "100-continue":  # (curl, for bodies over 1 KiB)
            await self._write(writer, b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            body = await asyncio.wait_for(reader.readexactly(head.content_length), limits.body_timeout_s)
        except TimeoutError:
            raise ApiError(408, "the request body did not arrive in time") from None
        self._authorize(head)
        service = self.service
        match head.path.rstrip("/"):
            case "/v1/chat/completions":
                _require_method(head, "POST")
                request = parse_chat_request(body, model=service.model, max_tokens=service.max_tokens)
                await self._chat(request, reader, writer)
            case "/v1/models":
                _require_method(head, "GET")
                await self._write(writer, json_response(200, {"object": "list", "data": [self._model_card()]}))
            case path if path.startswith("/v1/models/"):
                _require_method(head, "GET")
                if path.removeprefix("/v1/models/") != service.model:
                    raise ApiError(404, "no such model", code="model_not_found")
                await self._write(writer, json_response(200, self._model_card()))
            case _:
                raise ApiError(404, f"no route for {head.path!r}", code="not_found")

    def _authorize(self, head: RequestHead) -> None:
        if not self._api_key:
            return
        scheme, _, key = head.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self._api_key):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.service.model, "object": "model", "created": 0, "owned_by": "duplexd"}

    async def _chat(self, request: ChatRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        job = self.service.submit(request)
        reply = _Reply(request.model)
        # The client closing its end is the only sign it has gone while nothing is written (no streaming).
        gone: asyncio.Future[bytes] = asyncio.ensure_future(reader.read(1))
        try:
            if request.stream:
                await self._write(
                    writer, response_head(200, _SSE_HEADERS) + reply.sse({"role": "assistant", "content": ""})
                )
            while True:
                event = await _next(job.events, gone)
                if event is None:
                    self.service.cancel(job)
                    return
                if isinstance(event, _Delta):
                    reply.text.append(event.text)
                    if request.stream:
                        await self._write(writer, reply.sse({"content": event.text}))
                    continue
                await self._write(writer, reply.finish(request, event))
                return
        finally:
            gone.cancel()
            self.service.cancel(job)  # (no-op once finished)

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)


_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


@dataclass(slots=True)
class _Reply:
    """One completion's OpenAI objects (chunks while streaming, the whole completion otherwise)."""

    model: str
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._object("chat.completion.chunk", [choice])

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def sse(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return _sse(self._chunk(delta, finish_reason))

    def finish(self, request: ChatRequest, end: _Finished) -> bytes:
        usage = {
            "prompt_tokens": end.prompt_tokens,
            "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
        }
        if end.reason == "error":
            error = ApiError(500, "the model failed on this request", type="server_error")
            if request.stream:  # (headers are out: the error goes in the stream, as OpenAI's does)
                return _sse(error.body())
            return json_response(500, error.body())
        if not request.stream:
            message = {"role": "assistant", "content": "".join(self.text), "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": end.reason}
            return json_response(200, {**self._object("chat.completion", [choice]), "usage": usage})
        out = self.sse({}, end.reason)
        if request.include_usage:
            out += _sse({**self._object("chat.completion.chunk", []), "usage": usage})
        return out + b"data: [DONE]\n\n"


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _next(events: asyncio.Queue[_Event], gone: asyncio.Future[bytes]) -> _Event | None:
    """The request's next event, or None once the client has closed its end (bytes sent after the request,
    which a client should not send before the answer, are not a close: they are left unread)."""
    if gone.done() and (gone.cancelled() or gone.exception() is not None or not gone.result()):
        return None
    if not events.empty():
        return events.get_nowait()
    getter = asyncio.ensure_future(events.get())
    waiting: set[asyncio.Future[Any]] = {getter}
    if not gone.done():
        waiting.add(gone)
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    if gone.cancelled() or gone.exception() is not None or not gone.result():
        return None
    return await events.get()  # (the client sent more bytes: stop watching, wait for the event)


def _require_method(head: RequestHead, method: str) -> None:
    if head.method != method:
        raise ApiError(
            405, f"{head.method} is not allowed here (use {method})", code="method_not_allowed", allow=method
        )


def _allow(exc: ApiError) -> dict[str, str]:
    return {"Allow": exc.allow} if exc.allow else {}


async def serve_llm(
    engine: DialogEngine,
    *,
    model: str,
    host: str,
    port: int,
    api_key: str = "",
    stop: asyncio.Event,
    ready: Callable[[int], None],
    limits: HttpLimits | None = None,
) -> None:
    """Serve `engine` until `stop` is set; `ready(port)` once listening."""
    service = LlmService(engine, model)
    await LlmHttpServer(service, api_key=api_key, limits=limits).run(host, port, stop, ready)
