"""What a session keeps so a client can reconnect and continue: the reply audio it may not have received.

Reply tokens are kept by the Eloquent sender until acknowledged (`transport.packetizer`); reply audio by
`SentAudio`: every frame sent since the client's last playback report (it cannot have played past what it
received), bounded in samples. On `session.resume {audio_ms}` the frames from that position are sent
again, the first one cut so the output stream continues exactly where the client's copy ends.

Pure: no I/O.
"""

from __future__ import annotations

import hmac
import secrets
from collections import deque
from dataclasses import dataclass


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
