"""What a session keeps so a client can reconnect and continue: the events and the reply audio it may not
have received.

Reply tokens are kept by the Eloquent sender until acknowledged (`transport.packetizer`); reply audio by
`SentAudio`: every frame sent since the client's last playback report (it cannot have played past what it
received), bounded in samples. On `session.resume {audio_ms}` the frames from that position are sent
again, the first one cut so the output stream continues exactly where the client's copy ends. Events by
`EventLog`: numbered (`n`) and kept until the client acknowledges them (`ack.event_seq`), bounded in number.

Pure: no I/O.
"""

from __future__ import annotations

import hmac
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Any

from duplexd.transport import protocol


def new_resume_token() -> str:
    return secrets.token_urlsafe(24)


def same_token(given: str, expected: str) -> bool:
    """Constant-time comparison (a resume token is a bearer secret)."""
    return hmac.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True, slots=True)
class SentFrame:
    seq: int
    start: int  # position in the output stream (samples)
    pcm: bytes  # PCM16 LE

    @property
    def end(self) -> int:
        return self.start + len(self.pcm) // 2


class SentAudio:
    """The output audio frames sent and possibly not yet received, at most `max_samples` of them."""

    def __init__(self, max_samples: int) -> None:
        if max_samples < 1:
            raise ValueError(f"SentAudio max_samples must be >= 1, got {max_samples!r}")
        self.max_samples = max_samples
        self._frames: deque[SentFrame] = deque()
        self._samples = 0
        self.end = 0  # the output stream's length (samples sent)

    @property
    def samples(self) -> int:
        return self._samples

    @property
    def start(self) -> int:
        """Oldest position still kept."""
        return self._frames[0].start if self._frames else self.end

    def sent(self, seq: int, pcm: bytes) -> None:
        frame = SentFrame(seq, self.end, pcm)
        self.end = frame.end
        self._frames.append(frame)
        self._samples += len(pcm) // 2
        while self._samples > self.max_samples and len(self._frames) > 1:
            self._forget()

    def played(self, position: int) -> None:
        """The client reports having played up to `position`: frames before it are no longer needed."""
        while self._frames and self._frames[0].end <= position:
            self._forget()

    def since(self, position: int) -> tuple[list[SentFrame], int]:
        """The frames from `position` on (the first cut to start there), and how many samples before the
        oldest kept frame were asked for but are gone (0 when nothing is missing)."""
        position = max(0, min(position, self.end))
        missing = max(0, self.start - position)
        out: list[SentFrame] = []
        for f in self._frames:
            if f.end <= position:
                continue
            if f.start < position:
                cut = (position - f.start) * 2
                f = SentFrame(f.seq, position, f.pcm[cut:])
            out.append(f)
        return out, missing

    def _forget(self) -> None:
        f = self._frames.popleft()
        self._samples -= len(f.pcm) // 2


class EventLog:
    """The events sent, numbered `n` from 1 and kept until acknowledged, at most `max_events` (the oldest are
    forgotten, and a resume says how many were lost)."""

    def __init__(self, max_events: int) -> None:
        self.last = 0  # events numbered so far
        self.forgotten = 0  # events up to this number are no longer kept
        self._kept: deque[tuple[int, str]] = deque(maxlen=max_events)

    def add(self, event: dict[str, Any]) -> str:
        """Number `event` and keep it; its text as sent."""
        self.last += 1
        text = protocol.dumps({**event, "n": self.last})
        if len(self._kept) == self._kept.maxlen:
            self.forgotten = self._kept[0][0] if self._kept else self.last
        self._kept.append((self.last, text))
        return text

    def ack(self, through: int) -> None:
        """The client has every event up to `through`."""
        while self._kept and self._kept[0][0] <= through:
            self._kept.popleft()

    def since(self, n: int) -> list[str]:
        """The events kept after number `n`, in order."""
        return [text for m, text in self._kept if m > n]

    def lost_since(self, n: int) -> int:
        """Events after `n` that were forgotten before the client could have them again."""
        return max(0, self.forgotten - n)
