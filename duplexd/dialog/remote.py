"""The remote dialog backend: each reply streams from an OpenAI-compatible `/v1/chat/completions` server
(vLLM, llama.cpp's server, Ollama, or `duplexd serve-llm` on a bigger machine), `[dialog] backend = "remote"`.

`RemoteDialogEngine` presents the interface the LLM worker (`scheduler/dialog.py`) and the server use from
`DialogEngine`, over a transcript instead of a KV cache: a conversation is its system prompt, its earlier
turns as messages, and the user's open turn. `start_reply` sends all of it (`stream: true`,
`temperature: 0`) and a reader thread per request collects the streamed text pieces; `step()` (on the
worker's thread, like the local engine's) waits at most `step_wait_s` for pieces and hands them out as
the reply's "tokens". Token ids are ids of those pieces in the engine's `PieceTokenizer`, whose `decode`
joins them, so `DialogWorker` decodes replies the way it decodes the local engine's.

What it cannot do, by construction:
- No bounded KV window in this process: the remote server owns its cache and context length. What this
  side keeps is bounded instead: at most `remote_history_chars` of earlier turns (the oldest go first) and
  `_MAX_TURN_CHARS` of the user's open turn are sent.
- No P(end of turn): `p_end_of_turn` is always None (`reports_p_end` False). The endpointer then reads
  the acoustic end-of-turn model alone (`turn.audio_model`): speech that sounds finished ends the turn
  after `turn.min_silence_ms`; otherwise (or without that model) it waits `turn.max_silence_ms`.
- No lossless token-level drafts; speculative listening becomes an early request instead: the
  conversation drafts at the user's pause without waiting for a P(end of turn) (`reports_p_end`), a draft
  (`fork` + `start_reply`) sends its request at once, `adopt` at the end of the turn makes that stream the
  reply (same messages, greedy: it is what the real request would return, as far as the remote server is
  deterministic), and a dropped draft's request is cancelled. The endpointer's long wait is its head
  start. A draft's `decode_limit` only holds its pieces back; the stream runs on.
- The repetition guard's token rule needs the logits, which the server keeps: only its text rules apply
  here (`guard.reply_end` on each streamed piece: the sentence limit, and the end of a reply that starts
  repeating itself, the request cancelled there). `duplexd serve-llm` applies the whole guard itself.
- `interrupt` cancels the stream (the HTTP response is closed) and keeps the heard pieces as the assistant
  message; a reply that fails (unreachable server, HTTP error, timeout, a malformed stream) ends with what
  had arrived, logged, and the conversation goes on.

Every request is bounded: `remote_timeout_s` to connect and for each next piece, `max_reply_tokens`
pieces (also sent as `max_tokens`), SSE lines of `_MAX_LINE_BYTES`, and at most `2 * max_sessions`
request threads alive at once (a cancelled request's thread ends when its socket is shut down).
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import re
import socket
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from duplexd.config import DialogConfig
from duplexd.dialog.engine import Priority, UnknownSession
from duplexd.dialog.guard import reply_end
from duplexd.dialog.kv_window import SlotTable
from duplexd.errors import EngineError
from duplexd.tools.calls import (
    MAX_ARGUMENTS_CHARS,
    TOOL_ROLES,
    ToolCall,
    ToolEvent,
    ToolSpec,
    call_turn,
    chat_messages,
    check_turn,
    parse_streamed_calls,
    result_turn,
)

if TYPE_CHECKING:
    from concurrent.futures import Future

    from duplexd.tools.calls import ToolResult
    from duplexd.tools.runner import ToolRunner

log = logging.getLogger(__name__)

__all__ = ["PieceTokenizer", "RemoteConfig", "RemoteDialogEngine"]

_MAX_LINE_BYTES = 64 * 1024  # one SSE line (one chunk's JSON)
_MAX_ERROR_BYTES = 16 * 1024  # of an error response's body, read for its message
_MAX_TURN_CHARS = 16 * 1024  # of the user's open turn (its most recent words)
_MAX_MESSAGES = 256  # earlier turns kept, whatever their length
_MAX_CALLS = 16  # tool calls one streamed message may make
_DEFAULTS = DialogConfig()


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    url: str
    """Base URL of the OpenAI-compatible API, e.g. `http://gpu-host:8001/v1`."""
    model: str
    api_key: str = field(default="", repr=False)
    max_sessions: int = 16
    max_reply_tokens: int = _DEFAULTS.max_reply_tokens
    max_reply_sentences: int = _DEFAULTS.max_reply_sentences
    """A reply ends once this many sentences are complete (0: no limit), or where it starts repeating
    itself (`guard.reply_end`, on the streamed text: the server's sampling is its own)."""
    system_prompt: str = _DEFAULTS.system_prompt
    timeout_s: float = 30.0
    history_chars: int = 4000
    step_wait_s: float = 0.02
    """Longest a `step()` waits for the next pieces (it runs on the worker's thread, not the event loop)."""

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"RemoteConfig.url must be an http(s) base URL, got {self.url!r}")
        for name in ("max_sessions", "max_reply_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"RemoteConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_reply_sentences < 0:
            raise ValueError(f"RemoteConfig.max_reply_sentences must be >= 0, got {self.max_reply_sentences}")
        if self.timeout_s <= 0 or self.step_wait_s <= 0:
            raise ValueError(f"RemoteConfig timeouts must be > 0, got {self.timeout_s}, {self.step_wait_s}")
        if self.history_chars < 0:
            raise ValueError(f"RemoteConfig.history_chars must be >= 0, got {self.history_chars}")

    @classmethod
    def from_config(cls, config: DialogConfig) -> RemoteConfig:
        return cls(
            url=config.remote_url,
            model=config.remote_model or config.model,
            api_key=config.remote_api_key,
            max_sessions=config.max_sessions,
            max_reply_tokens=config.max_reply_tokens,
            max_reply_sentences=config.max_reply_sentences,
            system_prompt=config.system_prompt,
            timeout_s=config.remote_timeout_s,
            history_chars=config.remote_history_chars,
        )

    @property
    def endpoint(self) -> str:
        """Where requests go, without any user:password in the URL (this is what logs show)."""
        parts = urllib.parse.urlsplit(self.url)
        host = parts.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if parts.port:
            netloc += f":{parts.port}"
        return f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}/chat/completions"


class PieceTokenizer:
    """Reply "tokens" of the remote engine: ids of the text pieces the server streamed. `decode` joins
    them. Pieces are forgotten with their reply, so the table holds at most one reply per session."""

    def __init__(self) -> None:
        self._pieces: dict[int, str] = {}
        self._ids = itertools.count(1)

    def add(self, text: str) -> int:
        pid = next(self._ids)
        self._pieces[pid] = text
        return pid

    def forget(self, ids: Sequence[int]) -> None:
        for pid in ids:
            self._pieces.pop(pid, None)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return "".join(self._pieces[pid] for pid in ids)

    def __len__(self) -> int:
        return len(self._pieces)


class _Stream:
    """One streaming request, read on its own thread. Pieces, the end and any error are handed over under
    the engine's condition (notified on each), which `step()` waits on."""

    def __init__(
        self, config: RemoteConfig, body: bytes, cond: threading.Condition, on_exit: Callable[[], None]
    ) -> None:
        self._config = config
        self._body = body
        self._cond = cond
        self._on_exit = on_exit
        self._sock: socket.socket | None = None
        self.pieces: deque[str] = deque()
        self.received = 0
        self.done = False
        self.error: str | None = None
        self.refused = False  # the server answered 400: it does not take this request as it is
        self.cancelled = False
        self.calls: list[dict[str, str]] = []  # tool calls the message makes, as their deltas built them up

    def start(self, name: str) -> None:
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def cancel(self) -> None:
        """Stop reading and close the connection (the server sees the client go and stops decoding)."""
        with self._cond:
            self.cancelled = True
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # unblocks the reader thread's read at once
            except OSError:
                pass

    def _run(self) -> None:
        error: str | None = None
        conn: http.client.HTTPConnection | None = None
        try:
            conn = self._connect()
            if conn is not None:
                error = self._read(conn)
        except (OSError, http.client.HTTPException, ValueError, UnicodeDecodeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if conn is not None:
                conn.close()
            with self._cond:
                self.error = None if self.cancelled else error
                self.done = True
                self._cond.notify_all()
            self._on_exit()

    def _connect(self) -> http.client.HTTPConnection | None:
        parts = urllib.parse.urlsplit(self._config.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.hostname or "", parts.port, timeout=self._config.timeout_s)
        conn.connect()
        with self._cond:
            if self.cancelled:
                conn.close()
                return None
            self._sock = conn.sock
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream", "User-Agent": "duplexd"}
        if self._config.api_key:
            headers["Authorization"] = f"Bearer {self._config.api_key}"
        path = urllib.parse.urlsplit(self._config.endpoint).path
        conn.request("POST", path, body=self._body, headers=headers)
        return conn

    def _read(self, conn: http.client.HTTPConnection) -> str | None:
        """Read the SSE stream into `pieces`; the error that ended it, or None."""
        response = conn.getresponse()
        if response.status != 200:
            self.refused = response.status == 400
            return f"HTTP {response.status}: {_error_message(response.read(_MAX_ERROR_BYTES))}"
        finished = False
        while not self.cancelled:
            line = response.readline(_MAX_LINE_BYTES + 1)
            if not line:
                return None if finished else "the stream ended before its last chunk"
            if len(line) > _MAX_LINE_BYTES:
                return f"a stream line is over {_MAX_LINE_BYTES} bytes"
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank lines between events, comments (": ping"), `event:` and `id:` fields
            data = line[5:].strip()
            if data == b"[DONE]":
                return None
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                return "a stream chunk is not a JSON object"
            if "error" in chunk:
                return f"the server failed the reply: {_error_message(data)}"
            for choice in chunk.get("choices") or []:  # (a usage chunk has none)
                delta = choice.get("delta") or {}
                text = delta.get("content")
                if isinstance(text, str) and text:
                    self._push(text)
                for call in delta.get("tool_calls") or []:
                    self._call_delta(call)
                finished = finished or choice.get("finish_reason") is not None
            if self.received >= self._config.max_reply_tokens:
                return None  # (the reply is as long as it may be: stop reading)
        return None

    def _call_delta(self, delta: object) -> None:
        """One `tool_calls` delta: a call's id and name (its first), then pieces of its arguments."""
        if not isinstance(delta, dict):
            raise ValueError("a tool_calls delta is not a JSON object")
        index = delta.get("index", max(0, len(self.calls) - 1))
        if not isinstance(index, int) or not 0 <= index < _MAX_CALLS:
            raise ValueError(f"a tool call's index must be an integer in [0, {_MAX_CALLS})")
        function = delta.get("function") or {}
        with self._cond:
            while len(self.calls) <= index:
                self.calls.append({"id": "", "name": "", "arguments": ""})
            slot = self.calls[index]
            if isinstance(delta.get("id"), str):
                slot["id"] = delta["id"]
            if isinstance(function.get("name"), str) and function["name"]:
                slot["name"] = function["name"]
            if isinstance(function.get("arguments"), str):
                slot["arguments"] += function["arguments"]
                if len(slot["arguments"]) > MAX_ARGUMENTS_CHARS:
                    raise ValueError(f"a tool call's arguments are over {MAX_ARGUMENTS_CHARS} characters")

    def _push(self, text: str) -> None:
        with self._cond:
            if not self.cancelled:
                self.pieces.append(text)
                self.received += 1
                self._cond.notify_all()


def _error_message(body: bytes) -> str:
    """An OpenAI-shaped error's message, else the start of the body (never the request's headers)."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str):
            return message[:500]
    except (ValueError, AttributeError):
        pass
    return body[:200].decode("utf-8", "replace")


@dataclass(eq=False)
class _Conversation:
    id: int
    slot: int  # of `RemoteDialogEngine.pool`: a conversation held, not KV rows (the remote server has those)
    system: str
    priority: Priority
    decode_limit: int | None = None
    reply_cap: int = 0  # a reply ends after this many pieces (given at `open`, copied by `fork`)
    sentence_cap: int = 0  # ... or this many sentences (0: no limit; given at `open`, copied by `fork`)
    history: deque[tuple[str, str]] = field(default_factory=deque)  # finished (role, text) turns, alternating
    user_text: str = ""
    user_open: bool = False
    replying: bool = False
    reply: list[int] = field(default_factory=list)  # piece ids
    reply_done: bool = False  # the reply is the last message, whole, and nothing followed it yet
    prefix: str = ""  # the reply's given first words, which its request asks the server to continue
    stream: _Stream | None = None
    root: int = 0  # the conversation a draft was forked from (the one its early tool results are kept for)
    tools: tuple[ToolSpec, ...] = ()  # the client's own (Realtime `function` tools), besides the server's
    tool_choice: str | dict[str, Any] = "auto"  # (as chat completions takes it)
    tools_version: int = 0
    segment: list[tuple[str, str]] = field(default_factory=list)  # the reply's tool exchange so far (turns)
    said: int = 0  # reply pieces whose words are in `segment` already
    calls_made: int = 0  # by this reply, in all its rounds
    waiting: list[_Waiting] = field(default_factory=list)  # server-side calls whose results it waits for
    client_calls: list[ToolCall] = field(default_factory=list)  # ... and calls the client will run
    tool_events: list[ToolEvent] = field(default_factory=list)  # not yet taken by the worker
    early_taken: list[ToolCall] = field(default_factory=list)  # a draft's: early results its reply read
    tools_sent: bool = False  # its request in flight lists tools


@dataclass(eq=False, slots=True)
class _Waiting:
    call: ToolCall
    spec: ToolSpec  # the server-side tool
    future: Future[ToolResult] | None  # None: held (a draft's call that may not run before the turn is final)
    early: bool  # started by a draft, during the user's turn
    needed_at: float | None = None  # (`time.perf_counter()`) when the reply, not a draft, first waited for it


class RemoteDialogEngine:
    """`DialogEngine`'s interface over a remote OpenAI-compatible server (see the module docstring).

    Not thread-safe, like the local engine: one worker calls it, `step()` on its thread. Only the request
    threads run beside it, and they touch nothing but their `_Stream`, under `self._cond`."""

    reports_p_end = False  # the conversation drafts at the pause without it (an early request)
    tuning = None  # (the remote server computes: nothing measured here)
    continues: bool | None = None  # the server continues a given reply prefix (None: not asked yet)
    takes_tools = True  # its transcript holds tool calls and results (`tools.calls`), sent as chat messages

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.tokenizer = PieceTokenizer()
        self.pool = SlotTable(config.max_sessions, "dialog session")
        self._sessions: dict[int, _Conversation] = {}
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._threads = 0  # request threads alive (cancelled ones included, until their socket closes)
        self.runner: ToolRunner | None = None  # the server-side tools (`attach_tools`)
        self.tools_refused = False  # the server answered 400 to a request with tools: none are sent again
        self.stats: dict[str, float] = {
            "steps": 0,  # polls for pieces (up to 50 a second while a reply streams)
            "decode_tokens": 0,  # pieces handed out
            "busy_s": 0.0,  # time spent handing them out (not waiting)
            "requests": 0,
            "failed": 0,
            "cancelled": 0,
        }
        # (the local engine's step timings for /metrics; a remote step's time is mostly waiting: none here)
        self.step_samples: deque[tuple[float, int, int]] = deque(maxlen=1)

    @classmethod
    def from_config(cls, config: DialogConfig) -> RemoteDialogEngine:
        engine = cls(RemoteConfig.from_config(config))
        log.info("dialog LLM: %s at %s (remote, streamed)", engine.config.model, engine.config.endpoint)
        return engine

    # --- sessions -------------------------------------------------------------------------------------

    def open(
        self,
        system_prompt: str | None = None,
        *,
        priority: Priority = Priority.NORMAL,
        max_reply_tokens: int | None = None,
        max_reply_sentences: int | None = None,
    ) -> int:
        """Start a conversation. Raises `PoolFull` when `max_sessions` are open. `max_reply_tokens`,
        `max_reply_sentences` (0: none): this conversation's reply limits, in pieces and sentences (None:
        those of the configuration)."""
        slot = self.pool.allocate()
        system = self.config.system_prompt if system_prompt is None else system_prompt
        conv = _Conversation(
            next(self._ids),
            slot,
            system,
            priority,
            reply_cap=max_reply_tokens or self.config.max_reply_tokens,
            sentence_cap=self.config.max_reply_sentences if max_reply_sentences is None else max_reply_sentences,
        )
        conv.root = conv.id
        self._sessions[conv.id] = conv
        return conv.id

    def attach_tools(self, runner: ToolRunner) -> None:
        """Server-side tools: every conversation's model may call them, and duplexd runs them (`runner`)."""
        self.runner = runner

    def set_tools(self, sid: int, tools: Sequence[ToolSpec], tool_choice: str | dict[str, Any] = "auto") -> None:
        """The client's own tools for this conversation (it runs their calls), from its next request on."""
        c = self._get(sid)
        c.tools, c.tool_choice = tuple(tools), tool_choice
        c.tools_version += 1

    def take_tool_events(self, sid: int) -> list[ToolEvent]:
        """The tool calls the conversation's reply made since the last take (server-side ones with their
        results), for the client."""
        c = self._get(sid)
        events, c.tool_events = c.tool_events, []
        return events

    def close(self, sid: int) -> None:
        conv = self._get(sid)
        self._cancel(conv)
        self._drop_calls(conv)
        if conv.priority is Priority.NORMAL and self.runner is not None:
            self.runner.end_turn(conv.id)
        self.tokenizer.forget(conv.reply)
        del self._sessions[sid]
        self.pool.release(conv.slot)

    def fork(self, sid: int, *, priority: Priority = Priority.DRAFT, decode_limit: int | None = None) -> int:
        """A copy of a conversation that is not replying (a draft). Raises `PoolFull`, or `EngineError`
        while `sid` replies (a stream cannot be shared)."""
        parent = self._get(sid)
        if parent.replying:
            raise EngineError(f"remote dialog session {sid} is replying: it cannot be forked")
        slot = self.pool.allocate()
        child = _Conversation(
            next(self._ids),
            slot,
            parent.system,
            priority,
            decode_limit=decode_limit,
            reply_cap=parent.reply_cap,
            sentence_cap=parent.sentence_cap,
            history=deque(parent.history),
            user_text=parent.user_text,
            user_open=parent.user_open,
            root=parent.root,
            tools=parent.tools,
            tool_choice=parent.tool_choice,
            tools_version=parent.tools_version,
        )
        self._sessions[child.id] = child
        return child.id

    def adopt(self, sid: int, draft: int) -> None:
        """Session `sid` continues as `draft`: its transcript and its reply, whose request is in flight
        (or done). `draft` is gone after."""
        if draft == sid:
            raise ValueError("a session cannot adopt itself")
        parent, child = self._get(sid), self._get(draft)
        self._cancel(parent)
        self.tokenizer.forget(parent.reply)
        del self._sessions[draft]
        self.pool.release(parent.slot)
        child.id, child.priority, child.decode_limit = sid, parent.priority, None
        self._sessions[sid] = child
        if self.runner is not None:  # (the early results the draft read are this reply's now)
            for call in child.early_taken:
                self.runner.claim(child.root, call)
        child.early_taken = []

    def state_key(self, sid: int) -> int:
        """Equal keys: equal transcripts, so equal requests (and, greedy, equal replies)."""
        c = self._get(sid)
        return hash((c.system, tuple(c.history), c.user_open, c.user_text, c.replying, c.tools_version))

    def steps_to_reply(self, sid: int) -> int:
        c = self._get(sid)
        return 0 if c.reply or c.replying else 1

    def parked(self, sid: int) -> bool:
        c = self._get(sid)
        return c.decode_limit is not None and (not c.replying or _at_limit(c))

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    @property
    def free_slots(self) -> int:
        return self.pool.free

    def replying(self, sid: int) -> bool:
        return self._get(sid).replying

    def reply_tokens(self, sid: int) -> list[int]:
        return list(self._get(sid).reply)

    def busy(self, *, drafts: bool = True) -> bool:
        """Work to step; `drafts` False: the conversations' own, and a draft's tool calls due to start (a read-
        only call starts early only if a step takes it, and a step costs nothing here: the worker, yielding
        drafts to the recognizer, steps for it)."""
        return any(
            _has_work(c) and (drafts or c.priority is Priority.NORMAL or _calls_due(c)) for c in self._sessions.values()
        )

    def history(self, sid: int) -> list[dict[str, str]]:
        """The messages the next request of this conversation would send, system first."""
        c = self._get(sid)
        turns = [*c.history, ("user", c.user_text)] if c.user_open else list(c.history)
        return chat_messages(c.system, turns)

    # --- the duplex API -------------------------------------------------------------------------------

    def append_user_text(self, sid: int, text: str) -> None:
        """User words (with their leading space, as for the local engine); during a reply they open the
        next user turn."""
        c = self._get(sid)
        if not text:
            return
        c.user_text = (c.user_text + text)[-_MAX_TURN_CHARS:]
        c.user_open = True
        c.reply_done = False

    def retract_user_text(self, sid: int, texts: Sequence[str]) -> bool:
        """Take back the open user turn's last appends, exactly `texts` (see `DialogEngine.retract_user_text`);
        False, and nothing changed, where the turn does not end with them."""
        c = self._get(sid)
        text = "".join(texts)
        if not text or c.replying or not c.user_open or not c.user_text.endswith(text):
            return False
        c.user_text = c.user_text[: len(c.user_text) - len(text)]
        return True

    def p_end_of_turn(self, sid: int) -> float | None:
        """Always None: a chat completions API gives no P(end of the user's turn)."""
        self._get(sid)
        return None

    def start_reply(self, sid: int, prefix: str = "") -> None:
        """Close the user's turn (an empty one if none is open) and send the request. `prefix`: the reply's
        first words, given (its first pieces, one a word); the server is asked to continue them (the final
        assistant message, `continue_final_message`). A server that refuses that (`continues` turns
        False, logged once) is asked again without them, and the reply is its own from the start."""
        c = self._get(sid)
        if c.replying:
            return
        self.tokenizer.forget(c.reply)
        c.reply, c.reply_done = [], False
        _new_reply(c)
        if c.user_open or not c.history or c.history[-1][0] != "tool":  # (after tool results: no user turn)
            c.history.append(("user", c.user_text))
        c.user_text, c.user_open = "", False
        _trim(c.history, self.config.history_chars)
        c.replying = True
        c.prefix = prefix if self.continues is not False else ""
        c.reply = [self.tokenizer.add(word) for word in _words(c.prefix)]
        c.stream = self._request(c)

    def restart_reply(self, sid: int, prefix: str) -> bool:
        """Ask for the reply to the same turn again, continuing `prefix` (as `start_reply` does): the request
        in flight is cancelled, or the reply it brought is taken back. For the relay, whose remote request
        went out before its prefix was known, and none of whose pieces were handed out. False (nothing
        done) once the user has spoken after a reply that ended: that reply is the one to keep."""
        c = self._get(sid)
        if c.replying:
            self._cancel(c)
            self.stats["cancelled"] += 1
        elif c.user_open or not c.history or c.history[-1][0] != "assistant":
            return False
        else:
            c.history.pop()
        self._drop_calls(c)
        _new_reply(c)
        self.tokenizer.forget(c.reply)
        c.replying, c.reply_done = True, False
        c.prefix = prefix if self.continues is not False else ""
        c.reply = [self.tokenizer.add(word) for word in _words(c.prefix)]
        c.stream = self._request(c)
        return True

    def rewrite(
        self, sid: int, system_prompt: str | None, turns: Sequence[tuple[str, str]], open_user: str = ""
    ) -> None:
        """Replace the conversation's transcript (see `DialogEngine.rewrite`): the next request sends
        `system_prompt` (None: the configured one), `turns` (consecutive turns of one role joined) and the
        open user turn's words. Raises `EngineError` while the session replies."""
        c = self._get(sid)
        if c.replying:
            raise EngineError(f"remote dialog session {sid} is replying: its context cannot be rewritten now")
        for role, text in turns:
            check_turn(role, text)
        history: deque[tuple[str, str]] = deque()
        for role, text in turns:
            if history and history[-1][0] == role and role not in TOOL_ROLES:
                history[-1] = (role, f"{history[-1][1]} {text}".strip())
            else:
                history.append((role, text))
        if history and history[0][0] == "assistant":
            history.appendleft(("user", ""))
        words = open_user.strip()
        if history and history[-1][0] == "user":  # (the last user turn is still open: the reply answers it)
            words = f"{history.pop()[1]} {words}".strip()
        _trim(history, self.config.history_chars)
        c.system = self.config.system_prompt if system_prompt is None else system_prompt
        c.history = history
        self.tokenizer.forget(c.reply)
        c.reply, c.reply_done = [], False
        _new_reply(c)
        c.user_text, c.user_open = words[-_MAX_TURN_CHARS:], bool(words)

    def interrupt(self, sid: int, heard_tokens: int) -> None:
        """Stop the reply (its request is cancelled); only its first `heard_tokens` pieces stay in the
        transcript. Also cuts a reply already finished, also when the user's words followed it."""
        c = self._get(sid)
        last_is_reply = bool(c.history) and c.history[-1][0] == "assistant"
        if not (c.replying or (c.reply and last_is_reply and (c.reply_done or c.user_open))):
            return
        heard = max(0, min(heard_tokens, len(c.reply)))
        if not c.replying and heard == len(c.reply):
            return  # all of it was heard: nothing to cut
        if c.replying:
            self._cancel(c)
            self.stats["cancelled"] += 1
        else:
            c.history.pop()  # the whole reply, replaced by what was heard
        self.tokenizer.forget(c.reply[heard:])
        del c.reply[heard:]
        self._end_reply(c)

    def withdraw_reply(self, sid: int) -> bool:
        """Take the reply back whole, and the close of the user's turn it answered: that turn is open again
        and the user's next words continue it (see `DialogEngine.withdraw_reply`). False, and nothing
        changed, for a reply that made tool calls or once the user's words followed a finished reply."""
        c = self._get(sid)
        if c.segment or c.client_calls or c.calls_made or c.user_open:
            return False
        history = list(c.history)
        if not c.replying:
            if not (c.reply_done and history and history[-1][0] == "assistant"):
                return False
            history.pop()
        if not history or history[-1][0] != "user":
            return False
        if c.replying:
            self._cancel(c)
            self.stats["cancelled"] += 1
        self._drop_calls(c)
        self.tokenizer.forget(c.reply)
        c.reply, c.reply_done, c.replying, c.prefix = [], False, False, ""
        _new_reply(c)
        c.history = deque(history[:-1])
        c.user_text, c.user_open = history[-1][1], True
        return True

    # --- the step -------------------------------------------------------------------------------------

    def step(self, *, wait: bool = True) -> dict[int, list[int]]:
        """The pieces that arrived since the last step (waiting up to `step_wait_s` for some, if `wait`: the
        relay's local model, with work of its own, does not)."""
        live = [c for c in self._sessions.values() if _has_work(c)]
        if not live:
            return {}
        out: dict[int, list[int]] = {}
        with self._cond:
            if wait and not any(_ready(c) for c in live):
                self._cond.wait(self.config.step_wait_s)
            t0 = time.perf_counter()
            for c in live:
                new = self._take(c)
                if new:
                    out[c.id] = new
        self.stats["steps"] += 1
        self.stats["decode_tokens"] += sum(len(v) for v in out.values())
        self.stats["busy_s"] += time.perf_counter() - t0
        return out

    def _take(self, c: _Conversation) -> list[int]:
        if c.waiting or c.client_calls:
            self._tool_round(c)
            return []
        stream = c.stream
        if stream is None:  # (a request refused before it went out)
            self._end_reply(c)
            return []
        new: list[int] = []
        ended = False
        if c.prefix and stream.received:
            self.continues = True
        while stream.pieces and not _at_limit(c) and len(c.reply) < c.reply_cap:
            piece = stream.pieces.popleft()
            before = self.tokenizer.decode(c.reply)
            keep = reply_end(before, before + piece, c.sentence_cap)
            if keep is not None:  # (a piece is text: it can be cut where the reply ends)
                piece, ended = piece[: max(keep - len(before), 0)], True
            if piece:
                pid = self.tokenizer.add(piece)
                c.reply.append(pid)
                new.append(pid)
            if ended:
                break
        if ended or len(c.reply) >= c.reply_cap:
            self._cancel(c)
            self._end_reply(c)
        elif stream.done and not stream.pieces and c.prefix and stream.refused and stream.received == 0:
            self._refused_continuation(c)
        elif stream.done and not stream.pieces and c.tools_sent and stream.refused and stream.received == 0:
            self._refused_tools(c)
        elif stream.done and not stream.pieces and stream.error is None and stream.calls:
            self._calls(c, parse_streamed_calls(stream.calls))
        elif stream.done and not stream.pieces:
            if stream.error is not None:
                self.stats["failed"] += 1
                log.error(
                    "remote LLM reply failed (session %d, %s, %d pieces): %s",
                    c.id,
                    self.config.endpoint,
                    len(c.reply),
                    stream.error,
                )
            c.stream = None
            self._end_reply(c)
        return new

    def _request(self, c: _Conversation) -> _Stream | None:
        messages = chat_messages(c.system, [*c.history, *c.segment])
        if c.prefix and not c.segment:
            messages.append({"role": "assistant", "content": c.prefix})
        body: dict[str, object] = {
            "model": self.config.model,
            "messages": messages,
            "stream": True,
            "temperature": 0,
            "max_tokens": max(1, c.reply_cap - len(c.reply)),
        }
        if c.prefix and not c.segment:  # (vLLM's names; llama.cpp's server continues a final assistant message)
            body |= {"continue_final_message": True, "add_generation_prompt": False}
        tools = _offered(c, self.runner)
        c.tools_sent = bool(tools) and not self.tools_refused
        if c.tools_sent:
            body["tools"] = [t.chat() for t in tools]
            if c.tool_choice != "auto":
                body["tool_choice"] = c.tool_choice
        with self._cond:
            if self._threads >= 2 * self.config.max_sessions:
                self.stats["failed"] += 1
                log.error("remote LLM: %d requests still in flight, reply of session %d refused", self._threads, c.id)
                return None
            self._threads += 1
        stream = _Stream(self.config, json.dumps(body).encode(), self._cond, self._thread_exited)
        self.stats["requests"] += 1
        stream.start(f"duplexd-remote-llm-{c.id}")
        return stream

    def _refused_continuation(self, c: _Conversation) -> None:
        """The server refused to continue the prefix (HTTP 400): ask again without it, and never again."""
        if self.continues is not False:
            log.warning(
                "remote LLM at %s does not continue a final assistant message (%s): replies start there",
                self.config.endpoint,
                c.stream.error if c.stream is not None else "",
            )
        self.continues = False
        self.tokenizer.forget(c.reply)
        c.reply, c.prefix = [], ""
        c.stream = self._request(c)

    def _refused_tools(self, c: _Conversation) -> None:
        """The server refused a request with tools (HTTP 400; e.g. vLLM without a tool parser, or `duplexd
        serve-llm` with a model that has no tool format): ask again without them, and never send them again."""
        log.warning(
            "remote LLM at %s does not take tools (%s): replies go on without them",
            self.config.endpoint,
            c.stream.error if c.stream is not None else "",
        )
        self.tools_refused = True
        c.stream = self._request(c)

    # --- tools ----------------------------------------------------------------------------------------

    def _calls(self, c: _Conversation, calls: list[ToolCall]) -> None:
        """The model's message ended with tool calls: the words before them and the calls join the reply's
        exchange; the server's tools are called (a draft's only when they may run before the turn is
        final), and the client's end the reply (it runs them)."""
        c.stream = None
        c.segment.append(("assistant", self.tokenizer.decode(c.reply[c.said :])))
        c.said = len(c.reply)
        c.segment.extend(call_turn(call) for call in calls)
        runner = self.runner
        for call in calls:
            spec = _server_tool(c, runner, call.name)
            if spec is None or runner is None:
                c.client_calls.append(call)
                continue
            c.calls_made += 1
            if c.calls_made > runner.config.max_calls_per_turn:
                future = runner.refuse(f"No more than {runner.config.max_calls_per_turn} tool calls in a turn.")
                c.waiting.append(_Waiting(call, spec, future, False))
                continue
            early = c.priority is not Priority.NORMAL
            future, cached = runner.start(c.root, call, early=early, spec=spec)
            c.waiting.append(_Waiting(call, spec, future, cached or early))
            if future is not None:
                future.add_done_callback(self._tool_done)
        self._tool_round(c)

    def _tool_done(self, _future: object) -> None:
        with self._cond:
            self._cond.notify_all()

    def _tool_round(self, c: _Conversation) -> None:
        """Once every server-side call has its result: the results join the exchange and the model is asked
        to go on from them; or, where the client runs calls too, the reply ends with those."""
        runner = self.runner
        if runner is not None and c.priority is Priority.NORMAL:
            now = time.perf_counter()
            for w in c.waiting:
                if w.needed_at is None:
                    w.needed_at = now
                if w.future is None:  # a draft's held call: the turn is final now (the draft was adopted)
                    w.future, cached = runner.start(c.root, w.call, early=False, spec=w.spec)
                    w.early = cached
                    w.future.add_done_callback(self._tool_done)
                elif w.early:
                    runner.claim(c.root, w.call)
        if not all(w.future is not None and w.future.done() for w in c.waiting):
            return
        for w in c.waiting:
            assert w.future is not None
            result = w.future.result()
            c.segment.append(result_turn(w.call.call_id, result.output))
            waited = 0.0 if w.needed_at is None else max(0.0, result.done_at - w.needed_at)
            if w.early and c.priority is not Priority.NORMAL:
                c.early_taken.append(w.call)
            c.tool_events.append(ToolEvent(w.call, w.spec.server, result, w.early, waited))
        c.waiting = []
        if c.client_calls:
            c.tool_events.extend(ToolEvent(call, "") for call in c.client_calls)
            self._end_reply(c)
        else:
            c.stream = self._request(c)

    def _drop_calls(self, c: _Conversation) -> None:
        """The reply's calls in flight are not waited for any more (an early one stays in the runner's
        cache, for the conversation's reply)."""
        for w in c.waiting:
            if w.future is not None and not w.early and not w.future.done():
                w.future.cancel()
        c.waiting, c.client_calls = [], []

    def _thread_exited(self) -> None:
        with self._cond:
            self._threads -= 1

    def _cancel(self, c: _Conversation) -> None:
        if c.stream is not None:
            c.stream.cancel()
            c.stream = None

    def _end_reply(self, c: _Conversation) -> None:
        """The reply is over: it becomes the transcript's assistant message (after its tool exchange, if it
        had one; a reply that ended with the client's calls ends there, their results to come)."""
        ended_on_calls = bool(c.client_calls) or bool(c.segment and c.segment[-1][0] == "tool_call")
        c.replying = False
        c.stream = None
        self._drop_calls(c)
        c.history.extend(c.segment)
        c.segment = []
        if not ended_on_calls or c.said < len(c.reply):
            c.history.append(("assistant", self.tokenizer.decode(c.reply[c.said :])))
        c.reply_done = not c.user_open  # (words that came during the reply follow it already)
        _trim(c.history, self.config.history_chars)
        if c.priority is Priority.NORMAL and self.runner is not None:
            self.runner.end_turn(c.id)  # (early results no reply took are wasted)

    def _get(self, sid: int) -> _Conversation:
        try:
            return self._sessions[sid]
        except KeyError:
            raise UnknownSession(f"no dialog session {sid}") from None


class RemoteFront:
    """An engine in front of a `RemoteDialogEngine` (`turn_scorer.TurnScoredEngine`,
    `relay.RelayDialogEngine`): the transcript, the replies' pieces and all it does not override are the
    remote engine's."""

    def __init__(self, remote: RemoteDialogEngine) -> None:
        self.remote = remote

    @property
    def config(self) -> RemoteConfig:  # (its model is the one named in /healthz)
        return self.remote.config

    @property
    def tokenizer(self) -> PieceTokenizer:
        return self.remote.tokenizer

    @property
    def pool(self) -> SlotTable:
        return self.remote.pool

    @property
    def stats(self) -> dict[str, float]:
        return self.remote.stats

    @property
    def step_samples(self) -> deque[tuple[float, int, int]]:
        return self.remote.step_samples

    @property
    def tuning(self) -> dict[str, object] | None:
        return self.remote.tuning

    def __getattr__(self, name: str) -> object:  # (the rest of the remote engine's own API: `history`, ...)
        return getattr(self.remote, name)

    def fork(self, sid: int, *, priority: Priority = Priority.DRAFT, decode_limit: int | None = None) -> int:
        return self.remote.fork(sid, priority=priority, decode_limit=decode_limit)

    def state_key(self, sid: int) -> int:
        return self.remote.state_key(sid)

    def steps_to_reply(self, sid: int) -> int:
        return self.remote.steps_to_reply(sid)

    def parked(self, sid: int) -> bool:
        return self.remote.parked(sid)

    def replying(self, sid: int) -> bool:
        return self.remote.replying(sid)

    def reply_tokens(self, sid: int) -> list[int]:
        return self.remote.reply_tokens(sid)

    def interrupt(self, sid: int, heard_tokens: int) -> None:
        self.remote.interrupt(sid, heard_tokens)

    def withdraw_reply(self, sid: int) -> bool:
        return self.remote.withdraw_reply(sid)


def _words(text: str) -> list[str]:
    """`text` in pieces of one word each, with its leading space ("Paris is" -> "Paris", " is")."""
    pieces = re.findall(r"\s*\S+", text)
    tail = text[len("".join(pieces)) :]  # (trailing spaces: with the last word)
    return [*pieces[:-1], pieces[-1] + tail] if pieces else [tail] if tail else []


def _offered(c: _Conversation, runner: ToolRunner | None) -> list[ToolSpec]:
    """The tools the model is given: the configured servers', then the conversation's own (a Realtime
    session's functions and MCP tools) but for a name the configured ones have."""
    configured = runner.specs if runner is not None else []
    named = {t.name for t in configured}
    return [*configured, *(t for t in c.tools if t.name not in named)]


def _server_tool(c: _Conversation, runner: ToolRunner | None, name: str) -> ToolSpec | None:
    """The server-side tool `name` among those offered; None: the client runs it."""
    return next((t for t in _offered(c, runner) if t.name == name and t.server), None)


def _new_reply(c: _Conversation) -> None:
    c.segment, c.said, c.calls_made, c.tool_events, c.early_taken = [], 0, 0, [], []


def _has_work(c: _Conversation) -> bool:
    return c.replying and not _at_limit(c) and not _held(c)


def _calls_due(c: _Conversation) -> bool:
    stream = c.stream
    return stream is not None and stream.done and bool(stream.calls) and not stream.pieces


def _held(c: _Conversation) -> bool:
    """A draft that waits for the turn to be final before its tool calls may run."""
    return c.priority is not Priority.NORMAL and any(w.future is None for w in c.waiting)


def _ready(c: _Conversation) -> bool:
    """`step()` has something to hand out or do for `c` now."""
    if c.waiting:
        return all(w.future is not None and w.future.done() for w in c.waiting) or c.priority is Priority.NORMAL
    return c.stream is None or bool(c.stream.pieces) or c.stream.done


def _at_limit(c: _Conversation) -> bool:
    return c.decode_limit is not None and len(c.reply) >= c.decode_limit


def _trim(history: deque[tuple[str, str]], max_chars: int) -> None:
    """Drop the oldest turns, a user turn and the reply to it at a time, while the turns before the last two
    are over `max_chars` (or there are more than `_MAX_MESSAGES`: empty turns count too). The latest user
    turn always stays, and the transcript still starts with one."""
    while len(history) > 2 and (len(history) > _MAX_MESSAGES or sum(len(t) for _, t in list(history)[:-2]) > max_chars):
        history.popleft()
        while len(history) > 1 and history[0][0] != "user":  # (its reply, and any tool exchange in it)
            history.popleft()
