"""The client's reading of a stream's finals."""

from __future__ import annotations

from typing import Any

from duplexd.clients.stream import Received, StreamResult


def final(utterance: int, text: str, **extra: Any) -> Received:
    return Received(0.0, {"type": "transcript.final", "utterance": utterance, "text": text, **extra})


def test_a_continued_utterance_reads_as_one_sentence_with_the_one_it_follows() -> None:
    result = StreamResult("s", 0.0, 1.0)
    result.events += [final(1, "Hello."), final(2, "Sunday is the best.")]
    assert result.text == "Hello. Sunday is the best."
    result.events.append(final(3, "part of the week.", continues=2, previous_text="Sunday is the best"))
    assert result.text == "Hello. Sunday is the best part of the week."


def test_a_join_that_changed_nothing_keeps_the_text_before() -> None:
    result = StreamResult("s", 0.0, 1.0)
    result.events += [final(1, "Sunday is the best."), final(2, "Really.", continues=1)]
    assert result.text == "Sunday is the best. Really."


def test_an_utterance_that_ended_with_no_words_adds_nothing() -> None:
    result = StreamResult("s", 0.0, 1.0)
    result.events += [final(1, "Hello."), final(2, ""), final(3, "Again.")]
    assert result.text == "Hello. Again."
