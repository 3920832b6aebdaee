"""The dialog engine: one model, every session, one batched forward per step.

Each session is a conversation whose KV state lives in one slot of a `KvPool` (S sinks + a W-token ring,
so it is bounded by construction). The session core drives it with a small duplex API:

    sid = engine.open()                  # system prompt ingested by the next steps
    engine.append_user_text(sid, " so")  # committed words as they arrive (prefilled while listening)
    engine.p_end_of_turn(sid)            # P(next token closes the user's turn), once the words are in
    engine.start_reply(sid)              # close the user turn; reply tokens come out of `step()`
    engine.step()                        # -> {sid: [new reply tokens]}
    engine.interrupt(sid, heard_tokens)  # barge-in: keep only what the user heard
    engine.retract_user_text(sid, [" so"])  # the recognizer's final decided those words again
    child = engine.fork(sid)             # a copy for drafts (speculative listening)
    engine.state_key(sid)                # names the state the session will be in once its queue is in
    engine.adopt(sid, child)             # the draft's state (and reply so far) becomes the session's

A step packs one decode token for every replying session, then prefill chunks (replying sessions first),
within a token budget. Drafts (`Priority.DRAFT`) only get steps that have no other work: a draft never
shares a step with, and so never slows, a real session. Those rules are `planner.StepPlanner`'s (pure, over
a snapshot of the sessions); the engine carries its plan out.

Lossless drafts. Greedy decoding is deterministic and batch-invariant (see `model.py`): a chunk's numbers
depend only on its own tokens and the session's KV. Chunks are cut the same way however the queue filled
up (never across the boundary of two `append_user_text` calls or before the assistant header), so a
session's KV is a function of what it was given, in which pieces. `state_key` hashes exactly that; two
sessions with the same key continue with the same tokens, bit for bit.

The engine is not thread-safe: one worker thread owns it (the scheduler's LLM worker).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from duplexd.config import DialogConfig
from duplexd.dialog.attention import step_attention
from duplexd.dialog.detok import ReplyText
from duplexd.dialog.device import torch_device
from duplexd.dialog.gguf_weights import ChatTokenizer
from duplexd.dialog.guard import banned_tokens, reply_end
from duplexd.dialog.kv_window import KvPool, Plan, RopeTable, WindowConfig, WindowState
from duplexd.dialog.model import Segment, Transformer
from duplexd.dialog.planner import PlannerConfig, Priority, SessionView, StepPlanner, chunks
from duplexd.dialog.tuning import DTYPES, tuned_model
from duplexd.errors import EngineError

log = logging.getLogger(__name__)

__all__ = [
    "DialogEngine",
    "EngineConfig",
    "Priority",
    "UnknownSession",
    "WindowConfig",
]

_DEFAULTS = DialogConfig()
_TURN_TOKENS = 512  # of a user turn, kept for the guard's copy rule (its most recent words)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine sizing. `max_sessions` KV slots of `window.capacity` rows each are allocated up front.

    Defaults are those of the `[dialog]` config section (`config.DialogConfig`); `from_config` maps it.
    """

    window: WindowConfig = field(default_factory=lambda: WindowConfig(_DEFAULTS.sink_tokens, _DEFAULTS.window_tokens))
    max_sessions: int = _DEFAULTS.max_sessions
    prefill_chunk: int = _DEFAULTS.prefill_chunk
    """Most tokens of one session prefilled in one step (bounds step latency for speaking sessions)."""
    step_token_budget: int = _DEFAULTS.step_token_budget
    """Most tokens (decode + prefill) in one step; one prefill chunk always fits when nothing else does."""
    max_reply_tokens: int = _DEFAULTS.max_reply_tokens
    max_reply_sentences: int = _DEFAULTS.max_reply_sentences
    """A reply ends once this many sentences are complete (0: no limit); see `guard.reply_end`."""
    no_repeat_ngram_tokens: int = _DEFAULTS.no_repeat_ngram_tokens
    no_copy_ngram_tokens: int = _DEFAULTS.no_copy_ngram_tokens
    """Reply tokens that would repeat an n-gram of the reply, or copy one of the user's turn, are never
    picked (0: off); see `guard.banned_tokens`."""
    system_prompt: str = _DEFAULTS.system_prompt
    model: str = _DEFAULTS.model
    """`smollm2` (the embedded GGUF), a `.gguf` file, or a local Hugging Face Llama/Qwen2 folder."""
    dtype: str = _DEFAULTS.dtype
    """`auto` (the faster on this CPU that keeps the perplexity, `tuning`), `float32` or `bfloat16`
    (weights, activations and KV)."""
    threads: int = _DEFAULTS.threads
    """torch intra-op threads for the engine's steps; 0: one per core. Set at load (the tuning measures
    with them) and kept at every step (a library imported later may change torch's, as silero-vad's
    package does at import)."""

    device: str = _DEFAULTS.device
    """`cpu`, `cuda` or `cuda:N` (`dialog/device.py`): where the weights, the KV pool and the steps live."""

    @property
    def torch_threads(self) -> int:
        """`threads`, with 0 read as one per core."""
        return self.threads or os.cpu_count() or 1

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"EngineConfig.max_sessions must be >= 1, got {self.max_sessions}")
        if not 1 <= self.prefill_chunk <= self.window.window_tokens:
            raise ValueError(
                f"EngineConfig.prefill_chunk must be 1..window_tokens ({self.window.window_tokens}), "
                f"got {self.prefill_chunk}"
            )
        if self.step_token_budget < 1:
            raise ValueError(f"EngineConfig.step_token_budget must be >= 1, got {self.step_token_budget}")
        if self.max_reply_tokens < 1:
            raise ValueError(f"EngineConfig.max_reply_tokens must be >= 1, got {self.max_reply_tokens}")
        if self.max_reply_sentences < 0:
            raise ValueError(f"EngineConfig.max_reply_sentences must be >= 0, got {self.max_reply_sentences}")
        for name in ("no_repeat_ngram_tokens", "no_copy_ngram_tokens"):
            n = getattr(self, name)
            if n != 0 and n < 2:
                raise ValueError(f"EngineConfig.{name} must be 0 (off) or >= 2, got {n}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")

    @classmethod
    def from_config(cls, config: DialogConfig) -> EngineConfig:
        return cls(
            window=WindowConfig(config.sink_tokens, config.window_tokens),
            max_sessions=config.max_sessions,
            prefill_chunk=config.prefill_chunk,
            step_token_budget=config.step_token_budget,
            max_reply_tokens=config.max_reply_tokens,
            max_reply_sentences=config.max_reply_sentences,
            no_repeat_ngram_tokens=config.no_repeat_ngram_tokens,
            no_copy_ngram_tokens=config.no_copy_ngram_tokens,
            system_prompt=config.system_prompt,
            model=config.model,
            dtype=config.dtype,
            threads=config.threads,
            device=config.device,
        )


class UnknownSession(EngineError):
    """No open session has this id."""


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """The chat template cut into the pieces a streaming conversation needs (derived, not hard-coded)."""

    system: str  # whole system turn
    user_open: str  # before the user's words
    user_close: str  # after the user's words, through the assistant header
    reply_close: str  # after the assistant's words
    end_of_turn_id: int  # first token of user_close: the token that closes the user's turn

    @classmethod
    def from_tokenizer(cls, tok: ChatTokenizer, system_prompt: str) -> ChatFormat:
        u, a = "\x00USER\x00", "\x00ASSISTANT\x00"
        system = [{"role": "system", "content": system_prompt}]
        head = tok.render_chat(system, add_generation_prompt=False)
        turn = tok.render_chat([*system, {"role": "user", "content": u}], add_generation_prompt=True)
        full = tok.render_chat(
            [*system, {"role": "user", "content": u}, {"role": "assistant", "content": a}],
            add_generation_prompt=False,
        )
        if not turn.startswith(head) or u not in turn or a not in full:
            raise EngineError("the model's chat template does not render turns as a growing transcript")
        user_open, user_close = turn[len(head) :].split(u)
        reply_close = full.split(a)[1]
        close_ids = tok.encode(user_close)
        if not close_ids:
            raise EngineError("the chat template has no end-of-user-turn marker")
        return cls(head, user_open, user_close, reply_close, close_ids[0])


@dataclass(eq=False)
class _Session:
    id: int
    slot: int
    window: WindowState
    priority: Priority
    pending: deque[int] = field(default_factory=deque)
    cuts: deque[int] = field(default_factory=deque)  # lengths of the pieces queued in `pending`, in order
    key: int = 0  # hash of every chunk ingested so far (and every cut-back), in order
    decode_limit: int | None = None  # a draft stops (is parked) after this many reply tokens
    reply_cap: int = 0  # a reply ends after this many tokens (given at `open`, copied by `fork`)
    sentence_cap: int = 0  # ... or this many sentences (0: no limit; given at `open`, copied by `fork`)
    user_open: bool = False
    user_words: deque[int] = field(default_factory=lambda: deque(maxlen=_TURN_TOKENS))  # the open user turn's
    answering: tuple[int, ...] = ()  # the user's words the reply answers (the guard's copy rule)
    replying: bool = False
    reply: list[int] = field(default_factory=list)
    reply_stats: list[TokenStats | None] = field(default_factory=list)  # per reply token (None: given, or not kept)
    reply_text: ReplyText | None = None  # `reply` decoded, as far as it matches (see `_reply_text`)
    reply_start: int = 0  # token index of the first reply token
    p_end_of_turn: float | None = None
    served: int = 0  # step number when last given a prefill chunk (fairness)
    log: deque[tuple[int, int]] = field(default_factory=deque)  # (position, token) ingested, bounded below


@dataclass(frozen=True, slots=True)
class _Work:
    session: _Session
    tokens: list[int]
    plan: Plan
    wants_logits: bool


class DialogEngine:
    reports_p_end = True  # `p_end_of_turn` gives the LLM's P(end of turn) once the user's words are in

    def __init__(self, model: Transformer, tokenizer: ChatTokenizer, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        mc = model.config
        self.pool = KvPool(
            layers=mc.n_layers,
            kv_heads=mc.n_kv_heads,
            head_dim=mc.head_dim,
            window=self.config.window,
            slots=self.config.max_sessions,
            dtype=model.tok_embeddings.weight.dtype,
            compute_dtype=model.attention_dtypes or None,
            device=model.device,
        )
        self.rope = RopeTable(mc.head_dim, mc.rope_theta, cached=max(8192, mc.context_length))
        self.format = ChatFormat.from_tokenizer(tokenizer, self.config.system_prompt)
        # (token counts of the turn markers, for `steps_to_reply`, which runs after every step)
        self._user_open_len = len(tokenizer.encode(self.format.user_open))
        self._user_close_len = len(tokenizer.encode(self.format.user_close))
        self._group = mc.n_heads // mc.n_kv_heads
        self._sessions: dict[int, _Session] = {}
        self._ids = itertools.count(1)
        self.stats = {
            "steps": 0,
            "decode_tokens": 0,
            "prefill_tokens": 0,
            "busy_s": 0.0,
            "draft_steps": 0,
            "draft_busy_s": 0.0,
            "threads": 0,  # torch's threads on the thread that steps the engine, at its last step
        }
        self.last_schedule: list[tuple[int, Priority]] = []  # sessions with work at the last step
        self.last_packed: list[tuple[int, str, int]] = []  # (session, `planner.Kind`, tokens), in packing order
        # (step seconds, sessions in the step, tokens in the step) for /metrics; the server drains it
        self.step_samples: deque[tuple[float, int, int]] = deque(maxlen=4096)
        # How this CPU runs the model (dtype, decode kernel: `tuning`), for /healthz; None if built by hand.
        self.tuning: dict[str, object] | None = None
        self.record_stats = False  # keep each picked reply token's `TokenStats` (the relay's prefix rule)

    @classmethod
    def load(cls, config: EngineConfig | None = None) -> DialogEngine:
        """Load the configured model (the embedded SmolLM2 by default) and build the engine."""
        from duplexd.dialog.weights import load_weights

        config = config or EngineConfig()
        device = torch_device(config.device)
        torch.set_num_threads(config.torch_threads)  # (the tuning below measures with them)
        t0 = time.perf_counter()
        loaded = load_weights(config.model)
        model, tuning = tuned_model(
            loaded.config, loaded.weights, loaded.tokenizer, config.dtype, config.model, loaded.blocks, device
        )
        log.info(
            "dialog model %s loaded on %s in %.1fs: %s, decode %s (%s in %.1fs)",
            config.model,
            tuning.device,
            time.perf_counter() - t0,
            tuning.dtype,
            model.decode_linear.name,
            "measured before" if tuning.cached else "measured now",
            tuning.seconds,
        )
        engine = cls(model, loaded.tokenizer, config)
        engine.tuning = tuning.report()
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
        """Start a conversation (its system turn is prefilled by the next steps). Raises `PoolFull`.

        `max_reply_tokens`, `max_reply_sentences` (0: none): this conversation's reply limits (a server's
        own, when servers share an engine); None: the engine's."""
        slot = self.pool.allocate()
        session = _Session(
            next(self._ids),
            slot,
            WindowState(self.config.window),
            priority,
            reply_cap=max_reply_tokens or self.config.max_reply_tokens,
            sentence_cap=self.config.max_reply_sentences if max_reply_sentences is None else max_reply_sentences,
        )
        self._queue(session, self._system_ids(system_prompt))
        self._sessions[session.id] = session
        return session.id

    def _system_ids(self, system_prompt: str | None) -> list[int]:
        """The system turn's tokens (None: the engine's own prompt)."""
        if system_prompt is None:
            return self.tokenizer.encode(self.format.system)
        return self.tokenizer.encode(ChatFormat.from_tokenizer(self.tokenizer, system_prompt).system)

    def close(self, sid: int) -> None:
        session = self._get(sid)
        del self._sessions[sid]
        self.pool.release(session.slot)

    def fork(self, sid: int, *, priority: Priority = Priority.DRAFT, decode_limit: int | None = None) -> int:
        """A new session with a copy of `sid`'s state (KV rows, pending tokens, reply). Raises `PoolFull`.

        A `decode_limit` parks the copy after that many reply tokens (a bounded draft)."""
        parent = self._get(sid)
        slot = self.pool.allocate()
        self.pool.copy(parent.slot, slot, parent.window.used)
        child = _Session(
            next(self._ids),
            slot,
            parent.window.copy(),
            priority,
            pending=deque(parent.pending),
            cuts=deque(parent.cuts),
            key=parent.key,
            decode_limit=decode_limit,
            user_open=parent.user_open,
            user_words=deque(parent.user_words, maxlen=_TURN_TOKENS),
            answering=parent.answering,
            replying=parent.replying,
            reply=list(parent.reply),
            reply_stats=list(parent.reply_stats),
            reply_start=parent.reply_start,
            p_end_of_turn=parent.p_end_of_turn,
            reply_cap=parent.reply_cap,
            sentence_cap=parent.sentence_cap,
            log=deque(parent.log),
        )
        self._sessions[child.id] = child
        return child.id

    def adopt(self, sid: int, draft: int) -> None:
        """Session `sid` continues from `draft`'s state: its KV, queue and reply so far (the caller checked
        that the draft forked from `sid` and that their `state_key`s matched). `draft` is gone after."""
        parent, child = self._get(sid), self._get(draft)
        if draft == sid:
            raise ValueError("a session cannot adopt itself")
        del self._sessions[draft]
        self.pool.release(parent.slot)
        child.id, child.priority, child.served, child.decode_limit = sid, parent.priority, parent.served, None
        self._sessions[sid] = child

    def state_key(self, sid: int) -> int:
        """The session's state once everything queued is ingested: equal keys, equal KV, equal tokens next."""
        session = self._get(sid)
        key, at = session.key, 0
        for cut in session.cuts:
            for n in chunks(cut, self.config.prefill_chunk):
                key = _chain(key, tuple(itertools.islice(session.pending, at, at + n)))
                at += n
        return hash((key, session.user_open, session.replying))

    def steps_to_reply(self, sid: int) -> int:
        """Engine steps before the session's first reply token (0 once it has one): its queued pieces'
        chunks, plus the assistant header's if its reply has not been started."""
        session = self._get(sid)
        if session.reply:
            return 0
        chunk = self.config.prefill_chunk
        steps = sum(len(chunks(cut, chunk)) for cut in session.cuts)
        if session.replying:
            return steps
        header = len(chunks(self._user_close_len, chunk))
        opening = 0 if session.user_open else len(chunks(self._user_open_len, chunk))
        return steps + header + opening

    def parked(self, sid: int) -> bool:
        """A draft that reached its decode limit (or finished its reply) and waits to be adopted or freed."""
        session = self._get(sid)
        return session.decode_limit is not None and (not session.replying or _view(session).at_limit)

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    @property
    def free_slots(self) -> int:
        return self.pool.free

    def resident_tokens(self, sid: int) -> int:
        return self._get(sid).window.resident

    def kv_rows(self) -> int:
        """KV rows holding tokens, over every session."""
        return sum(s.window.resident for s in self._sessions.values())

    def tokens_seen(self, sid: int) -> int:
        """Every token the session has ingested since it opened (unbounded; resident KV is not)."""
        return self._get(sid).window.n

    def context_tokens(self, sid: int) -> list[int]:
        """The tokens the session's next step attends to (its resident KV), in order."""
        session = self._get(sid)
        resident = set(session.window.row_t[session.window.row_t >= 0].tolist())
        return [token for pos, token in session.log if pos in resident]

    def replying(self, sid: int) -> bool:
        return self._get(sid).replying

    def reply_tokens(self, sid: int) -> list[int]:
        return list(self._get(sid).reply)

    def reply_stats(self, sid: int) -> list[TokenStats | None]:
        """How sure the model was of each reply token it picked (`record_stats`; None for tokens given as a
        prefix, or picked while not recording)."""
        return list(self._get(sid).reply_stats)

    def busy(self, *, drafts: bool = True) -> bool:
        """Any session has work to step (`drafts=False`: any but drafts)."""
        return any(self._has_work(s) for s in self._sessions.values() if drafts or s.priority is Priority.NORMAL)

    def _has_work(self, s: _Session) -> bool:
        return _view(s).has_work

    # --- the duplex API -------------------------------------------------------------------------------

    def append_user_text(self, sid: int, text: str) -> None:
        """Stream user words into the conversation; they are prefilled by later steps.

        Pass words with their leading space (" world"), so pieces tokenize as the whole text would.
        Empty text is a no-op. Text arriving while the assistant replies is queued after the reply.
        """
        session = self._get(sid)
        if not text:
            return
        ids = self.tokenizer.encode(text)
        if not session.user_open:
            session.user_words.clear()
            session.user_words.extend(ids)
            ids = self.tokenizer.encode(self.format.user_open) + ids
            session.user_open = True
        else:
            session.user_words.extend(ids)
        self._queue(session, ids)
        session.p_end_of_turn = None

    def retract_user_text(self, sid: int, texts: Sequence[str]) -> bool:
        """Take back the open user turn's last appends, exactly `texts` (each as it was given to
        `append_user_text`, oldest first): the recognizer decided those words again at the utterance's end.
        Tokens still queued are dropped; those already in the KV are cut from it (a cut-back, as by
        `interrupt`), so what follows is prefilled after the words before them. False, and nothing changed,
        where they are not the turn's last tokens or the window no longer holds them all."""
        session = self._get(sid)
        ids = [token for text in texts for token in self.tokenizer.encode(text)]
        words = list(session.user_words)
        if not ids or session.replying or not session.user_open or len(ids) > len(words) or words[-len(ids) :] != ids:
            return False
        if not self._forget_from(session, session.window.n + len(session.pending) - len(ids)):
            return False
        for _ in ids:
            session.user_words.pop()
        session.p_end_of_turn = None
        return True

    def p_end_of_turn(self, sid: int) -> float | None:
        """P(the next token closes the user's turn) after every appended word is in; None until then."""
        session = self._get(sid)
        return None if session.pending or not session.user_open else session.p_end_of_turn

    def start_reply(self, sid: int, prefix: str = "") -> None:
        """Close the user's turn and start the assistant's reply (no-op while already replying). `prefix`:
        the reply's first words, given rather than decoded (a reply continued from them: `duplexd
        serve-llm`'s final assistant message); they are its first tokens, prefilled, and decoding goes on
        after them."""
        session = self._get(sid)
        if session.replying:
            return
        if not session.user_open:
            self._queue(session, self.tokenizer.encode(self.format.user_open))
        self._queue(session, self.tokenizer.encode(self.format.user_close))
        session.answering = tuple(session.user_words) if session.user_open else ()
        session.user_words.clear()
        session.user_open = False
        session.replying = True
        session.reply = []
        session.reply_start = session.window.n + len(session.pending)
        session.p_end_of_turn = None
        if prefix:
            session.reply = self.tokenizer.encode(prefix)
            self._queue(session, list(session.reply))
        session.reply_stats = [None] * len(session.reply)

    def append_assistant_text(self, sid: int, text: str) -> None:
        """A whole earlier assistant turn, for a conversation replayed from its transcript (an OpenAI-style
        `messages` list, `duplexd serve-llm`): the tokens a reply of `text` leaves in the context when it
        finishes (or is cut there by `interrupt`): the user turn closed as by `start_reply`, the text, its
        end marker. Raises `EngineError` while the session replies (its reply would come first)."""
        session = self._get(sid)
        if session.replying:
            raise EngineError(f"dialog session {sid} is replying: an assistant turn cannot be appended now")
        self.start_reply(sid)
        session.replying = False
        self._queue(session, self.tokenizer.encode(text))
        self._queue(session, self.tokenizer.encode(self.format.reply_close))

    def rewrite(
        self, sid: int, system_prompt: str | None, turns: Sequence[tuple[str, str]], open_user: str = ""
    ) -> None:
        """Replace the conversation's whole context: `system_prompt` (None: the engine's), the finished
        `turns` ((role, text), role "user" or "assistant", oldest first) and the words of a user turn still
        open. For edits a KV cannot make in place (a Realtime client deleting an item, truncating an older
        reply, per-response instructions): the session starts over from an empty window and the next steps
        prefill it all. Raises `EngineError` while the session replies."""
        session = self._get(sid)
        if session.replying:
            raise EngineError(f"dialog session {sid} is replying: its context cannot be rewritten now")
        if bad := [role for role, _ in turns if role not in ("user", "assistant")]:
            raise ValueError(f"a turn's role is 'user' or 'assistant', not {bad[0]!r}")  # (the session untouched)
        system = self._system_ids(system_prompt)
        session.window = WindowState(self.config.window)
        session.pending.clear()
        session.cuts.clear()
        session.log.clear()
        session.key = _chain(session.key, ("rewrite",))
        session.user_open, session.answering, session.reply, session.reply_stats = False, (), [], []
        session.user_words.clear()
        session.p_end_of_turn = None
        self._queue(session, system)
        for role, text in turns:
            if role == "assistant":
                self.append_assistant_text(sid, text)
            else:
                self.append_user_text(sid, (" " if session.user_open else "") + text.strip())
        if open_user.strip():
            self.append_user_text(sid, (" " if session.user_open else "") + open_user.strip())
        session.cuts = deque([len(session.pending)])  # one piece: full chunks (no draft shares its history)

    def interrupt(self, sid: int, heard_tokens: int) -> None:
        """Stop the reply; keep only its first `heard_tokens` tokens in the conversation.

        Also cuts a reply the engine has already finished (its audio can still be playing when the user
        talks over it, or a Realtime client truncates it later), also when the user's words followed it:
        those are taken in again after the cut reply, as long as the KV window still holds the reply."""
        session = self._get(sid)
        close = self.tokenizer.encode(self.format.reply_close)
        after_reply = session.reply_start + len(session.reply) + len(close)
        end = session.window.n + len(session.pending)
        finished = not session.replying and bool(session.reply) and not session.user_open and end == after_reply
        followed = self._followed_reply(session, after_reply)
        if not (session.replying or finished or followed is not None):
            return
        heard = max(0, min(heard_tokens, len(session.reply)))
        if not session.replying and heard == len(session.reply):
            return  # all of it was heard: nothing to cut
        if followed is not None:
            _cut_back(session, session.reply_start + heard)
            del session.reply[heard:]
            del session.reply_stats[heard:]
            self._finish_reply(session)  # (its end marker, then the user's words again)
            self._queue(session, followed)
            session.p_end_of_turn = None
            return
        ingested = session.window.n - session.reply_start  # reply tokens already in the KV
        if ingested > heard:
            _cut_back(session, session.reply_start + heard)
        elif ingested >= 0:  # (< 0: the assistant header is still prefilling; the reply stays empty)
            session.pending.clear()
            session.cuts.clear()
            self._queue(session, session.reply[ingested:heard])
        del session.reply[heard:]
        del session.reply_stats[heard:]
        self._finish_reply(session)

    def withdraw_reply(self, sid: int) -> bool:
        """Take the reply back whole, and the close of the user's turn it answered: that turn is open
        again, as if it had never ended, and the user's next words continue it (the user went on over the
        reply's first words: `turn.continue_turn_ms`). False, and nothing changed, once the user's words
        followed a finished reply or the window no longer holds the turn's end."""
        session = self._get(sid)
        close = self.tokenizer.encode(self.format.reply_close)
        after_reply = session.reply_start + len(session.reply) + len(close)
        end = session.window.n + len(session.pending)
        finished = not session.replying and not session.user_open and end == after_reply
        if not (session.replying or finished) or not session.answering:
            return False
        if not self._forget_from(session, session.reply_start - len(self.tokenizer.encode(self.format.user_close))):
            return False
        session.replying = False
        session.reply, session.reply_stats = [], []
        session.user_words.clear()
        session.user_words.extend(session.answering)
        session.answering = ()
        session.user_open = True
        session.p_end_of_turn = None
        return True

    def _forget_from(self, session: _Session, cut: int) -> bool:
        """Forget every token of the session from position `cut` on: cut back from the KV (`_cut_back`), or,
        where they are all still queued, dropped from the queue (the state is then the one the tokens before
        them reach). False, and nothing changed, where the window or the log no longer holds them all."""
        if cut >= session.window.n:
            _drop_queued(session, session.window.n + len(session.pending) - cut)
            return True
        oldest = min((t for t in session.window.row_t.tolist() if t >= self.config.window.sink_tokens), default=0)
        if oldest > cut or sum(1 for pos, _ in session.log if pos >= cut) != session.window.n - cut:
            return False
        _cut_back(session, cut)
        return True

    def _followed_reply(self, session: _Session, after_reply: int) -> list[int] | None:
        """The tokens after a finished reply when only the user's open turn followed it (None otherwise, or
        when the window or the log no longer holds the reply and everything after it)."""
        if session.replying or not session.reply or not session.user_open or session.window.n < after_reply:
            return None
        logged = [token for pos, token in session.log if pos >= after_reply]
        oldest = min((t for t in session.window.row_t.tolist() if t >= self.config.window.sink_tokens), default=0)
        if len(logged) != session.window.n - after_reply or oldest > session.reply_start:
            return None
        return logged + list(session.pending)

    # --- the step -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> dict[int, list[int]]:
        """One forward over every session with work. Returns the new reply tokens per session."""
        work = self._schedule()
        if not work:
            return {}
        if torch.get_num_threads() != self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        t0 = time.perf_counter()
        segments, tokens, start = [], [], 0
        for w in work:
            segments.append(Segment(start, len(w.tokens)))
            tokens.extend(w.tokens)
            start += len(w.tokens)
        logits_rows = [seg.start + seg.length - 1 for seg, w in zip(segments, work, strict=True) if w.wants_logits]
        attend = step_attention(
            self.pool,
            self.model.config.head_dim,
            [(w.session.slot, w.plan, seg) for w, seg in zip(work, segments, strict=True)],
        )
        logits = self.model.step(torch.tensor(tokens), attend, torch.tensor(logits_rows, dtype=torch.long))
        logits = logits.cpu()  # (from a GPU: once per step; the token choice reads them on the CPU)
        out: dict[int, list[int]] = {}
        row = 0
        for w in work:
            first = w.session.window.n
            w.session.window.commit(w.plan)
            for i, token in enumerate(w.tokens):
                w.session.pending.popleft()
                w.session.log.append((first + i, token))
            w.session.key = _chain(w.session.key, tuple(w.tokens))
            if w.session.cuts[0] == len(w.tokens):
                w.session.cuts.popleft()
            else:
                w.session.cuts[0] -= len(w.tokens)
            while len(w.session.log) > self.config.window.capacity:  # keep the sinks, drop the oldest after
                del w.session.log[self.config.window.sink_tokens]
            if w.wants_logits:
                new = self._after_logits(w.session, logits[row])
                row += 1
                if new is not None:
                    out[w.session.id] = [new]
        self.stats["steps"] += 1
        self.stats["threads"] = torch.get_num_threads()
        elapsed = time.perf_counter() - t0
        self.stats["busy_s"] += elapsed
        self.step_samples.append((elapsed, len(work), len(tokens)))
        if all(w.session.priority is Priority.DRAFT for w in work):
            self.stats["draft_busy_s"] += elapsed
        return out

    def _schedule(self) -> list[_Work]:
        """Plan the step (`planner.StepPlanner`: who gets which tokens), then make the work of it: each
        piece is put to `_admit` in the planner's order, and the sessions' counters follow the plan."""
        config = PlannerConfig(self.config.step_token_budget, self.config.prefill_chunk)
        planner = StepPlanner(config, [_view(s) for s in self._sessions.values()])
        while (sid := planner.next_session()) is not None:
            session = self._sessions[sid]
            offer = planner.offer(session.cuts[0])  # (its head now: an `_admit` may have queued more before it)
            if offer is not None:
                planner.answer(self._admit(session, offer.tokens, set(offer.in_step)))
        plan = planner.plan()
        self.last_schedule = [(s.sid, s.priority) for s in plan.ready]
        work = [self._work(self._sessions[w.sid], w.tokens) for w in plan.work]
        for w in plan.work:
            if w.kind == "decode":
                self.stats["decode_tokens"] += w.tokens
            else:
                self._sessions[w.sid].served = self.stats["steps"]
                self.stats["prefill_tokens"] += w.tokens
        self.last_packed = [(w.sid, w.kind, w.tokens) for w in plan.work]
        if plan.drafts_only:
            self.stats["draft_steps"] += 1
        return work

    def _admit(self, session: _Session, n: int, in_step: set[int]) -> bool:
        """Whether `session`'s next `n` tokens may go into this step (`in_step`: the sessions in it, or
        decoding in it, which must keep their KV). Always, here: every session's KV is its own slot. The
        hook of the unbounded baseline that `duplexd bench collapse` measures against (`bench/baseline.py`),
        which must make room first."""
        return True

    def _queue(self, session: _Session, ids: Sequence[int]) -> None:
        """Queue tokens as one piece: a chunk never spans two pieces (see "Lossless drafts" above)."""
        if ids:
            session.pending.extend(ids)
            session.cuts.append(len(ids))

    def _work(self, session: _Session, n: int) -> _Work:
        tokens = list(itertools.islice(session.pending, n))
        last = n == len(session.pending)
        return _Work(session, tokens, session.window.plan(n, self.rope, self._group), wants_logits=last)

    def _after_logits(self, session: _Session, logits: Tensor) -> int | None:
        if not session.replying:
            if session.user_open:
                session.p_end_of_turn = float(torch.softmax(logits.float(), -1)[self.format.end_of_turn_id])
            return None
        token, stats = self._choose(session, logits)
        if token in (self.format.end_of_turn_id, self.tokenizer.eos_id):
            self._finish_reply(session)
            return None
        text = self._reply_text(session)
        before = text.text
        keep = reply_end(before, text.peek(token), session.sentence_cap)
        if keep is not None and keep <= len(before):  # (the reply is over before this token)
            self._finish_reply(session)
            return None
        session.reply.append(token)
        session.reply_stats.append(stats)
        text.append(token)
        self._queue(session, [token])
        if keep is not None or len(session.reply) >= session.reply_cap:
            self._finish_reply(session)
        return token

    def _reply_text(self, session: _Session) -> ReplyText:
        """The reply's text, decoded incrementally (`dialog/detok.py`); rebuilt where the reply was cut or
        forked since."""
        text = session.reply_text
        if text is None or text.tokens != session.reply:
            text = session.reply_text = ReplyText(self.tokenizer.decode, session.reply)
        return text

    def _choose(self, session: _Session, logits: Tensor) -> tuple[int, TokenStats | None]:
        """The reply's next token: greedy, among those the repetition guard allows, and how sure the model
        was of it (`record_stats`). This is the one place a reply or draft token is picked; it reads
        nothing but the conversation's own tokens."""
        banned = banned_tokens(
            session.reply, session.answering, self.config.no_repeat_ngram_tokens, self.config.no_copy_ngram_tokens
        )
        banned.difference_update((self.format.end_of_turn_id, self.tokenizer.eos_id))  # (ending is always allowed)
        if banned:
            logits = logits.index_fill(0, torch.tensor(sorted(banned), dtype=torch.long), float("-inf"))
        token = int(logits.argmax())
        return token, token_stats(logits, token) if self.record_stats else None

    def _finish_reply(self, session: _Session) -> None:
        session.replying = False
        self._queue(session, self.tokenizer.encode(self.format.reply_close))

    def _get(self, sid: int) -> _Session:
        try:
            return self._sessions[sid]
        except KeyError:
            raise UnknownSession(f"no dialog session {sid}") from None


@dataclass(frozen=True, slots=True)
class TokenStats:
    """How sure the model was of a token it picked: the token's log-probability, the entropy of the
    distribution it came from (nats), and the margin between the two likeliest tokens' probabilities."""

    logprob: float
    entropy: float
    margin: float


def token_stats(logits: Tensor, token: int) -> TokenStats:
    """`TokenStats` of `token` under `logits` (banned tokens at -inf count as probability 0)."""
    logp = torch.log_softmax(logits.float(), -1)
    p = logp.exp()
    entropy = float(-(p * logp.nan_to_num(neginf=0.0)).sum())
    top = p.topk(2).values
    return TokenStats(float(logp[token]), entropy, float(top[0] - top[1]))


def _view(session: _Session) -> SessionView:
    """What the step planner reads of a session."""
    return SessionView(
        session.id,
        session.priority,
        pending_tokens=len(session.pending),
        head_tokens=session.cuts[0] if session.cuts else 0,
        replying=session.replying,
        reply_tokens=len(session.reply),
        decode_limit=session.decode_limit,
        served=session.served,
    )


def _chain(key: int, piece: tuple[object, ...]) -> int:
    return hash((key, piece))


def _drop_queued(session: _Session, n: int) -> None:
    """Forget the last `n` tokens queued (not yet in the KV), and their share of the queued pieces."""
    for _ in range(n):
        session.pending.pop()
    while n:
        if session.cuts[-1] <= n:
            n -= session.cuts.pop()
        else:
            session.cuts[-1] -= n
            n = 0


def _cut_back(session: _Session, cut: int) -> None:
    """Forget every token of the session from position `cut` on, in the KV or queued (the key records the
    cut-back: a state reached by cutting is not the one the same tokens reached without)."""
    session.window.truncate(cut)
    session.pending.clear()
    session.cuts.clear()
    session.key = _chain(session.key, ("cut", cut))
    while session.log and session.log[-1][0] >= cut:
        session.log.pop()
