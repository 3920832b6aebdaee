"""The step planner: which sessions get how many tokens in the dialog engine's next packed step (pure).

The engine hands it a snapshot of every session (`SessionView`) and the step's sizing (`PlannerConfig`);
the planner decides, the engine carries the plan out (KV plans, the forward, its sessions' counters). The
rules, in packing order:

- A session has work when tokens are queued for it, unless it is a draft parked at its decode limit.
- Drafts (`Priority.DRAFT`) only get steps that have no other work: a draft never slows a real session.
- Decode first: every replying session whose queue is just its last reply token gets that one token, in
  every step, whatever the budget (a reply's next word is the most urgent work there is).
- Then prefill, one chunk per session: replying sessions (their headers) before listening ones, then the
  session served longest ago, then the oldest. A chunk is at most `prefill_chunk` tokens and never spans
  two queued pieces (`chunks`: how `state_key` predicts the same cuts). A chunk that does not fit the budget
  left is skipped (a smaller one behind it may still fit), unless the step is still empty: one chunk
  always fits, so a budget smaller than a chunk slows prefill but never stops it.

Every piece of work is put to the engine's admission check before it is planned (`StepPlanner.offer`,
`answer`): `DialogEngine` admits all of it (each session's KV is its own slot), the unbounded baseline of
`duplexd bench collapse` (`bench/baseline.py`) first makes room by preempting other sessions, which changes
their queues. So the planner is stepped: the engine answers each offer, and gives each session's head piece
as it is when that session's turn comes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Literal

__all__ = [
    "Kind",
    "Offer",
    "PlannedWork",
    "PlannerConfig",
    "Priority",
    "SessionView",
    "StepPlan",
    "StepPlanner",
    "chunks",
]


class Priority(Enum):
    """Prefill order within a step (decode of replying sessions always comes first)."""

    NORMAL = 0
    DRAFT = 1


Kind = Literal["decode", "reply", "listen", "draft"]
"""What a session's work in a step is for: a reply's next token, a reply's prefill (its header), a
listening session's words, or a draft's."""


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """A step's sizing (the engine's `step_token_budget` and `prefill_chunk`)."""

    step_token_budget: int
    """Most tokens (decode + prefill) in one step; one prefill chunk always fits when nothing else does."""
    prefill_chunk: int
    """Most tokens of one session prefilled in one step (bounds step latency for speaking sessions)."""

    def __post_init__(self) -> None:
        if self.step_token_budget < 1:
            raise ValueError(f"PlannerConfig.step_token_budget must be >= 1, got {self.step_token_budget}")
        if self.prefill_chunk < 1:
            raise ValueError(f"PlannerConfig.prefill_chunk must be >= 1, got {self.prefill_chunk}")


@dataclass(frozen=True, slots=True)
class SessionView:
    """What the planner reads of one session, copied out of the engine before a step is planned."""

    sid: int
    priority: Priority
    pending_tokens: int  # queued, not yet in the KV
    head_tokens: int  # the first queued piece (a chunk never spans two); 0 when nothing is queued
    replying: bool
    reply_tokens: int  # reply tokens picked so far
    decode_limit: int | None = None  # a draft stops (is parked) after this many reply tokens
    served: int = 0  # step number when last given a prefill chunk (fairness)

    @property
    def at_limit(self) -> bool:
        """A draft has decoded as many reply tokens as it may."""
        return self.decode_limit is not None and self.reply_tokens >= self.decode_limit

    @property
    def has_work(self) -> bool:
        return self.pending_tokens > 0 and not (self.replying and self.at_limit)

    @property
    def decodes(self) -> bool:
        """Its queue is just the reply's last token: one token in, the next one out."""
        return self.replying and self.pending_tokens == 1 and self.reply_tokens > 0


@dataclass(frozen=True, slots=True)
class PlannedWork:
    sid: int
    tokens: int  # from the head of its queue
    kind: Kind


@dataclass(frozen=True, slots=True)
class Offer:
    """Work the planner would add to the step, put to the engine's admission check."""

    sid: int
    tokens: int
    in_step: frozenset[int]
    """Sessions the step holds (or, while decode is offered, every session decoding): an admission that
    makes room must not take it from them."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    ready: tuple[SessionView, ...]  # the sessions that had work and were considered, in the engine's order
    work: tuple[PlannedWork, ...]  # in packing order: decode, then prefill
    drafts_only: bool  # the step went to drafts: no real session had work


class StepPlanner:
    """Plans one step, one decision at a time, so that an admission check can run between them:
    `next_session` names the session decided next (None: done), `offer` sizes its work (None: a chunk that
    does not fit the budget left), `answer` takes the check's verdict on the offer; then `plan`."""

    def __init__(self, config: PlannerConfig, sessions: Iterable[SessionView]) -> None:
        self._config = config
        ready = [s for s in sessions if s.has_work]
        real = [s for s in ready if s.priority is Priority.NORMAL]
        self._ready = tuple(real or ready)  # drafts only get steps with nothing else to do
        self._drafts_only = bool(ready) and not real
        decode = [s for s in self._ready if s.decodes]
        self._decoding = frozenset(s.sid for s in decode)
        self._queue: deque[SessionView] = deque(decode)
        self._prefill_queued = False  # the prefill order is fixed once every decode offer is answered
        self._budget = config.step_token_budget  # (negative once decode alone overruns it)
        self._work: list[PlannedWork] = []
        self._current: SessionView | None = None
        self._offered: PlannedWork | None = None

    def next_session(self) -> int | None:
        """The session whose work is decided next; None once the plan is complete."""
        if self._current is not None or self._offered is not None:
            raise RuntimeError("StepPlanner: the last session's offer is not decided yet")
        if not self._queue and not self._prefill_queued:
            self._prefill_queued = True
            in_step = self._in_step()
            waiting = (s for s in self._ready if s.sid not in in_step)
            self._queue.extend(sorted(waiting, key=lambda s: (not s.replying, s.priority.value, s.served, s.sid)))
        if not self._queue:
            return None
        self._current = self._queue.popleft()
        return self._current.sid

    def offer(self, head_tokens: int | None = None) -> Offer | None:
        """The next session's work, or None where a prefill chunk does not fit the budget left.

        `head_tokens`: its first queued piece as it is now (None: as in its view); an admission before this
        one may have changed it (the unbounded baseline preempts sessions: their context is queued again)."""
        s, self._current = self._current, None
        if s is None:
            raise RuntimeError("StepPlanner.offer before next_session")
        if not self._prefill_queued:
            work = PlannedWork(s.sid, 1, "decode")
            return self._offer(work, self._decoding)
        n = min(s.head_tokens if head_tokens is None else head_tokens, self._config.prefill_chunk)
        if n > self._budget and self._work:
            return None
        kind: Kind = "draft" if s.priority is Priority.DRAFT else "reply" if s.replying else "listen"
        return self._offer(PlannedWork(s.sid, n, kind), self._in_step())

    def answer(self, admitted: bool) -> None:
        """The admission check's answer to the last offer: admitted work joins the step."""
        work, self._offered = self._offered, None
        if work is None:
            raise RuntimeError("StepPlanner.answer without an offer")
        if admitted:
            self._work.append(work)
            self._budget -= work.tokens

    def plan(self) -> StepPlan:
        if self._current is not None or self._offered is not None or self._queue or not self._prefill_queued:
            raise RuntimeError("StepPlanner.plan before every session was decided")
        return StepPlan(self._ready, tuple(self._work), self._drafts_only)

    def _offer(self, work: PlannedWork, in_step: frozenset[int]) -> Offer:
        self._offered = work
        return Offer(work.sid, work.tokens, in_step)

    def _in_step(self) -> frozenset[int]:
        return frozenset(w.sid for w in self._work)


def chunks(piece_tokens: int, prefill_chunk: int) -> list[int]:
    """The chunks a queued piece is prefilled in, step after step (what `StepPlanner` cuts from its head)."""
    return [min(prefill_chunk, piece_tokens - at) for at in range(0, piece_tokens, prefill_chunk)]
