"""Events the session core emits. Frozen, past tense, times in stream seconds (`_s`) unless named."""

from __future__ import annotations

from dataclasses import dataclass

from duplexd.errors import ErrorCode


@dataclass(frozen=True, slots=True)
class Word:
    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class FrameAcked:
    seq: int
    lag_ms: float
    max_lag_ms: float  # worst lag of any frame since the previous ack


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    t_s: float


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    t_s: float


@dataclass(frozen=True, slots=True)
class TranscriptUpdated:
    """Partial transcript of the current utterance: `words[:committed]` are final, the rest may change.
    `unsure`: how many of the last words a display holds back (a word at the end of the audio decoded that
    may be cut off mid-way, or a phrase the decoder repeated there); the listener's own stages (drafts,
    barge-in) read them all."""

    utterance: int
    words: tuple[Word, ...]
    committed: int
    unsure: int = 0

    @property
    def shown(self) -> tuple[Word, ...]:
        """The words a client is sent."""
        return self.words[: len(self.words) - self.unsure]

    @property
    def text(self) -> str:
        return " ".join(w.text for w in self.shown)


@dataclass(frozen=True, slots=True)
class UtteranceFinalized:
    """The utterance's words, committed. `continues`: the speaker went on after a pause that finalized
    utterance `continues`, and this one follows it in the same sentence; `previous`: that utterance's words
    as they read joined with this one (its last word's punctuation decided with what followed: "best." ->
    "best"), None when unchanged."""

    utterance: int
    words: tuple[Word, ...]
    continues: int | None = None
    previous: tuple[Word, ...] | None = None

    @property
    def text(self) -> str:
        return " ".join(w.text for w in self.words)


@dataclass(frozen=True, slots=True)
class TurnEnded:
    """The endpointer closed the user's turn `turn`: `text` is all of it, `eos_s` where the speech ended."""

    turn: int
    text: str
    eos_s: float
    silence_ms: float
    p_end: float | None
    p_audio: float | None = None  # how finished the speech sounded (the acoustic end-of-turn model)


@dataclass(frozen=True, slots=True)
class TurnContinued:
    """The user went on: turn `turn` had not ended. They spoke again within `turn.continue_turn_ms` of its
    end and their words interrupted its reply, which is withdrawn (the LLM forgets it, and the turn's
    close); `text`, the turn's words so far, opens the next turn, whose `turn.ended` carries all of it."""

    turn: int
    text: str


@dataclass(frozen=True, slots=True)
class ReplyStarted:
    reply: int


@dataclass(frozen=True, slots=True)
class ReplyRelayed:
    """`dialog.mode = "relay"`: the reply's first words, `text`, are the local model's (`model`), decided
    `decided_ms` after it began the reply (at the turn's end, or at the pause for a draft); the rest of the
    reply is the remote model's (`remote_model`) continuation of them. Empty `text`: all of it is."""

    reply: int
    text: str
    model: str
    remote_model: str
    decided_ms: float


@dataclass(frozen=True, slots=True)
class ReplyToolCalled:
    """The reply called a tool: `name` with `arguments` (JSON text), call `call_id`. A server-side tool's
    (`server`: its MCP server's label) comes with its result (`output`, `error`, `elapsed_ms`: from the
    call's start to its result; `early`: started during the user's turn, by a draft made at a pause);
    a client's (`server` "") has none: the client runs it and gives the result back."""

    reply: int
    call_id: str
    name: str
    arguments: str
    server: str = ""
    output: str | None = None
    error: bool = False
    elapsed_ms: float = 0.0
    early: bool = False
    waited_ms: float = 0.0  # how long the reply waited for the result (0: ready when the reply needed it)


@dataclass(frozen=True, slots=True)
class ReplySpeculation:
    """How speculative listening served a reply: drafts made while the user paused, and whether one was
    exactly this reply's start (`hit`: its `draft_tokens` were ready when the turn ended)."""

    reply: int
    drafts: int
    hit: bool
    draft_tokens: int


@dataclass(frozen=True, slots=True)
class ReplyDelta:
    reply: int
    text: str


@dataclass(frozen=True, slots=True)
class ReplyDone:
    reply: int
    text: str
    audio_ms: float


@dataclass(frozen=True, slots=True)
class ReplyPaused:
    """Speech over the reply: its audio stops at once, `played_ms` into it (the server's estimate of where
    the client is), until it is interrupted (`ReplyInterrupted`) or resumes (`ReplyResumed`)."""

    reply: int
    played_ms: float


@dataclass(frozen=True, slots=True)
class ReplyResumed:
    """No words came of the sound that paused the reply (a cough, a backchannel, noise): it plays on from
    where it paused, `paused_ms` later."""

    reply: int
    paused_ms: float


@dataclass(frozen=True, slots=True)
class ReplyInterrupted:
    """The reply stopped; only `heard_text` (the first `heard_ms` of its audio) stays in the conversation."""

    reply: int
    heard_ms: float
    heard_text: str
    reason: str  # "barge_in" | "cancel" | "session_end"
    by: str = ""  # barge_in: the words over the reply that counted as the user talking


@dataclass(frozen=True, slots=True)
class ErrorRaised:
    """A non-fatal problem the client should hear about (the session goes on)."""

    code: ErrorCode
    message: str


Event = (
    FrameAcked
    | SpeechStarted
    | SpeechStopped
    | TranscriptUpdated
    | UtteranceFinalized
    | TurnEnded
    | TurnContinued
    | ReplyStarted
    | ReplySpeculation
    | ReplyRelayed
    | ReplyToolCalled
    | ReplyDelta
    | ReplyDone
    | ReplyPaused
    | ReplyResumed
    | ReplyInterrupted
    | ErrorRaised
)
