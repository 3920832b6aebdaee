"""LocalAgreement-n: commit the words on which the last n window hypotheses agree."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence

from duplexd.streaming.events import Word

_STRIP = re.compile(r"[^\w']+")
_DEDUP_MAX_WORDS = 5
_TIME_TOLERANCE_S = 0.1


def norm(text: str) -> str:
    """Compare words without case or punctuation ("Americans," == "americans")."""
    return _STRIP.sub("", text.lower())


class LocalAgreement:
    """Commits the longest common prefix of the last `n` hypotheses (after what is already committed).

    Each hypothesis is a window pass's words in stream time. Words that start before the committed end
    (minus a small tolerance) are ignored, and a re-recognised tail of committed words at the hypothesis'
    head (up to 5 words, compared as n-grams) is dropped, so a word is never committed twice.
    """

    def __init__(self, n: int = 2) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        self._n = n
        self._previous: deque[list[Word]] = deque(maxlen=n - 1)
        self._tentative: list[Word] = []
        self._committed_tail: deque[Word] = deque(maxlen=_DEDUP_MAX_WORDS)
        self.committed_end_s = 0.0

    @property
    def tentative(self) -> list[Word]:
        """The latest hypothesis' words not committed yet."""
        return list(self._tentative)

    def insert(self, words: Sequence[Word]) -> list[Word]:
        """Feed one hypothesis; returns the words it commits (possibly none)."""
        fresh = self._new_words(words)
        hypotheses = [*self._previous, fresh]
        committed: list[Word] = []
        if len(hypotheses) >= self._n:
            for i, word in enumerate(fresh):
                if all(len(h) > i and norm(h[i].text) == norm(word.text) for h in hypotheses):
                    committed.append(word)
                else:
                    break
        k = len(committed)
        self._tentative = fresh[k:]  # before the loop below trims `fresh` itself (it joins _previous when n >= 2)
        self._previous.append(fresh)
        for h in self._previous:
            del h[:k]
        self._remember(committed)
        return committed

    def commit_all(self) -> list[Word]:
        """Commit the latest hypothesis as it stands (the audio is final: no further pass will come)."""
        return self.commit_until(float("inf"))

    def commit_until(self, t_s: float) -> list[Word]:
        """Commit the latest hypothesis' leading words that end by `t_s`, agreed or not (forced)."""
        k = 0
        while k < len(self._tentative) and self._tentative[k].end_s <= t_s:
            k += 1
        committed = self._tentative[:k]
        self._remember(committed)
        self._tentative = self._tentative[k:]
        self._previous.clear()
        return committed

    def reset(self) -> None:
        """Forget hypotheses (not the committed end): a new stretch of audio starts."""
        self._previous.clear()
        self._tentative = []

    def _remember(self, committed: list[Word]) -> None:
        self._committed_tail.extend(committed)
        if committed:
            self.committed_end_s = committed[-1].end_s

    def _new_words(self, words: Sequence[Word]) -> list[Word]:
        fresh = [w for w in words if w.start_s > self.committed_end_s - _TIME_TOLERANCE_S]
        if fresh and self._committed_tail and abs(fresh[0].start_s - self.committed_end_s) < 1.0:
            tail = [norm(w.text) for w in self._committed_tail]
            for size in range(min(len(tail), len(fresh), _DEDUP_MAX_WORDS), 0, -1):
                if tail[-size:] == [norm(w.text) for w in fresh[:size]]:
                    fresh = fresh[size:]
                    break
        return fresh
