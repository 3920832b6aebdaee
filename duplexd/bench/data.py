"""The text metrics used on the speech evaluation set (the set itself: `clients.clips`)."""

from __future__ import annotations

import re

from duplexd.clients.clips import load_clips as load_clips  # (re-exported: bench/replies.py loads it from here)
from duplexd.streaming.numbers import spoken

_PUNCT = re.compile(r"[^\w\s']")
_SPACES = re.compile(r"\s+")


def normalize(text: str) -> list[str]:
    """Lowercase words without punctuation (hyphens split words): 'Mr. Quilter's' -> ['mr', "quilter's"]."""
    text = _PUNCT.sub(" ", text.lower().replace("-", " "))
    return [w.strip("'") for w in _SPACES.split(text) if w.strip("'")]


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    """Word-level Levenshtein distance (substitutions + deletions + insertions)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i]
        for j, h in enumerate(hyp, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h)))
        prev = cur
    return prev[-1]


def as_said(text: str) -> list[str]:
    """`normalize`, with numbers as said ("In 1813, 8." -> in eighteen thirteen eight): the LJ Speech and
    LibriSpeech references spell numbers out, Whisper writes them either way (as its prompt leans), and
    neither is a word misheard (Whisper's own evaluations normalize numbers the other way, to digits)."""
    return spoken(normalize(text))


def wer(refs: list[str], hyps: list[str]) -> float:
    """Corpus WER: total edits over total reference words, both `as_said`."""
    errors = words = 0
    for ref, hyp in zip(refs, hyps, strict=True):
        r = as_said(ref)
        errors += edit_distance(r, as_said(hyp))
        words += len(r)
    return errors / max(words, 1)
