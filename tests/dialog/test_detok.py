"""`ReplyText` gives, at every token, exactly what decoding the whole prefix gives."""

from __future__ import annotations

import random

import pytest
from gguf import GGUFReader
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from duplexd.dialog.detok import ReplyText
from duplexd.dialog.gguf_weights import ChatTokenizer, read_tokenizer

TEXTS = [
    "Sure! The weather in Zürich is 12 °C — rather mild for December. Anything else?",
    "日本語も話せます。東京の天気は晴れです。🙂 Shall I go on?",
    "Numbers: 3.14159, 2,718 and 1e-9.\n\nA new line, then 'quotes' and \"double\" ones…",
    "emoji in a row 👩‍👩‍👧‍👦🎉🚀 and accents: café, naïve, über.",
]


@pytest.fixture(scope="module")
def smol_tokenizer(reader: GGUFReader) -> ChatTokenizer:
    return read_tokenizer(reader)


def _check(decode, tokens: list[int]) -> None:
    text = ReplyText(decode)
    for k, token in enumerate(tokens, 1):
        expected = decode(tokens[:k])
        assert text.peek(token) == expected, (k, tokens[:k])
        assert text.append(token) == expected, (k, tokens[:k])
    assert ReplyText(decode, tokens).text == decode(tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_every_prefix_of_a_real_reply(smol_tokenizer: ChatTokenizer, text: str) -> None:
    _check(smol_tokenizer.decode, smol_tokenizer.encode(text))


def test_random_tokens_split_characters_and_specials(smol_tokenizer: ChatTokenizer) -> None:
    """Byte tokens that split characters (and leave some unfinished), special tokens in the middle."""
    rng = random.Random(7)
    multibyte = [t for t in range(smol_tokenizer.tokenizer.get_vocab_size()) if "\ufffd" in smol_tokenizer.decode([t])]
    assert multibyte  # (a byte-level vocabulary has tokens that are part of a character)
    for _ in range(40):
        tokens = [
            rng.choice(multibyte) if rng.random() < 0.4 else rng.randrange(smol_tokenizer.tokenizer.get_vocab_size())
            for _ in range(rng.randrange(1, 60))
        ]
        _check(smol_tokenizer.decode, tokens)


def test_a_sentencepiece_decoder_that_drops_a_windows_leading_space() -> None:
    """Metaspace decoders strip the first token's space: a window decoded alone would lose it."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁how": 4, "▁are": 5, "▁you": 6, "?": 7, "▁I": 8}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()

    def decode(ids):
        return tok.decode(list(ids))

    assert decode([2]) == "world" and decode([1, 2]) == "Hello world"
    rng = random.Random(3)
    for _ in range(30):
        _check(decode, [rng.randrange(1, len(vocab)) for _ in range(rng.randrange(1, 40))])
