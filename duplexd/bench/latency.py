"""Word latencies from a client's view: when a word was first shown, and when it was committed.

Latency of a word = arrival time of the first event showing it minus the wall time at which the word's
end (by offline word timestamps) was sent. Streamed and offline words are aligned by their text.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass

from duplexd.asr.commit import norm
from duplexd.clients.stats import percentile as percentile  # (re-exported: bench/replies.py imports it from here)
from duplexd.clients.stream import StreamResult
from duplexd.events import Word


@dataclass(frozen=True, slots=True)
class WordTiming:
    text: str
    audio_end_s: float  # offline end time, in stream time
    partial_latency_s: float
    commit_latency_s: float


def _first_seen(result: StreamResult) -> list[tuple[str, float, float]]:
    """Final words in order, each with the arrival time it was first shown and first committed."""
    shown: dict[tuple[int, int], tuple[str, float]] = {}
    committed: dict[tuple[int, int], float] = {}
    out: list[tuple[str, float, float]] = []
    for got in result.events:
        ev = got.event
        kind = ev.get("type")
        if kind not in ("transcript.partial", "transcript.final"):
            continue
        u = ev["utterance"]
        n_committed = ev.get("committed", len(ev["words"])) if kind == "transcript.partial" else len(ev["words"])
        for i, w in enumerate(ev["words"]):
            key = (u, i)
            seen = shown.get(key)
            if seen is None or seen[0] != norm(w["w"]):
                shown[key] = (norm(w["w"]), got.t)
            if i < n_committed and key not in committed:
                committed[key] = got.t
        if kind == "transcript.final":
            for i, w in enumerate(ev["words"]):
                out.append((norm(w["w"]), shown[(u, i)][1], committed[(u, i)]))
    return out


def aligned(streamed: list[str], offline: list[Word]) -> Iterator[tuple[int, Word]]:
    """(index in `streamed`, offline word) for every streamed word that matches the offline transcript
    (normalized words, longest matching runs in order)."""
    matcher = difflib.SequenceMatcher(a=[norm(w) for w in streamed], b=[norm(w.text) for w in offline], autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            yield block.a + k, offline[block.b + k]


def word_timings(result: StreamResult, offline: list[Word]) -> list[WordTiming]:
    streamed = _first_seen(result)
    timings = []
    for i, word in aligned([s[0] for s in streamed], offline):
        text, shown_t, committed_t = streamed[i]
        sent_t = result.started_at + word.end_s / result.speed
        timings.append(WordTiming(text, word.end_s, shown_t - sent_t, committed_t - sent_t))
    return timings
