"""P(end of turn) for replies written elsewhere: the remote backend, with the local model scoring turns.

A remote OpenAI-compatible server returns text, not the probability that the user's words close their
turn, so on its own the endpointer waits `turn.max_silence_ms` after every turn. LiveKit's turn detector
answers the same question with its own small model over the transcript; here the embedded SmolLM2 does:
each conversation gets a second, small session in a local `DialogEngine` holding the system prompt and
the user's open turn (the last turns too after a rewrite), and its P(the next token is the end-of-turn
marker) is the conversation's `p_end_of_turn`, as with the local backend.

    open / append_user_text -> remote (the reply) and the scorer's session (the words, prefilled by `step`)
    p_end_of_turn           -> the scorer's, once it has every word
    start_reply / adopt     -> the scorer's session starts over (system prompt only) for the next turn

Everything else is the remote engine's. Drafts (early requests) are not scored. The scorer's sessions have
a short KV window (`SCORER_WINDOW_TOKENS`): a turn's words and the prompt, not the conversation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from duplexd.config import DialogConfig
from duplexd.dialog.engine import DialogEngine, EngineConfig, Priority
from duplexd.dialog.remote import RemoteDialogEngine, RemoteFront
from duplexd.errors import Overloaded

SCORER_WINDOW_TOKENS = 252  # (+ 4 sinks: 256 rows; a long turn slides, its end is what is scored)
_REWRITE_TURNS = 2  # earlier turns a rewritten conversation's scorer session keeps


class TurnScoredEngine(RemoteFront):
    """`RemoteDialogEngine` whose conversations' P(end of turn) comes from a local model (see the module
    docstring). Not thread-safe, like both engines: one worker calls it."""

    reports_p_end = True

    def __init__(self, remote: RemoteDialogEngine, scorer: DialogEngine) -> None:
        super().__init__(remote)
        self.scorer = scorer
        self._scored: dict[int, int] = {}  # remote session -> its scorer session
        self._prompts: dict[int, str | None] = {}
        self.scorer_busy_s = 0.0  # time in the scorer's steps (on the worker's thread)

    @classmethod
    def from_config(cls, config: DialogConfig) -> TurnScoredEngine:
        remote = RemoteDialogEngine.from_config(config)
        local = replace(config, backend="local", model=config.turn_model, window_tokens=SCORER_WINDOW_TOKENS)
        return cls(remote, DialogEngine.load(EngineConfig.from_config(local)))

    # --- both ------------------------------------------------------------------------------------------

    def open(
        self,
        system_prompt: str | None = None,
        *,
        priority: Priority = Priority.NORMAL,
        max_reply_tokens: int | None = None,
        max_reply_sentences: int | None = None,
    ) -> int:
        sid = self.remote.open(
            system_prompt,
            priority=priority,
            max_reply_tokens=max_reply_tokens,
            max_reply_sentences=max_reply_sentences,
        )
        try:
            self._scored[sid] = self.scorer.open(system_prompt)
        except Overloaded:  # (no scorer slot: this conversation's turns wait the longest silence)
            pass
        self._prompts[sid] = system_prompt
        return sid

    def close(self, sid: int) -> None:
        self.remote.close(sid)
        self._prompts.pop(sid, None)
        if (lsid := self._scored.pop(sid, None)) is not None:
            self.scorer.close(lsid)

    def busy(self, *, drafts: bool = True) -> bool:
        return self.scorer.busy() or self.remote.busy(drafts=drafts)

    def append_user_text(self, sid: int, text: str) -> None:
        self.remote.append_user_text(sid, text)
        if (lsid := self._scored.get(sid)) is not None:
            self.scorer.append_user_text(lsid, text)

    def retract_user_text(self, sid: int, texts: Sequence[str]) -> bool:
        if not self.remote.retract_user_text(sid, texts):
            return False
        if (lsid := self._scored.get(sid)) is not None and not self.scorer.retract_user_text(lsid, texts):
            open_user = self.remote.history(sid)[-1]["content"]  # (the turn, corrected: it is open)
            self.scorer.rewrite(lsid, self._prompts.get(sid), [], open_user)
        return True

    def withdraw_reply(self, sid: int) -> bool:
        if not self.remote.withdraw_reply(sid):
            return False
        if (lsid := self._scored.get(sid)) is not None:  # (the turn, open again: scored as it goes on)
            self.scorer.rewrite(lsid, self._prompts.get(sid), [], self.remote.history(sid)[-1]["content"])
        return True

    def p_end_of_turn(self, sid: int) -> float | None:
        lsid = self._scored.get(sid)
        return None if lsid is None else self.scorer.p_end_of_turn(lsid)

    def start_reply(self, sid: int, prefix: str = "") -> None:
        self.remote.start_reply(sid, prefix)
        self._next_turn(sid)

    def adopt(self, sid: int, draft: int) -> None:
        self.remote.adopt(sid, draft)
        self._next_turn(sid)

    def rewrite(
        self, sid: int, system_prompt: str | None, turns: Sequence[tuple[str, str]], open_user: str = ""
    ) -> None:
        self.remote.rewrite(sid, system_prompt, turns, open_user)
        self._prompts[sid] = system_prompt
        if (lsid := self._scored.get(sid)) is not None:
            self.scorer.rewrite(lsid, system_prompt, list(turns)[-_REWRITE_TURNS:], open_user)

    def _next_turn(self, sid: int) -> None:
        if (lsid := self._scored.get(sid)) is not None:
            self.scorer.rewrite(lsid, self._prompts.get(sid), [])

    def step(self) -> dict[int, list[int]]:
        """The scorer's prefill first (a turn's P(end of turn) is due at the pause), then the remote's pieces."""
        if self.scorer.busy():
            t0 = time.perf_counter()
            self.scorer.step()
            self.scorer_busy_s += time.perf_counter() - t0
        return self.remote.step() if self.remote.busy() else {}

    def scorer_report(self) -> dict[str, object]:
        """For /healthz: the scorer's model, steps, time, and the memory its KV slots hold."""
        return {
            "model": self.scorer.config.model,
            "steps": self.scorer.stats["steps"],
            "prefill_tokens": self.scorer.stats["prefill_tokens"],
            "busy_s": round(self.scorer_busy_s, 3),
            "kv_bytes": self.scorer.pool.bytes_per_slot * self.scorer.pool.slots,
            "sessions": len(self._scored),
        }
