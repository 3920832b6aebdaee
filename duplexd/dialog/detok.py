"""A reply's text token by token, without decoding every prefix.

`decode(tokens[:k])` for every k of a reply costs O(n²) over the reply. `ReplyText` keeps the text through
an *anchor* token (where the decoded text ends on a whole character), and decodes only the tokens since a
little before it: the text through token k is the anchor's text plus what the tokens after the anchor add
to the decoded window. The few tokens before the anchor give the decoder its context (a SentencePiece
decoder drops the leading space of a window's first token; a byte-level one needs whole characters), and
the result is checked: where the window's text does not extend its context's, the whole prefix is decoded.
So `text(k) == decode(tokens[:k])` always; the cost is O(window) per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

__all__ = ["ReplyText"]

_CONTEXT = 4  # tokens decoded before the anchor
_ANCHOR_EVERY = 8  # tokens between anchors (a clean one: the text does not end inside a character)
_PARTIAL = "\ufffd"  # what a decoder gives for a character whose bytes are not all in yet


class ReplyText:
    """The decoded text of a growing token list; `decode` is the tokenizer's (ids -> str)."""

    __slots__ = ("_anchor", "_anchor_text", "_context", "_context_text", "_decode", "text", "tokens")

    def __init__(self, decode: Callable[[Sequence[int]], str], tokens: Iterable[int] = ()) -> None:
        self._decode = decode
        self.tokens: list[int] = []
        self.text = ""
        self._anchor = 0  # the text through token `_anchor` is `_anchor_text`, ending on a whole character
        self._anchor_text = ""
        self._context = 0  # where the decoded window starts (<= _anchor)
        self._context_text = ""  # decode(tokens[_context:_anchor])
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def peek(self, token: int) -> str:
        """The text if `token` came next (the state does not change)."""
        return self._text_of([*self.tokens[self._context :], token])

    def append(self, token: int) -> str:
        """Take the next token; its text (the whole reply's)."""
        self.tokens.append(token)
        self.text = self._text_of(self.tokens[self._context :])
        if len(self.tokens) - self._anchor >= _ANCHOR_EVERY and not self.text.endswith(_PARTIAL):
            self._anchor, self._anchor_text = len(self.tokens), self.text
            self._context = max(0, self._anchor - _CONTEXT)
            self._context_text = self._decode(self.tokens[self._context : self._anchor])
        return self.text

    def extend(self, tokens: Iterable[int]) -> list[str]:
        """Take tokens; the text through each of them."""
        return [self.append(t) for t in tokens]

    def _text_of(self, window: list[int]) -> str:
        decoded = self._decode(window)
        if decoded.startswith(self._context_text):
            return self._anchor_text + decoded[len(self._context_text) :]
        return self._decode([*self.tokens[: self._context], *window])  # (rare: decode it all)
