"""The project's exception tree. Cores raise these; shells map them to wire errors and close codes."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Machine-readable `error.code` values sent to clients (docs/protocol.md)."""

    BAD_JSON = "bad_json"
    BAD_MESSAGE = "bad_message"
    UNKNOWN_TYPE = "unknown_type"
    UNSUPPORTED_VERSION = "unsupported_version"
    BAD_SAMPLE_RATE = "bad_sample_rate"
    NOT_STARTED = "not_started"
    ALREADY_STARTED = "already_started"
    BAD_FRAME = "bad_frame"
    FRAME_TOO_LONG = "frame_too_long"
    OUT_OF_ORDER = "out_of_order"
    MESSAGE_TOO_BIG = "message_too_big"
    TOO_MANY_ERRORS = "too_many_errors"
    SLOW_CONSUMER = "slow_consumer"
    OVERLOADED = "overloaded"
    ASR_BEHIND = "asr_behind"
    INTERNAL = "internal"
    BAD_PLAYBACK = "bad_playback"
    NO_REPLY = "no_reply"
    REPLYING = "replying"
    NO_DIALOG = "no_dialog"
    BAD_ACK = "bad_ack"
    RESUME_REFUSED = "resume_refused"
    RATE_LIMITED = "rate_limited"
    IDLE_TIMEOUT = "idle_timeout"
    SHUTTING_DOWN = "shutting_down"


class DuplexdError(Exception):
    """Base of every error duplexd raises on purpose."""


class ProtocolError(DuplexdError):
    """The client broke the protocol. `fatal` errors end the session; others drop one message."""

    def __init__(self, code: ErrorCode, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fatal = fatal


class Overloaded(DuplexdError):
    """The server cannot take more work right now; the client may retry later (after `retry_after_ms`,
    when the server knows)."""

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class EngineError(DuplexdError):
    """A model engine failed; the message is for logs, never for clients."""


class CliError(DuplexdError):
    """A command cannot do what it was asked. `duplexd` prints the message as one line on stderr
    (`duplexd: error: ...`) and exits with `exit_code`; the message says what is wrong and what to do."""

    exit_code = 1


class UsageError(CliError):
    """The command line (an argument, a file it names) is wrong: exit 2, as for argparse's own errors."""

    exit_code = 2
