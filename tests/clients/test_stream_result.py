"""The client's reading of a stream's finals."""

from __future__ import annotations

from typing import Any

from duplexd.clients.stream import Received, Sentences, StreamResult


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


def lines(events: list[tuple[float, dict[str, Any]]], hold_s: float = 2.0) -> list[str]:
    """What `duplexd stream` prints into a pipe for these (time, event)s, and what it still held at the end."""
    sentences = Sentences(hold_s)
    printed = [f"{t}: {text}" for t, e in events for text in sentences.feed(Received(t, e))]
    return printed + [f"end: {text}" for text in sentences.flush()]


def vad(kind: str) -> dict[str, Any]:
    return {"type": f"vad.speech_{kind}"}


def partial(utterance: int, text: str) -> dict[str, Any]:
    return {"type": "transcript.partial", "utterance": utterance, "text": text}


def ack() -> dict[str, Any]:
    return {"type": "frame.ack"}


def test_a_pipe_gets_one_line_for_an_utterance_and_the_ones_that_continue_it() -> None:
    # JFK: "And so my fellow Americans" | "ask not what your country can do for you" | "ask what you can do
    # for your country.", each pause a breath: one line, the repaired ends in it, once it is over.
    said = [
        (0.0, vad("started")),
        (2.9, vad("stopped")),
        (3.2, final(1, "And so my fellow Americans.").event),
        (3.4, vad("started")),  # (speech resumed before the final came)
        (
            6.0,
            final(
                2, "ask not what your country can do for you.", continues=1, previous_text="And so my fellow Americans"
            ).event,
        ),
        (6.1, vad("stopped")),
        (6.5, vad("started")),
        (6.9, partial(3, "ask what")),
        (8.9, vad("stopped")),
        (
            9.1,
            final(
                3,
                "ask what you can do for your country.",
                continues=2,
                previous_text="ask not what your country can do for you",
            ).event,
        ),
        (10.0, ack()),
        (11.2, ack()),  # 2.1 s after the last final, no speech since: nothing can continue it now
        (11.3, final(4, "Thank you.").event),
    ]
    assert lines(said) == [
        "11.2: And so my fellow Americans ask not what your country can do for you ask what you can do for your "
        "country.",
        "end: Thank you.",
    ]


def test_a_line_is_held_while_speech_that_may_continue_it_goes_on() -> None:
    said = [(1.0, final(1, "Hello.").event), (1.5, vad("started")), (4.0, ack()), (5.0, vad("stopped")), (6.9, ack())]
    assert lines(said) == ["end: Hello."]  # (1.9 s after the speech stopped: it could still be continued)
    said += [(7.0, ack())]
    assert lines(said) == ["7.0: Hello."]
    # A later utterance shown (its speech over): its final decides whether it goes on with the line.
    said = [(1.0, final(1, "Hello.").event), (1.2, partial(2, "again")), (4.0, ack())]
    assert lines(said) == ["end: Hello."]


def test_a_final_that_does_not_continue_the_line_starts_its_own() -> None:
    said = [(1.0, final(1, "Hello.").event), (1.5, final(2, "Again.").event), (1.6, final(3, "").event)]
    said += [(1.7, final(4, "And again.").event), (1.8, {"type": "session.ended"})]
    assert lines(said) == ["1.5: Hello.", "1.6: Again.", "1.8: And again."]  # (an utterance with no words: nothing)
    # A join that changed nothing keeps the text before; one with no words adds none.
    said = [(1.0, final(1, "Sunday is the best.").event), (1.5, final(2, "Really.", continues=1).event)]
    said += [(1.6, final(3, "", continues=2).event), (1.7, final(4, "Truly.", continues=3).event)]
    assert lines(said) == ["end: Sunday is the best. Really. Truly."]
