"""The unbounded-KV baseline that `duplexd bench collapse` measures the bounded engine against.

`UnboundedEngine` is the dialog engine with slots sized for whole conversations (a `window` that never
evicts, given by the caller) and only `kv_budget_tokens` KV rows resident over all sessions. A step that
needs more rows preempts idle sessions, then newer ones: their KV is dropped and recomputed from their
tokens when they next run, as vLLM's recompute preemption does; work that cannot get rows waits. The
server never runs this: there each session's KV is its own bounded slot (`DialogEngine`).

It uses the engine's two hooks, `_admit` (may this work go into the step?) and `_queue` (tokens queued to
a session: an idle session's preempted context comes back first), and counts `preemptions` and
`recomputed_tokens` in `stats`.
"""

from __future__ import annotations

from collections.abc import Sequence
from weakref import WeakKeyDictionary

from duplexd.dialog.engine import DialogEngine, EngineConfig, _Session, _Work
from duplexd.dialog.gguf_weights import ChatTokenizer
from duplexd.dialog.kv_window import WindowState
from duplexd.dialog.model import Transformer

__all__ = ["UnboundedEngine"]


class UnboundedEngine(DialogEngine):
    def __init__(
        self, model: Transformer, tokenizer: ChatTokenizer, config: EngineConfig, *, kv_budget_tokens: int
    ) -> None:
        if kv_budget_tokens < 1:
            raise ValueError(f"UnboundedEngine kv_budget_tokens must be >= 1, got {kv_budget_tokens}")
        super().__init__(model, tokenizer, config)
        self.kv_budget_tokens = kv_budget_tokens
        self.stats["preemptions"] = 0
        self.stats["recomputed_tokens"] = 0
        self._reserved = 0  # KV rows the step being scheduled will add
        self._evicted: WeakKeyDictionary[_Session, list[int]] = WeakKeyDictionary()  # idle sessions' context

    def rewrite(
        self, sid: int, system_prompt: str | None, turns: Sequence[tuple[str, str]], open_user: str = ""
    ) -> None:
        if not self._get(sid).replying:  # (else the engine refuses it)
            self._evicted.pop(self._get(sid), None)  # the context it would have recomputed is replaced
        super().rewrite(sid, system_prompt, turns, open_user)

    def _schedule(self) -> list[_Work]:
        self._reserved = 0
        return super()._schedule()

    def _queue(self, session: _Session, ids: Sequence[int]) -> None:
        if ids:
            evicted = self._evicted.pop(session, None)
            if evicted:  # the context comes back when the session has work again
                session.pending.extendleft(reversed(evicted))
                session.cuts.appendleft(len(evicted))
        super()._queue(session, ids)

    def _admit(self, session: _Session, n: int, in_step: set[int]) -> bool:
        """Make room for `n` more rows of `session` by preempting idle sessions (no work queued: a
        conversation between turns), then sessions opened after it (the newest first; none in `in_step`,
        already in this step), as vLLM preempts by arrival order: the oldest active session always
        progresses, and two sessions never evict each other in turn. False if even that cannot make room:
        the work waits (a stall)."""
        budget = self.kv_budget_tokens
        in_use = self.kv_rows() + self._reserved
        victims = sorted(
            (
                s
                for s in self._sessions.values()
                if s.id not in in_step
                and s.id != session.id
                and s.window.resident
                and (not s.pending or s.id > session.id)
            ),
            key=lambda s: (bool(s.pending), -s.id),
        )
        if in_use + n - sum(v.window.resident for v in victims) > budget:
            return False  # not even preempting everyone else would make room
        while in_use + n > budget:
            victim = victims.pop(0)
            in_use -= victim.window.resident
            self._preempt(victim)
        self._reserved += n
        return True

    def _preempt(self, session: _Session) -> None:
        """Drop the session's KV; its tokens are recomputed before its next work (at once if it has work
        queued, else when it gets some)."""
        tokens = [t for _, t in session.log]
        session.window = WindowState(self.config.window)
        session.log.clear()
        if not session.pending:
            self._evicted[session] = tokens
        elif tokens:
            session.pending.extendleft(reversed(tokens))
            session.cuts.appendleft(len(tokens))
        self.stats["preemptions"] += 1
        self.stats["recomputed_tokens"] += len(tokens)
