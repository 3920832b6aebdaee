"""Speculative listening: the pool of drafted replies (pure bookkeeping; the LLM worker runs the drafts).

When the user pauses, the conversation asks for a reply drafted *as if* their turn had ended with the
words heard so far (and a second draft for the most likely other ending). Each draft is an engine session
forked from the conversation's own; it is keyed by the engine's `state_key`, which names exactly the
tokens the conversation was given and in which pieces. At the real end of the turn, a draft whose key is
the conversation's key *is* the reply the conversation would now generate, token for token (greedy,
batch-invariant decoding), so it is adopted as is; every other draft is dropped unseen.

    pause            -> add(Draft(owner, base, key, ...))   (the owner's key was `base` at the fork)
    more user words  -> prune(owner, key)                   drafts no longer reachable from the new state
    end of turn      -> take(owner, key), then clear(owner)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Draft:
    sid: int  # the engine session holding the draft
    owner: int  # the conversation's engine session it drafts for
    base: int  # the owner's state key when the draft forked
    key: int  # the owner's state key once it has been given the words the draft assumed
    text: str  # those words (what the user is assumed to say after `base`)


class HypothesisPool:
    """Drafts, at most `per_owner` per conversation and `total` in all (the oldest go first)."""

    def __init__(self, per_owner: int = 2, total: int = 8) -> None:
        if per_owner < 1 or total < 1:
            raise ValueError(f"a hypothesis pool needs room for a draft (per_owner={per_owner}, total={total})")
        self.per_owner = per_owner
        self.total = total
        self._drafts: OrderedDict[int, Draft] = OrderedDict()  # by draft sid, oldest first

    def __len__(self) -> int:
        return len(self._drafts)

    def __iter__(self) -> Iterator[Draft]:
        return iter(list(self._drafts.values()))

    def drafts(self, owner: int) -> list[Draft]:
        return [d for d in self._drafts.values() if d.owner == owner]

    def has(self, owner: int, key: int) -> bool:
        return any(d.key == key for d in self.drafts(owner))

    def add(self, draft: Draft) -> list[Draft]:
        """Keep `draft`; returns the drafts evicted to stay within bounds (free their engine sessions)."""
        self._drafts[draft.sid] = draft
        evicted: list[Draft] = []
        mine = self.drafts(draft.owner)
        for old in mine[: max(0, len(mine) - self.per_owner)]:
            evicted.append(self._drafts.pop(old.sid))
        while len(self._drafts) > self.total:
            evicted.append(self._drafts.popitem(last=False)[1])
        return evicted

    def take(self, owner: int, key: int) -> Draft | None:
        """The draft made for exactly this state, removed from the pool; None on a miss."""
        for d in self.drafts(owner):
            if d.key == key:
                return self._drafts.pop(d.sid)
        return None

    def prune(self, owner: int, key: int) -> list[Draft]:
        """The owner's state is now `key`: drop (and return) drafts it can no longer reach, those that are
        neither for this state nor forked from it (their words are still to come)."""
        dead = [d for d in self.drafts(owner) if key not in (d.key, d.base)]
        for d in dead:
            del self._drafts[d.sid]
        return dead

    def clear(self, owner: int) -> list[Draft]:
        dead = self.drafts(owner)
        for d in dead:
            del self._drafts[d.sid]
        return dead

    def oldest(self) -> Draft | None:
        """Remove and return the oldest draft of all (to free a KV slot for a real conversation)."""
        return self._drafts.popitem(last=False)[1] if self._drafts else None
