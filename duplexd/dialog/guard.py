"""The reply guard: a spoken reply never loops, never copies the user's turn, and ends after a few sentences.

Small models loop ("a creature of the sea, a creature of the sea, ..."), echo what they were told ("The
birch canoe slid on the smooth planks." back for the same sentence) and run on for 160 tokens. Two pure
rules, applied wherever a reply's next token (or a remote server's next piece) is taken:

- `banned_tokens(reply, turn, ...)`: the tokens that would repeat an n-gram of the reply so far
  (`no_repeat_ngram_tokens`, as Hugging Face's `no_repeat_ngram_size`) or copy one of the user's turn
  (`no_copy_ngram_tokens`, as its `encoder_no_repeat_ngram_size`). The engine masks them before its
  argmax. The key is the reply's own last tokens, so a rule never fires across the turn boundary.
- `reply_end(before, after, max_sentences)`: whether a reply whose text is `before` should end rather
  than take the piece that makes it `after`, and how much text it keeps. It ends once `max_sentences`
  sentences are complete (keeping them, not the piece that starts the next one), and without the piece
  when the sentence in progress starts as an earlier sentence or line of the reply did (`REPEAT_WORDS`
  words, or the whole of a shorter one of at least two words) or a word 3-gram would occur a third time.

Both depend on nothing but the conversation's tokens or text, so a draft and the reply it becomes take
the same decisions at the same tokens (speculative listening stays lossless), whatever else is batched.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

__all__ = ["REPEAT_WORDS", "banned_tokens", "reply_end", "sentences"]

REPEAT_WORDS = 3  # a sentence that starts with an earlier sentence's first 3 words is its repeat
_LOOP_COUNT = 3  # a word 3-gram's third occurrence is a loop

# A sentence ends at . ! ? or … (closing quotes or brackets may follow) followed by whitespace, unless
# the word before is a single capital (an initial) or a usual abbreviation; a line ends at a newline.
_BOUNDARY = re.compile(
    r"(?<!\b[A-Z])(?<!\bMr)(?<!\bMs)(?<!\bDr)(?<!\bSt)(?<!\bMrs)(?<!\bvs)(?<!\be\.g)(?<!\bi\.e)"
    r"[.!?\u2026]+[\"'\u2019\u201d)\]]*\s+"
    r"|\n\s*"
)
_WORD = re.compile(r"[^\W_]+(?:['\u2019][^\W_]+)*")


def banned_tokens(reply: Sequence[int], turn: Sequence[int], reply_n: int, turn_n: int) -> set[int]:
    """Tokens that, as the reply's next one, would repeat a `reply_n`-gram of `reply` or copy a
    `turn_n`-gram of the user's `turn` (0: that rule is off)."""
    banned: set[int] = set()
    for tokens, n in ((reply, reply_n), (turn, turn_n)):
        if n < 1 or len(reply) < n - 1:
            continue
        key = tuple(reply[len(reply) - n + 1 :])
        for i in range(len(tokens) - n + 1):
            if tuple(tokens[i : i + n - 1]) == key:
                banned.add(tokens[i + n - 1])
    return banned


def sentences(text: str) -> tuple[list[tuple[int, int]], int]:
    """Where `text`'s complete sentences (or lines) end: (end of the sentence's text, end of the
    whitespace after it) for each, and where the sentence in progress starts."""
    done: list[tuple[int, int]] = []
    at = 0
    for m in _BOUNDARY.finditer(text):
        if text[at : m.end()].strip():
            done.append((len(text[: m.end()].rstrip()), m.end()))
        at = m.end()
    return done, at


def _words(text: str) -> list[str]:
    return [w.lower().replace("\u2019", "'") for w in _WORD.findall(text)]


def reply_end(before: str, after: str, max_sentences: int) -> int | None:
    """Should a reply whose text is `before` take the piece that makes it `after`? None: yes, and go on.
    Else the reply ends, keeping `after[:n]` for the returned n: through the end of its `max_sentences`-th
    sentence (0: no limit), or `before` when the piece would repeat an earlier sentence or a word 3-gram.
    (A token cannot be cut: the engine takes it when n > len(before), else ends before it.)"""
    done, current = sentences(after)
    if max_sentences and len(done) >= max_sentences:
        return done[max_sentences - 1][0]
    words = _words(after[current:])
    start = 0
    for _, end in done:
        earlier = _words(after[start:end])
        start = end
        need = min(REPEAT_WORDS, len(earlier))
        if need >= 2 and words[:need] == earlier[:need]:
            return len(before)
    every = _words(after)
    grams = Counter(tuple(every[i : i + 3]) for i in range(len(every) - 2))
    if grams and max(grams.values()) >= _LOOP_COUNT:
        return len(before)
    return None
