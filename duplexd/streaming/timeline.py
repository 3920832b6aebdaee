"""When each part of a turn happened, as a user hears it: end of speech, turn ended, first reply token, first
reply audio (pure: the shell passes the times in).

The parts are what voice-agent operators compare (LiveKit and pipecat report the same breakdown): turn
detection (end of speech -> turn ended), first token (turn ended -> the reply's first token), first audio
(first token -> the reply's first audio ready to send), and their sum, voice to voice.

    timeline.turn_ended(turn=3, text="what time is it", eos_at=t - 0.8, now=t)
    timeline.reply_started(reply=3)
    timeline.token(reply=3, text="It", now=t + 0.1)
    done = timeline.audio(reply=3, now=t + 0.3)      # -> the turn's timing, once, when its first audio is ready
    ended = timeline.reply_ended(reply=3, text="It is noon.")   # -> the timing to log, once
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_WORDS = 12  # of the user's turn and of the reply, in the log line


@dataclass(slots=True)
class TurnTiming:
    turn: int
    user_text: str
    eos_at: float
    ended_at: float
    reply: int | None = None
    first_token_at: float | None = None
    first_audio_at: float | None = None
    reply_text: str = ""

    @property
    def turn_detection_s(self) -> float:
        return max(0.0, self.ended_at - self.eos_at)

    @property
    def first_token_s(self) -> float | None:
        return None if self.first_token_at is None else max(0.0, self.first_token_at - self.ended_at)

    @property
    def first_audio_s(self) -> float | None:
        if self.first_audio_at is None or self.first_token_at is None:
            return None
        return max(0.0, self.first_audio_at - self.first_token_at)

    @property
    def voice_to_voice_s(self) -> float | None:
        return None if self.first_audio_at is None else max(0.0, self.first_audio_at - self.eos_at)

    def summary(self) -> str:
        """One line for an operator: the words both ways and where the time went."""

        def s(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}s"

        return (
            f"turn {self.turn}: {_first_words(self.user_text)!r} -> {_first_words(self.reply_text)!r} | "
            f"end of speech -> turn ended {s(self.turn_detection_s)} -> first token {s(self.first_token_s)} "
            f"-> first audio {s(self.first_audio_s)} (voice to voice {s(self.voice_to_voice_s)})"
        )

    def fields(self) -> dict[str, object]:
        """The same, as structured log fields (`--log-json`)."""

        def r(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {
            "turn": self.turn,
            "reply": self.reply,
            "user_text": self.user_text,
            "reply_text": self.reply_text,
            "turn_detection_s": r(self.turn_detection_s),
            "first_token_s": r(self.first_token_s),
            "first_audio_s": r(self.first_audio_s),
            "voice_to_voice_s": r(self.voice_to_voice_s),
        }


def _first_words(text: str) -> str:
    words = text.split()
    return " ".join(words[:FIRST_WORDS]) + (" ..." if len(words) > FIRST_WORDS else "")


class Timeline:
    """The latest turn of one conversation (one at a time: a new turn replaces an unanswered one)."""

    def __init__(self) -> None:
        self._timing: TurnTiming | None = None

    def turn_ended(self, turn: int, text: str, eos_at: float, now: float) -> None:
        self._timing = TurnTiming(turn, text, min(eos_at, now), now)

    def reply_started(self, reply: int) -> None:
        if self._timing is not None and self._timing.reply is None:
            self._timing.reply = reply

    def token(self, reply: int, text: str, now: float) -> None:
        t = self._of(reply)
        if t is not None:
            if t.first_token_at is None:
                t.first_token_at = now
            t.reply_text += text

    def audio(self, reply: int, now: float) -> TurnTiming | None:
        """The reply's audio is ready to send: returns the timing the first time (all four points known)."""
        t = self._of(reply)
        if t is None or t.first_audio_at is not None or t.first_token_at is None:
            return None
        t.first_audio_at = max(now, t.first_token_at)
        return t

    def reply_ended(self, reply: int, text: str | None = None) -> TurnTiming | None:
        """The reply is done or interrupted (`text`: its whole text, if known): returns its timing, once."""
        t = self._of(reply)
        if t is None:
            return None
        if text is not None:
            t.reply_text = text
        self._timing = None
        return t

    def _of(self, reply: int) -> TurnTiming | None:
        t = self._timing
        return t if t is not None and t.reply == reply else None
