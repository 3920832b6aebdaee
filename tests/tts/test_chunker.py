"""The TTS text chunker: early first piece, clause-sized later pieces, nothing lost or split mid-word."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from duplexd.tts.chunker import TextChunker


def _feed(chunker: TextChunker, deltas: list[str]) -> list[str]:
    pieces = []
    for d in deltas:
        pieces += chunker.push(d)
    return pieces + chunker.flush()


def test_first_piece_after_first_words_then_clauses() -> None:
    c = TextChunker(first_words=3, min_words=3, max_words=24)
    text = "Paris is the capital of France, and it is known for the Eiffel Tower. Anything else?"
    pieces = _feed(c, [t + " " for t in text.split(" ")])
    assert pieces[0] == "Paris is the"
    assert pieces[1] == "capital of France,"
    assert pieces[2] == "and it is known for the Eiffel Tower."
    assert pieces[3] == "Anything else?"


def test_first_piece_cut_at_an_early_clause_end() -> None:
    c = TextChunker(first_words=3)
    assert c.push("Sure, ") == ["Sure,"]


def test_no_piece_before_a_word_is_complete() -> None:
    c = TextChunker(first_words=1)
    assert c.push("Hel") == []
    assert c.push("lo") == []  # "Hello" may still go on ("Hellos")
    assert c.push(" there") == ["Hello"]


def test_long_clauses_are_cut_at_a_limit_that_doubles_up_to_max_words() -> None:
    c = TextChunker(first_words=2, min_words=4, max_words=5)
    pieces = _feed(c, [" ".join(str(i) for i in range(1, 17)) + " "])
    assert [len(p.split()) for p in pieces] == [2, 4, 5, 5]


@given(st.lists(st.text(alphabet="ab ,.?", max_size=8), max_size=30), st.integers(1, 5))
def test_pieces_reassemble_the_text(deltas: list[str], first: int) -> None:
    c = TextChunker(first_words=first, min_words=2, max_words=6)
    pieces = _feed(c, deltas)
    assert " ".join(pieces).split() == "".join(deltas).split()
    assert all(p and p == p.strip() for p in pieces)
