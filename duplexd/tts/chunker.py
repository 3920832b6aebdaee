"""Cut streaming reply text into pieces for TTS. Pure.

The first piece is cut early (a clause end, or after `first_words` words) so speech starts on the first
few words of a reply instead of its first full sentence; later pieces end at sentence or clause
punctuation, which is where a synthesizer's prosody wants them cut, or at a word limit that doubles
from piece to piece up to `max_words` (so the audio of the short first pieces does not run out while a
long clause is still being generated).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CLAUSE_END = re.compile(r"[.!?;:,…](?=[\s\"'”’)\]]*$)")


@dataclass(slots=True)
class TextChunker:
    first_words: int = 3
    min_words: int = 3  # later pieces: at least this many words before a clause-punctuation cut
    max_words: int = 24
    _pending: str = ""
    _pieces: int = 0

    def push(self, delta: str) -> list[str]:
        """Add reply text; returns the pieces that are now complete (whole words only)."""
        self._pending += delta
        out: list[str] = []
        while (piece := self._cut()) is not None:
            out.append(piece)
        return out

    def flush(self) -> list[str]:
        """The reply is over: whatever is left is the last piece."""
        rest, self._pending = self._pending.strip(), ""
        if not rest:
            return []
        self._pieces += 1
        return [rest]

    def _cut(self) -> str | None:
        # Words that are certainly complete: those followed by whitespace.
        text = self._pending
        spans = [m.span() for m in re.finditer(r"\S+(?=\s)", text)]
        wanted = self.first_words if self._pieces == 0 else self.min_words
        limit = min(self.max_words, self.first_words << self._pieces)
        for i, (_, end) in enumerate(spans):
            n = i + 1
            at_clause = _CLAUSE_END.search(text[:end]) is not None
            if (at_clause and (self._pieces == 0 or n >= wanted)) or n >= limit:
                piece, self._pending = text[:end].strip(), text[end:]
                self._pieces += 1
                return piece or None
        return None
