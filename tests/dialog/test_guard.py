"""The reply guard's rules on tiny literal inputs (`dialog/guard.py`), and its knobs' validation."""

from __future__ import annotations

import pytest

from duplexd.config import DialogConfig
from duplexd.dialog.engine import EngineConfig
from duplexd.dialog.guard import banned_tokens, reply_end, sentences
from duplexd.dialog.remote import RemoteConfig


@pytest.mark.parametrize(
    ("reply", "turn", "reply_n", "turn_n", "banned"),
    [
        ([1, 2, 3, 1, 2], [], 3, 0, {3}),  # "1 2" was followed by 3: 3 would repeat the 3-gram
        ([1, 2, 3, 1, 2], [], 4, 0, set()),  # "3 1 2" never came before
        ([1, 2, 1, 2, 1], [], 2, 0, {2}),
        ([5, 1, 2], [7, 1, 2, 9, 1, 2, 8], 0, 3, {9, 8}),  # copying the user's "1 2 9" or "1 2 8"
        ([5, 1, 2], [7, 1, 2, 9], 3, 3, {9}),
        ([1], [1, 2, 3], 0, 3, set()),  # the key is the reply's own last n-1 tokens: none yet
        ([], [1, 2], 0, 2, set()),
        ([1, 2, 3, 1, 2], [1, 2, 4], 0, 0, set()),  # both rules off
    ],
)
def test_banned_tokens(reply: list[int], turn: list[int], reply_n: int, turn_n: int, banned: set[int]) -> None:
    assert banned_tokens(reply, turn, reply_n, turn_n) == banned


def test_sentences_end_at_punctuation_and_whitespace_or_a_new_line() -> None:
    text = 'Mr. Smith paid $3.50 (e.g. cash). "Really?" Yes.\n\nBoil: water'
    done, current = sentences(text)
    assert [text[:end] for end, _ in done] == [
        "Mr. Smith paid $3.50 (e.g. cash).",
        'Mr. Smith paid $3.50 (e.g. cash). "Really?"',
        'Mr. Smith paid $3.50 (e.g. cash). "Really?" Yes.',
    ]
    assert text[current:] == "Boil: water"
    assert sentences("Paris. ")[0] == [(6, 7)] and sentences("Paris.")[0] == []  # (".": maybe "3.5")


LOOP = "a creature of the sea, a creature of the sea, a creature"


@pytest.mark.parametrize(
    ("before", "piece", "max_sentences", "keep"),
    [
        ("Paris is big. It is old", ".", 2, None),  # the sentence may go on ("old.5"?): not complete yet
        ("Paris is big. It is old.", " It", 2, len("Paris is big. It is old.")),  # ends before " It"
        ("Paris is big. It is old.", " It", 3, None),
        ("Paris is big. It is old.", " It", 0, None),
        ("Paris is big", ".\n", 1, len("Paris is big.")),  # a piece that ends the sentence is kept
        ("Hi. I'm glad you're happy. I'm glad", " you're", 0, len("Hi. I'm glad you're happy. I'm glad")),  # a repeat
        ("Hi. I'm glad you're happy. I'm glad", " to", 0, None),
        ("Yes. No. Yes", ",", 0, None),  # one-word sentences may recur
        ("Boil an egg:\n\nBoil:\n\nBoil", ":", 0, None),
        ("Boil it well:\nBoil it", " well", 0, len("Boil it well:\nBoil it")),  # a line repeats
        ("a creature of the sea, a creature of the sea, a creature", " of", 0, len(LOOP)),  # a 3-gram's third time
        ("a creature of the sea, a creature of the land, a creature", " with", 0, None),
    ],
)
def test_reply_end(before: str, piece: str, max_sentences: int, keep: int | None) -> None:
    assert reply_end(before, before + piece, max_sentences) == keep


def test_the_knobs_are_validated_and_reach_both_backends() -> None:
    for name, bad in [("max_reply_sentences", -1), ("no_repeat_ngram_tokens", 1), ("no_copy_ngram_tokens", -2)]:
        with pytest.raises(ValueError, match=f"dialog.{name}"):
            DialogConfig(**{name: bad})
    with pytest.raises(ValueError, match="no_repeat_ngram_tokens"):
        EngineConfig(no_repeat_ngram_tokens=1)
    with pytest.raises(ValueError, match="max_reply_sentences"):
        RemoteConfig(url="http://h/v1", model="m", max_reply_sentences=-1)
    config = DialogConfig(max_reply_sentences=3, no_repeat_ngram_tokens=0, no_copy_ngram_tokens=5)
    engine = EngineConfig.from_config(config)
    assert (engine.max_reply_sentences, engine.no_repeat_ngram_tokens, engine.no_copy_ngram_tokens) == (3, 0, 5)
    remote = RemoteConfig.from_config(DialogConfig(backend="remote", remote_url="http://h/v1", max_reply_sentences=1))
    assert remote.max_reply_sentences == 1
