"""The commands the conversation core gives the shell: to the dialog worker (`AppendUserText`,
`RetractUserText`, `StartReply`, `DraftReply`, `InterruptReply`, `ReplaceContext`, `SetTools`), to speech
synthesis (`Synthesize`, `PrefetchSpeech`) and to the audio output (`PlayAudio`, `EndAudio`, `StopAudio`). A
leaf module: every layer may import it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AppendUserText:
    text: str  # with its leading space where it continues the turn
    version: int  # the count of appends so far: a P(end of turn) is for the text of one version


@dataclass(frozen=True, slots=True)
class RetractUserText:
    """The recognizer decided an utterance's words again at its final: take back its appends, exactly
    these texts (the turn's last ones), before the corrected words are appended (`version` counts both)."""

    texts: tuple[str, ...]
    version: int


@dataclass(frozen=True, slots=True)
class StartReply:
    reply: int


@dataclass(frozen=True, slots=True)
class DraftReply:
    """The user paused: draft the reply as if their turn ended after `text` (appended like `AppendUserText`
    to the words of append `version`; "" for the words as they are)."""

    text: str
    version: int


@dataclass(frozen=True, slots=True)
class InterruptReply:
    reply: int
    heard_tokens: int
    # The reply is taken back whole, and the end of the user's turn with it: the turn is open again and the
    # user's next words continue it (`turn.continue_turn_ms`). Where the engine cannot, cut at `heard_tokens`.
    withdraw: bool = False


@dataclass(frozen=True, slots=True)
class ReplaceContext:
    """The LLM's context becomes exactly this: a system prompt (None: the default), finished (role, text)
    turns, and the words of the user's open turn that had reached it (see `Conversation.replace_context`)."""

    system_prompt: str | None
    turns: tuple[tuple[str, str], ...]
    open_user: str


@dataclass(frozen=True, slots=True)
class SetTools:
    """The tools the client gives the model (each a `tools.calls.ToolSpec`, typed loosely to keep this a leaf),
    and its `tool_choice` as chat completions takes it ("auto", "none", "required", or `{type: function,
    function: {name}}`)."""

    tools: tuple[object, ...]
    tool_choice: str | dict[str, object] = "auto"


@dataclass(frozen=True, slots=True)
class Synthesize:
    reply: int
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class PrefetchSpeech:
    """Synthesize `text` ahead, when idle: a drafted reply would start with it."""

    text: str


@dataclass(frozen=True, slots=True)
class PlayAudio:
    """Queue these samples (float32, 24 kHz) of reply `reply` for sending, after all queued before."""

    reply: int
    samples: object  # np.ndarray; typed loosely to keep this module free of numpy


@dataclass(frozen=True, slots=True)
class EndAudio:
    """Reply `reply` has no more audio: send its last partial frame, then report `audio_sent`."""

    reply: int


@dataclass(frozen=True, slots=True)
class StopAudio:
    """Drop every queued, unsent frame of reply `reply` and every TTS job for it."""

    reply: int


@dataclass(frozen=True, slots=True)
class PauseAudio:
    """The user may be talking over reply `reply`: send no more of its audio (the client pauses playback
    on `reply.paused`), and keep it all, until `ResumeAudio` or `StopAudio`."""

    reply: int


@dataclass(frozen=True, slots=True)
class ResumeAudio:
    """Reply `reply` plays on from where it paused (it was not an interruption)."""

    reply: int


Command = (
    AppendUserText
    | RetractUserText
    | StartReply
    | DraftReply
    | InterruptReply
    | ReplaceContext
    | Synthesize
    | PrefetchSpeech
    | PlayAudio
    | EndAudio
    | StopAudio
    | PauseAudio
    | ResumeAudio
)
