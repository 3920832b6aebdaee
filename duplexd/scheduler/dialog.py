"""The LLM worker: one task owns the dialog engine; everything that touches it runs on one thread.

The engine is not thread-safe, so sessions never call it directly: they queue commands. The worker's
thread applies them between steps (tokenizing, forking a KV slot, cutting a window: none of it on the
event loop), runs the next step, decodes the new reply text incrementally (`dialog/detok.py`) and hands
each session its text and P(end of turn) back on the loop.

Speculative listening lives here too: `DraftReply` forks the conversation into a draft (a low-priority
engine session, see `dialog/speculation.py`); `StartReply` adopts the draft made for exactly the
conversation's state, or starts the reply from scratch on a miss. A hit's tokens go out as the command
arrives, not after the step in flight (often the draft's own next token): after each step the thread
publishes, for each conversation between replies, the text of the draft made for its state (`_Ready`), so
the loop can tell a hit without the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Protocol

from duplexd.aio import wait_set
from duplexd.commands import (
    AppendUserText,
    DraftReply,
    InterruptReply,
    ReplaceContext,
    RetractUserText,
    SetTools,
    StartReply,
)
from duplexd.config import SpeculationConfig
from duplexd.dialog.detok import ReplyText
from duplexd.dialog.engine import Priority
from duplexd.dialog.kv_window import PoolFull
from duplexd.dialog.speculation import Draft, HypothesisPool
from duplexd.errors import Overloaded
from duplexd.tools.calls import TOOL_ROLES

log = logging.getLogger(__name__)

_YIELD_POLL_S = 0.01
_DRAFT_SHOWN_AT = 6  # reply tokens: a first spoken piece (two words, or a short clause) is in them

DialogCommand = AppendUserText | RetractUserText | StartReply | DraftReply | InterruptReply | ReplaceContext | SetTools


class ModelNamed(Protocol):
    """An engine's configuration, as far as the worker and the server read it."""

    @property
    def model(self) -> str: ...


class TokenDecoder(Protocol):
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...


class Slots(Protocol):
    """Conversations an engine can hold (`kv_window.SlotTable`, or the `KvPool` behind one)."""

    @property
    def slots(self) -> int: ...
    @property
    def free(self) -> int: ...


class LlmEngine(Protocol):
    """What the worker and the server use of a dialog engine: `DialogEngine` (in process, the KV window,
    lossless drafts) and `dialog.remote.RemoteDialogEngine` (an OpenAI-compatible server) both provide it.
    Not thread-safe: one worker calls it, `step()` on the worker's thread."""

    @property
    def config(self) -> ModelNamed: ...
    @property
    def tokenizer(self) -> TokenDecoder: ...  # reply token ids -> text
    @property
    def pool(self) -> Slots: ...

    stats: dict[str, float]
    step_samples: deque[tuple[float, int, int]]  # (seconds, sessions, tokens) per step, for /metrics
    reports_p_end: bool  # p_end_of_turn gives a probability (else drafts go at the pause: early requests)
    tuning: dict[str, object] | None  # how it computes on this machine (dtype, decode kernel), for /healthz

    def open(
        self,
        system_prompt: str | None = None,
        *,
        priority: Priority = Priority.NORMAL,
        max_reply_tokens: int | None = None,
        max_reply_sentences: int | None = None,
    ) -> int: ...
    def close(self, sid: int) -> None: ...
    def fork(self, sid: int, *, priority: Priority = Priority.DRAFT, decode_limit: int | None = None) -> int: ...
    def adopt(self, sid: int, draft: int) -> None: ...
    def state_key(self, sid: int) -> int: ...
    def steps_to_reply(self, sid: int) -> int: ...
    def parked(self, sid: int) -> bool: ...
    def replying(self, sid: int) -> bool: ...
    def reply_tokens(self, sid: int) -> list[int]: ...
    def busy(self, *, drafts: bool = True) -> bool: ...
    def append_user_text(self, sid: int, text: str) -> None: ...
    def retract_user_text(self, sid: int, texts: Sequence[str]) -> bool: ...
    def p_end_of_turn(self, sid: int) -> float | None: ...
    def start_reply(self, sid: int, prefix: str = "") -> None: ...  # prefix: the reply's given first words
    def interrupt(self, sid: int, heard_tokens: int) -> None: ...
    def withdraw_reply(self, sid: int) -> bool: ...
    def rewrite(
        self, sid: int, system_prompt: str | None, turns: Sequence[tuple[str, str]], open_user: str = ""
    ) -> None: ...
    def step(self) -> dict[int, list[int]]: ...


class DialogClient(Protocol):
    def on_reply(self, reply: int, texts: list[str], done: bool) -> None: ...

    def on_p_end(self, p: float, version: int) -> None: ...

    def on_draft(self, texts: list[str]) -> None:
        """A draft's reply so far, `texts[i]` decoded through its token i (to prepare its first audio)."""

    def on_speculation(self, reply: int, drafts: int, hit: bool, draft_tokens: int) -> None:
        """At the start of `reply`: how many drafts were made for it, whether one was used, and how many
        of its tokens it brought."""

    def on_tools(self, reply: int, events: list[object]) -> None:
        """Tool calls `reply` made (`tools.calls.ToolEvent`s: a server-side one with its result, a client's to
        be run by the client), in order; before the reply's last text."""

    def on_relay(self, reply: int, text: str, model: str, remote_model: str, decided_ms: float) -> None:
        """`dialog.mode = "relay"`: `reply`'s first words `text` are the local `model`'s (decided
        `decided_ms` after it began), the rest the remote model's (`events.ReplyRelayed`)."""


@dataclass(slots=True)
class SpeculationStats:
    turns: int = 0  # replies started
    drafted_turns: int = 0  # ... with at least one draft made for them
    hits: int = 0  # ... that adopted a draft
    drafts: int = 0  # drafts made
    skipped: int = 0  # drafts not made: no free KV slot
    behind: int = 0  # turns whose matching draft was not used: the conversation itself was further on
    draft_tokens: int = 0  # reply tokens decoded by drafts
    adopted_tokens: int = 0  # ... of them used by adopted drafts
    early: int = 0  # hits whose tokens went out before the step in flight ended (`_early_reply`)
    wasted_tokens: int = 0  # ... of them dropped with their drafts

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = asdict(self)
        out["hit_rate"] = round(self.hits / self.drafted_turns, 3) if self.drafted_turns else 0.0
        return out


@dataclass(slots=True)
class _Entry:
    client: DialogClient
    reply: int | None = None  # the reply being generated
    last_reply: int | None = None  # the latest reply started (its audio may play on after generation)
    reported: int = 0  # reply tokens handed to the client
    text: ReplyText | None = None  # the reply being generated, decoded as far as it was reported
    version: int = 0  # the last AppendUserText applied
    p_version: int = -1  # the version whose P(end of turn) was reported
    applied: int = 0  # commands of this conversation applied (`_Ready`)
    drafts_made: int = 0  # for the turn in progress
    drafts_shown: set[int] = field(default_factory=set)  # drafts whose text went to `on_draft`


@dataclass(slots=True)
class _DraftText:
    """A draft's reply text through each of its tokens (appended to, never changed)."""

    text: ReplyText
    texts: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Ready:
    """A conversation between replies with a draft made for exactly its state, as of the last dispatch:
    what `_early_reply` reads on the event loop. `applied`: the conversation's commands applied by then
    (a command queued since may change the state); `texts[:n]`: the draft's reply so far."""

    applied: int
    texts: list[str]
    n: int


@dataclass(frozen=True, slots=True)
class _Open:
    client: DialogClient
    done: asyncio.Future[int]
    system_prompt: str | None = None


@dataclass(frozen=True, slots=True)
class _Close:
    sid: int


@dataclass(frozen=True, slots=True)
class _ForSession:
    sid: int
    command: DialogCommand
    early: int = 0  # StartReply: reply tokens already handed to the client (`_early_reply`)


_Queued = _Open | _Close | _ForSession


class _Cycle(enum.Enum):
    STEPPED = enum.auto()  # the engine stepped: there may be more to do
    IDLE = enum.auto()  # nothing to step
    WAITING = enum.auto()  # only drafts to step, and they wait for the cores (`yield_to`)


class DialogWorker:
    """Sessions call `open`, `submit` and `close` on the event loop; everything that touches the engine
    (applying commands: tokenizing, forking a KV slot, cutting windows; the step; reading the results and
    decoding them) runs on the worker's one thread, a cycle at a time (`_cycle`). Clients' callbacks come
    back to the loop (`_deliver`), never for a conversation already closed."""

    def __init__(
        self,
        engine: LlmEngine,
        system_prompt: str | None = None,
        max_commands: int = 4096,
        speculation: SpeculationConfig | None = None,
        yield_to: Callable[[], bool] | None = None,
        head_start: Callable[[], bool] | None = None,
        max_reply_tokens: int | None = None,
        max_reply_sentences: int | None = None,
        contended: Callable[[], bool] | None = None,
        cores: threading.Lock | None = None,
    ) -> None:
        """`yield_to`: True while other work that must not be slowed down runs on this machine's cores (a
        recognizer pass, speech synthesis for a reply); drafts wait for it to finish. `head_start`: True
        while that work is only recognizer passes, when drafts short of `speculation.head_start_tokens`
        reply tokens may still step. `max_reply_tokens`, `max_reply_sentences`: the conversations' reply
        limits (None: the engine's; servers that share one engine each keep their own). `contended`: True
        while another model runs on these cores; steps are timed apart by it (`step_times`). The callables
        are read on the event loop. `cores`: held for each step (shared with the recognizer's passes:
        they take turns)."""
        self.engine = engine
        self._system_prompt = system_prompt  # None: the engine's own
        self._max_reply_tokens = max_reply_tokens
        self._max_reply_sentences = max_reply_sentences
        self.speculation = speculation or SpeculationConfig()
        self.stats = SpeculationStats()  # (written on the worker's thread)
        self._yield_to = yield_to
        self._head_start = head_start
        self._contended = contended
        self._cores = cores
        self._step_s: dict[bool, deque[float]] = {False: deque(maxlen=512), True: deque(maxlen=512)}
        self._max_commands = max_commands
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duplexd-llm")
        # The event loop's side.
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: dict[int, DialogClient] = {}  # open conversations
        self._queued: dict[int, int] = {}  # commands queued per conversation, ever (`_Ready.applied`)
        self._cycling = False
        # Between the two: the commands (under the lock), and what `_early_reply` reads.
        self._lock = threading.Lock()
        self._commands: deque[_Queued] = deque()
        self._ready: dict[int, _Ready] = {}  # replaced whole on each dispatch
        # The worker thread's side.
        self._pool = HypothesisPool(self.speculation.drafts_per_session, self.speculation.max_drafts)
        self._entries: dict[int, _Entry] = {}
        self._draft_texts: dict[int, _DraftText] = {}  # draft sid -> its reply text, as of the last step
        self._tools_warned = False
        self._events: list[tuple[int | None, Callable[..., None], tuple[object, ...]]] = []

    @property
    def name(self) -> str:
        return str(self.engine.config.model)

    def step_times(self) -> dict[str, float | int | None]:
        """Recent engine steps' median time, alone on the cores and beside another model's work
        (`contended`), and their ratio: what thread contention costs the LLM in this server."""
        out: dict[str, float | int | None] = {}
        for name, beside in (("alone", False), ("beside_other_model", True)):
            times = sorted(self._step_s[beside])
            out[f"{name}_p50_ms"] = round(1000 * times[len(times) // 2], 2) if times else None
            out[f"{name}_n"] = len(times)
        alone, beside = out["alone_p50_ms"], out["beside_other_model_p50_ms"]
        out["ratio"] = round(beside / alone, 2) if alone and beside else None  # type: ignore[operator]
        return out

    @property
    def pending(self) -> bool:
        """Commands queued, or a cycle of the worker in flight."""
        return self._cycling or bool(self._commands)

    # -- the event loop's side --------------------------------------------------------------------

    def _queue(self, item: _Queued, *, first: bool = False) -> None:
        with self._lock:
            if len(self._commands) >= self._max_commands:
                raise Overloaded("dialog command queue is full")
            if first:
                self._commands.appendleft(item)
            else:
                self._commands.append(item)
        if isinstance(item, _ForSession):
            self._queued[item.sid] = self._queued.get(item.sid, 0) + 1
        self._wake.set()

    async def open(self, client: DialogClient, system_prompt: str | None = None) -> int:
        """A new conversation (with the worker's system prompt unless one is given); raises `PoolFull` (an
        `Overloaded`) when every KV slot is taken."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._queue(_Open(client, done, system_prompt))
        return await done

    def submit(self, sid: int, command: DialogCommand) -> None:
        if isinstance(command, StartReply) and self._early_reply(sid, command.reply):
            return
        self._queue(_ForSession(sid, command))

    def _early_reply(self, sid: int, reply: int) -> bool:
        """The turn ended: if a draft made for exactly this state has tokens, hand them to the client now
        (a step may be in flight for a while) and queue the `StartReply` first, so that the draft is
        adopted before any later command could evict it. They are the tokens the reply will have
        whatever happens: a draft with an equal key is the reply, token for token (and were it evicted
        first, the reply decoded from scratch would give them again)."""
        ready = self._ready.get(sid)
        if ready is None or not self.speculation.enabled or sid not in self._clients:
            return False
        if ready.applied != self._queued.get(sid, 0):
            return False  # a command since may change the state
        if len(self._commands) >= self._max_commands:
            raise Overloaded("dialog command queue is full")
        texts = ready.texts[: ready.n]
        # (scheduled before the command is queued: anything the thread hands out for this reply comes after)
        asyncio.get_running_loop().call_soon(self._report_early, sid, reply, texts)
        self._queue(_ForSession(sid, StartReply(reply), early=len(texts)), first=True)
        return True

    def _report_early(self, sid: int, reply: int, texts: list[str]) -> None:
        client = self._clients.get(sid)
        if client is not None:
            client.on_reply(reply, texts, False)

    def close(self, sid: int) -> None:
        self._clients.pop(sid, None)  # (no callback reaches it from now on)
        self._queued.pop(sid, None)
        self._queue(_Close(sid))

    def _deliver(self, events: list[tuple[int | None, Callable[..., None], tuple[object, ...]]]) -> None:
        for sid, callback, args in events:
            if sid is None or sid in self._clients:
                callback(*args)

    def _opened(self, done: asyncio.Future[int], client: DialogClient, sid: int | None, exc: Exception | None) -> None:
        if exc is not None:
            if not done.done():
                done.set_exception(exc)
        elif done.done():  # (the caller gave up waiting)
            self._queue(_Close(sid))  # type: ignore[arg-type]
        else:
            self._clients[sid] = client  # type: ignore[index]
            done.set_result(sid)  # type: ignore[arg-type]

    async def run(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                drafts_wait = self._yield_to is not None and self._yield_to()
                head_start = self._head_start is not None and self._head_start()
                contended = self._contended is not None and self._contended()
                self._cycling = True
                try:
                    cycle, step_s = await loop.run_in_executor(self._executor, self._cycle, drafts_wait, head_start)
                except Exception:
                    log.exception("dialog step failed")
                    await asyncio.sleep(0.1)
                    continue
                finally:
                    self._cycling = False
                if step_s is not None:
                    contended = contended or (self._contended is not None and self._contended())
                    self._step_s[contended].append(step_s)
                if cycle is _Cycle.IDLE:
                    break
                if cycle is _Cycle.WAITING:
                    await wait_set(self._wake, _YIELD_POLL_S)
                    self._wake.clear()

    def close_worker(self) -> None:
        """Stop: wait out a cycle in flight, then free every conversation's KV slot (the engine may outlive
        this worker, as it does when one process runs servers one after another)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        for sid in self._entries:
            self._drop(self._pool.clear(sid))
            self.engine.close(sid)
        self._entries.clear()
        self._commands.clear()
        self._clients.clear()

    # -- the worker thread's side -----------------------------------------------------------------

    def _cycle(self, drafts_wait: bool, head_start: bool) -> tuple[_Cycle, float | None]:
        """Apply what was queued and hand out its results; then one engine step, unless there is nothing
        to step, or only drafts while `drafts_wait` (and no head start is due); then hand out the step's.
        Returns what happened, and how long the step took."""
        engine = self.engine
        try:
            self._apply()
            self._dispatch()
        except Exception:  # a bug in one session's handling must not stop every conversation
            log.exception("dialog worker: applying commands failed")
        finally:
            self._flush()
        if not engine.busy(drafts=False):
            if not engine.busy():
                return _Cycle.IDLE, None
            if drafts_wait and not (head_start and self._head_start_due()):
                return _Cycle.WAITING, None
        with self._cores if self._cores is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            engine.step()
            step_s = time.perf_counter() - t0  # (not the wait for the cores)
        try:
            self._dispatch()
        except Exception:
            log.exception("dialog worker: handing out a step's results failed")
        finally:
            self._flush()
        return _Cycle.STEPPED, step_s

    def _emit(self, sid: int | None, callback: Callable[..., None], *args: object) -> None:
        self._events.append((sid, callback, args))

    def _flush(self) -> None:
        events, self._events = self._events, []
        if events:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver, events)

    def _apply(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, deque()
        for item in commands:
            match item:
                case _Open(client=client, done=done, system_prompt=prompt):
                    try:
                        sid = self._open_session(prompt)
                    except Exception as exc:  # PoolFull, or a broken engine
                        self._emit(None, self._opened, done, client, None, exc)
                        continue
                    self._entries[sid] = _Entry(client)
                    self._emit(None, self._opened, done, client, sid, None)
                case _Close(sid=sid):
                    if self._entries.pop(sid, None) is not None:
                        self._drop(self._pool.clear(sid))
                        self.engine.close(sid)
                case _ForSession(sid=sid, command=command, early=early):
                    entry = self._entries.get(sid)
                    if entry is not None:
                        entry.applied += 1
                        self._command(sid, entry, command, early)

    def _open_session(self, system_prompt: str | None) -> int:
        while True:
            try:
                return self.engine.open(
                    system_prompt if system_prompt is not None else self._system_prompt,
                    max_reply_tokens=self._max_reply_tokens,
                    max_reply_sentences=self._max_reply_sentences,
                )
            except PoolFull:
                oldest = self._pool.oldest()  # a draft never keeps a conversation out
                if oldest is None:
                    raise
                self._drop([oldest])

    def _command(self, sid: int, entry: _Entry, command: DialogCommand, early: int) -> None:
        engine = self.engine
        match command:
            case AppendUserText(text=text, version=version):
                log.debug("session %d: user %r", sid, text)
                engine.append_user_text(sid, text)
                entry.version = version
                self._drop(self._pool.prune(sid, engine.state_key(sid)))
            case RetractUserText(texts=texts, version=version):
                if not engine.retract_user_text(sid, texts):  # (the conversation only takes back its last appends)
                    log.warning("session %d: the recognizer's corrected words could not replace %r", sid, texts)
                entry.version = version
                self._drop(self._pool.prune(sid, engine.state_key(sid)))
            case DraftReply(text=text, version=version):
                if self.speculation.enabled and version == entry.version and entry.reply is None:
                    self._draft(sid, entry, text)
            case StartReply(reply=reply):
                self._start_reply(sid, entry, reply, early)
            case InterruptReply(reply=reply, heard_tokens=heard, withdraw=withdraw):
                if entry.last_reply == reply:
                    if withdraw and engine.withdraw_reply(sid):
                        self._drop(self._pool.prune(sid, engine.state_key(sid)))  # (drafts of the closed turn)
                    else:
                        if withdraw:
                            log.info("session %d: reply %d could not be withdrawn: cut where heard", sid, reply)
                        engine.interrupt(sid, heard)  # also cuts a reply whose generation has finished
                    entry.reply = None
            case ReplaceContext(system_prompt=prompt, turns=turns, open_user=open_user):
                if entry.reply is not None:  # (the conversation sends it between replies only)
                    log.warning("session %d: context not replaced: a reply is in progress", sid)
                    return
                self._drop(self._pool.clear(sid))  # drafts of the old context
                if not getattr(engine, "takes_tools", False):  # (the embedded model has no tool format)
                    turns = tuple(t for t in turns if t[0] not in TOOL_ROLES)
                engine.rewrite(sid, prompt if prompt is not None else self._system_prompt, turns, open_user)
                entry.last_reply = None  # (nothing left to cut: the new context holds what was heard)
            case SetTools(tools=tools, tool_choice=choice):
                set_tools = getattr(engine, "set_tools", None)
                if set_tools is not None:
                    self._drop(self._pool.clear(sid))  # (drafts made without them)
                    set_tools(sid, tools, choice)
                elif tools and not self._tools_warned:
                    self._tools_warned = True
                    log.warning("the dialog model here takes no tools: a client's tools are not given to it")

    def _draft(self, sid: int, entry: _Entry, text: str) -> None:
        """Fork the conversation and start its reply as if the user's turn ended after `text`."""
        engine = self.engine
        if engine.replying(sid):
            return
        base = engine.state_key(sid)
        if engine.pool.free == 0:
            self.stats.skipped += 1
            return
        draft = engine.fork(sid, decode_limit=self.speculation.draft_tokens)
        engine.append_user_text(draft, text)
        key = engine.state_key(draft)
        if self._pool.has(sid, key):  # already drafted for these words
            engine.close(draft)
            return
        engine.start_reply(draft)
        log.debug("session %d: draft %d for %r", sid, draft, text)
        self._drop(self._pool.add(Draft(draft, sid, base, key, text)))
        self.stats.drafts += 1
        entry.drafts_made += 1

    def _start_reply(self, sid: int, entry: _Entry, reply: int, early: int) -> None:
        engine = self.engine
        hit = self._pool.take(sid, engine.state_key(sid))
        if hit is not None and engine.steps_to_reply(hit.sid) > engine.steps_to_reply(sid):
            # Right, but behind: it has yet to take in words the conversation already has. Adopting it
            # would redo that work before the first token.
            self.stats.behind += 1
            self._drop([hit])
            hit = None
        self._drop(self._pool.clear(sid))
        brought = 0
        log.debug("session %d: reply %d, %s", sid, reply, f"draft {hit.sid} hit" if hit else "no draft hit")
        if hit is not None:
            brought = len(engine.reply_tokens(hit.sid))
            engine.adopt(sid, hit.sid)  # its tokens are exactly those the conversation would generate now
            self.stats.hits += 1
            self.stats.adopted_tokens += brought
            self.stats.draft_tokens += brought
        else:
            engine.start_reply(sid)
        self.stats.turns += 1
        self.stats.drafted_turns += entry.drafts_made > 0
        self.stats.early += early > 0
        self._emit(sid, entry.client.on_speculation, reply, entry.drafts_made, hit is not None, brought)
        entry.drafts_made = 0
        entry.drafts_shown.clear()
        entry.reply, entry.last_reply = reply, reply
        entry.reported = early  # (went out before the reply started: `_early_reply`)
        entry.text = ReplyText(engine.tokenizer.decode)

    def _drop_behind(self, sid: int) -> None:
        """Drafts for the words the conversation now has, but that have yet to take in some of them: the
        conversation is ahead of them (it prefilled those words for P(end of turn)), so stepping them only
        redoes its work, and a fresh fork (`DraftReply("")`) does better."""
        engine, drafts = self.engine, self._pool.drafts(sid)
        if not drafts:
            return
        key, steps = engine.state_key(sid), engine.steps_to_reply(sid)
        behind = [d for d in drafts if d.key == key and engine.steps_to_reply(d.sid) > steps]
        for d in behind:
            self._pool.take(sid, d.key)
            self.stats.behind += 1
        self._drop(behind)

    def _drop(self, drafts: list[Draft]) -> None:
        for d in drafts:
            self._draft_texts.pop(d.sid, None)
            wasted = len(self.engine.reply_tokens(d.sid))
            self.stats.wasted_tokens += wasted
            self.stats.draft_tokens += wasted
            self.engine.close(d.sid)

    def _draft_text(self, sid: int) -> _DraftText:
        """A draft's text through each of its reply tokens so far."""
        draft = self._draft_texts.get(sid)
        if draft is None:
            draft = self._draft_texts[sid] = _DraftText(ReplyText(self.engine.tokenizer.decode))
        tokens = self.engine.reply_tokens(sid)
        draft.texts.extend(draft.text.extend(tokens[len(draft.text) :]))
        return draft

    def _dispatch(self) -> None:
        engine = self.engine
        ready: dict[int, _Ready] = {}
        for sid, entry in self._entries.items():
            key = engine.state_key(sid) if entry.reply is None else None
            if entry.reply is None:
                self._drop_behind(sid)
            drafts = self._pool.drafts(sid)
            entry.drafts_shown.intersection_update(d.sid for d in drafts)  # (forget drafts gone)
            for d in drafts:
                draft = self._draft_text(d.sid)
                n = len(draft.texts)
                if d.key == key and n:
                    ready[sid] = _Ready(entry.applied, draft.texts, n)
                shown = n >= min(_DRAFT_SHOWN_AT, self.speculation.draft_tokens) or engine.parked(d.sid)
                if d.sid not in entry.drafts_shown and n and shown:
                    entry.drafts_shown.add(d.sid)
                    self._emit(sid, entry.client.on_draft, draft.texts[:n])
            if entry.reply is not None:
                assert entry.text is not None
                if (relayed := self._relayed(sid)) is not None:  # (before the words it tells of)
                    self._emit(sid, entry.client.on_relay, entry.reply, *relayed)
                if (take := getattr(engine, "take_tool_events", None)) is not None and (events := take(sid)):
                    self._emit(sid, entry.client.on_tools, entry.reply, events)
                tokens = engine.reply_tokens(sid)
                done = not engine.replying(sid)
                if len(tokens) > entry.reported or done:
                    start = len(entry.text)
                    texts = entry.text.extend(tokens[start:])[max(0, entry.reported - start) :]
                    entry.reported = max(entry.reported, len(tokens))
                    reply = entry.reply
                    if done:
                        entry.reply = None
                    self._emit(sid, entry.client.on_reply, reply, texts, done)
            if entry.p_version != entry.version:
                p = engine.p_end_of_turn(sid)
                if p is not None:
                    entry.p_version = entry.version
                    self._emit(sid, entry.client.on_p_end, p, entry.version)
        self._ready = ready  # (before the callbacks run: a client may end its turn from one)

    def _relayed(self, sid: int) -> tuple[str, str, str, float] | None:
        """`dialog.mode = "relay"`: the reply's local prefix, once decided (`RelayDialogEngine.take_relayed`)."""
        take = getattr(self.engine, "take_relayed", None)
        return None if take is None else take(sid)

    def _head_start_due(self) -> bool:
        """A draft still short of its head start (see `SpeculationConfig.head_start_tokens`) may step."""
        want = self.speculation.head_start_tokens
        if not want:
            return False
        engine = self.engine
        return any(len(engine.reply_tokens(d.sid)) < want and not engine.parked(d.sid) for d in self._pool)
