"""The LLM worker: one task owns the dialog engine; its steps run on one thread.

The engine is not thread-safe, so sessions never call it directly: they queue commands, which the worker
applies between steps (on the event loop, where they only tokenize and edit lists), then it runs the next
step on its thread and hands each session its new reply text and P(end of turn).

Speculative listening lives here too: `DraftReply` forks the conversation into a draft (a low-priority
engine session, see `dialog/speculation.py`); `StartReply` adopts the draft made for exactly the
conversation's state, or starts the reply from scratch on a miss. A hit's tokens go out as the command
arrives, not after the step in flight (often the draft's own next token): the worker keeps, between
steps, each conversation's `state_key` and each draft's tokens, so it can tell a hit without the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Protocol

from duplexd.commands import AppendUserText, DraftReply, InterruptReply, ReplaceContext, StartReply
from duplexd.config import SpeculationConfig
from duplexd.dialog.engine import Priority
from duplexd.dialog.kv_window import PoolFull
from duplexd.dialog.speculation import Draft, HypothesisPool
from duplexd.errors import Overloaded

log = logging.getLogger(__name__)

_YIELD_POLL_S = 0.01
_DRAFT_SHOWN_AT = 6  # reply tokens: a first spoken piece (two words, or a short clause) is in them

DialogCommand = AppendUserText | StartReply | DraftReply | InterruptReply | ReplaceContext


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
    def p_end_of_turn(self, sid: int) -> float | None: ...
    def start_reply(self, sid: int) -> None: ...
    def interrupt(self, sid: int, heard_tokens: int) -> None: ...
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
    version: int = 0  # the last AppendUserText applied
    p_version: int = -1  # the version whose P(end of turn) was reported
    drafts_made: int = 0  # for the turn in progress
    drafts_shown: set[int] = field(default_factory=set)  # drafts whose text went to `on_draft`
    key: int | None = None  # the engine's state_key for it while not replying, as of the last dispatch
    early: tuple[int, int] | None = None  # (reply, tokens) handed to the client before the reply started


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


_Queued = _Open | _Close | _ForSession


class DialogWorker:
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
    ) -> None:
        """`yield_to`: True while other work that must not be slowed down runs on this machine's cores (a
        recognizer pass, speech synthesis for a reply); drafts wait for it to finish. `head_start`: True
        while that work is only recognizer passes, when drafts short of `speculation.head_start_tokens`
        reply tokens may still step. `max_reply_tokens`, `max_reply_sentences`: the conversations' reply
        limits (None: the engine's; servers that share one engine each keep their own)."""
        self.engine = engine
        self._system_prompt = system_prompt  # None: the engine's own
        self._max_reply_tokens = max_reply_tokens
        self._max_reply_sentences = max_reply_sentences
        self.speculation = speculation or SpeculationConfig()
        self._pool = HypothesisPool(self.speculation.drafts_per_session, self.speculation.max_drafts)
        self.stats = SpeculationStats()
        self._yield_to = yield_to
        self._head_start = head_start
        self._entries: dict[int, _Entry] = {}
        self._commands: deque[_Queued] = deque()
        self._draft_tokens: dict[int, list[int]] = {}  # draft sid -> its reply tokens, as of the last step
        self._max_commands = max_commands
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duplexd-llm")

    @property
    def name(self) -> str:
        return str(self.engine.config.model)

    def _queue(self, item: _Queued) -> None:
        if len(self._commands) >= self._max_commands:
            raise Overloaded("dialog command queue is full")
        self._commands.append(item)
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
        adopted before any other command could evict it. They are the tokens the reply will have
        whatever happens: a draft with an equal key is the reply, token for token."""
        entry = self._entries.get(sid)
        if entry is None or entry.key is None or entry.reply is not None or not self.speculation.enabled:
            return False
        if any(isinstance(c, _ForSession) and c.sid == sid for c in self._commands):
            return False  # the key is about to change
        draft = next((d for d in self._pool.drafts(sid) if d.key == entry.key), None)
        tokens = self._draft_tokens.get(draft.sid) if draft is not None else None
        if not tokens:
            return False
        if len(self._commands) >= self._max_commands:
            raise Overloaded("dialog command queue is full")
        self._commands.appendleft(_ForSession(sid, StartReply(reply)))
        self._wake.set()
        asyncio.get_running_loop().call_soon(self._report_early, sid, reply, tokens)
        return True

    def _report_early(self, sid: int, reply: int, tokens: list[int]) -> None:
        entry = self._entries.get(sid)
        if entry is None or entry.last_reply == reply:  # gone, or started already: reported from there
            return
        entry.early = (reply, len(tokens))
        self.stats.early += 1
        entry.client.on_reply(reply, self._texts(tokens), False)

    def close(self, sid: int) -> None:
        self._queue(_Close(sid))

    def _apply(self) -> None:
        engine = self.engine
        while self._commands:
            match self._commands.popleft():
                case _Open(client=client, done=done, system_prompt=prompt):
                    if done.cancelled():
                        continue
                    try:
                        sid = self._open_session(prompt)
                    except Exception as exc:  # PoolFull, or a broken engine
                        done.set_exception(exc)
                        continue
                    self._entries[sid] = _Entry(client)
                    done.set_result(sid)
                case _Close(sid=sid):
                    if self._entries.pop(sid, None) is not None:
                        self._drop(self._pool.clear(sid))
                        engine.close(sid)
                case _ForSession(sid=sid, command=command):
                    entry = self._entries.get(sid)
                    if entry is not None:
                        self._command(sid, entry, command)

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

    def _command(self, sid: int, entry: _Entry, command: DialogCommand) -> None:
        engine = self.engine
        match command:
            case AppendUserText(text=text, version=version):
                log.debug("session %d: user %r", sid, text)
                engine.append_user_text(sid, text)
                entry.version = version
                self._drop(self._pool.prune(sid, engine.state_key(sid)))
            case DraftReply(text=text, version=version):
                if self.speculation.enabled and version == entry.version and entry.reply is None:
                    self._draft(sid, entry, text)
            case StartReply(reply=reply):
                self._start_reply(sid, entry, reply)
            case InterruptReply(reply=reply, heard_tokens=heard):
                if entry.last_reply == reply:
                    engine.interrupt(sid, heard)  # also cuts a reply whose generation has finished
                    entry.reply = None
            case ReplaceContext(system_prompt=prompt, turns=turns, open_user=open_user):
                if entry.reply is not None:  # (the conversation sends it between replies only)
                    log.warning("session %d: context not replaced: a reply is in progress", sid)
                    return
                self._drop(self._pool.clear(sid))  # drafts of the old context
                engine.rewrite(sid, prompt if prompt is not None else self._system_prompt, turns, open_user)
                entry.last_reply = None  # (nothing left to cut: the new context holds what was heard)

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

    def _start_reply(self, sid: int, entry: _Entry, reply: int) -> None:
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
        entry.client.on_speculation(reply, entry.drafts_made, hit is not None, brought)
        entry.drafts_made = 0
        entry.drafts_shown.clear()
        entry.reply, entry.last_reply, entry.reported = reply, reply, 0
        if entry.early is not None and entry.early[0] == reply:
            entry.reported = entry.early[1]  # went out before the reply started (`_early_reply`)
        entry.early = None

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

    def _texts(self, tokens: list[int], start: int = 0) -> list[str]:
        """`texts[i]`: the reply decoded through its token `start + i` (what clients are handed)."""
        decode = self.engine.tokenizer.decode
        return [decode(tokens[:k]) for k in range(start + 1, len(tokens) + 1)]

    def _drop(self, drafts: list[Draft]) -> None:
        for d in drafts:
            self._draft_tokens.pop(d.sid, None)
            wasted = len(self.engine.reply_tokens(d.sid))
            self.stats.wasted_tokens += wasted
            self.stats.draft_tokens += wasted
            self.engine.close(d.sid)

    def _dispatch(self) -> None:
        engine = self.engine
        for sid, entry in self._entries.items():
            # (before any callback: a client may end its turn from one, and `_early_reply` reads this)
            entry.key = engine.state_key(sid) if entry.reply is None else None
            if entry.reply is None:
                self._drop_behind(sid)
            drafts = self._pool.drafts(sid)
            entry.drafts_shown.intersection_update(d.sid for d in drafts)  # (forget drafts gone)
            for d in drafts:
                tokens = engine.reply_tokens(d.sid)
                self._draft_tokens[d.sid] = tokens
                ready = len(tokens) >= min(_DRAFT_SHOWN_AT, self.speculation.draft_tokens) or engine.parked(d.sid)
                if d.sid not in entry.drafts_shown and tokens and ready:
                    entry.drafts_shown.add(d.sid)
                    entry.client.on_draft(self._texts(tokens))
            if entry.reply is not None:
                tokens = engine.reply_tokens(sid)
                done = not engine.replying(sid)
                if len(tokens) > entry.reported or done:
                    texts = self._texts(tokens, entry.reported)
                    entry.reported = len(tokens)
                    reply = entry.reply
                    if done:
                        entry.reply = None
                    entry.client.on_reply(reply, texts, done)
            if entry.p_version != entry.version:
                p = engine.p_end_of_turn(sid)
                if p is not None:
                    entry.p_version = entry.version
                    entry.client.on_p_end(p, entry.version)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                try:
                    self._apply()
                    self._dispatch()
                except Exception:  # a bug in one session's handling must not stop every conversation
                    log.exception("dialog worker: applying commands failed")
                if not self.engine.busy(drafts=False):
                    if not self.engine.busy():
                        break
                    if self._yield_to is not None and self._yield_to() and not self._head_start_due():
                        # only drafts to step: they wait
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._wake.wait(), _YIELD_POLL_S)
                        self._wake.clear()
                        continue
                try:
                    await loop.run_in_executor(self._executor, self.engine.step)
                except Exception:
                    log.exception("dialog step failed")
                    await asyncio.sleep(0.1)

    def _head_start_due(self) -> bool:
        """A draft still short of its head start (see `SpeculationConfig.head_start_tokens`) may step."""
        want = self.speculation.head_start_tokens
        if not want or self._head_start is None or not self._head_start():
            return False
        engine = self.engine
        return any(len(engine.reply_tokens(d.sid)) < want and not engine.parked(d.sid) for d in self._pool)

    def close_worker(self) -> None:
        """Stop: wait out a step in flight, then free every conversation's KV slot (the engine may outlive
        this worker, as it does when one process runs servers one after another)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        for sid in self._entries:
            self._drop(self._pool.clear(sid))
            self.engine.close(sid)
        self._entries.clear()
        self._commands.clear()
