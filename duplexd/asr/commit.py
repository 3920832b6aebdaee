"""LocalAgreement-n: commit the words on which the last n window hypotheses agree."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence

from duplexd.events import Word

_STRIP = re.compile(r"[^\w']+")
_DEDUP_MAX_WORDS = 5
_TIME_TOLERANCE_S = 0.1
_EPSILON_S = 1e-9
_ALIGN_REACH = 3  # words either side of the time cut searched for the committed tail
_ALIGN_MAX_SHIFT_S = 0.3  # a committed word found again "in place" starts at most this far from where it was


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
        """The hypothesis after what is already committed.

        First by time (words starting after the committed end, less a tolerance), then by text: the
        committed tail (an n-gram of up to 5 words) found near that point moves the cut to just after it.
        Word timestamps jitter between passes by more than any fixed tolerance, so the text decides where it
        can: a word whose start moved before the committed end is kept when the committed words before it
        are found in place, and a committed word recognised again is not committed twice.
        """
        cut = 0
        # (`_EPSILON_S`: a start exactly the tolerance before the committed end is cut, whatever float rounding
        # made of the subtraction: 10.05 vs 10.15 - 0.1 = 10.049999..., and one word was committed twice)
        while cut < len(words) and words[cut].start_s <= self.committed_end_s - _TIME_TOLERANCE_S + _EPSILON_S:
            cut += 1
        if not self._committed_tail:
            return list(words[cut:])
        tail = list(self._committed_tail)
        tail_text = [norm(w.text) for w in tail]
        text = [norm(w.text) for w in words]
        time_cut = cut
        for size in range(min(len(tail), _DEDUP_MAX_WORDS), 0, -1):
            found = []
            for j in range(max(0, time_cut - _ALIGN_REACH), min(len(words) - size, time_cut + _ALIGN_REACH) + 1):
                if text[j : j + size] != tail_text[-size:]:
                    continue
                # The committed tail said again right at the time cut (with any timestamps): skip it.
                again = j == time_cut and abs(words[j].start_s - self.committed_end_s) < 1.0
                # The committed tail found in place (each word within the jitter bound): cut after it, which
                # may re-admit a following word whose start jittered before the committed end.
                in_place = size >= 2 and all(
                    abs(words[j + i].start_s - w.start_s) <= _ALIGN_MAX_SHIFT_S for i, w in enumerate(tail[-size:])
                )
                if again or in_place:
                    found.append(j)
            if found:
                cut = min(found, key=lambda j: abs(j - time_cut)) + size
                break
        return list(words[cut:])
