"""Reply audio out: framing and pacing. Pure: the shell asks what to send, given the playback position.

Audio of consecutive replies forms one output stream (PCM16 at 24 kHz); frames never mix two replies, and a
reply's last frame may be short. Frames go out at most `lead_samples` ahead of what the client has played,
so the client's buffer stays small and a barge-in has little to throw away.

Audio not yet sent is bounded (`max_samples`, `transport.max_queued_audio_s`): a push into a full queue is
refused. Dropping audio instead would break the reply's accounting (the conversation counts every sample it
hands out: where the reply starts, what was heard at a cut); the shell applies back-pressure instead,
submitting the reply's next TTS piece only while the queue is not `full` (`transport.voice.VoiceLoop`).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from duplexd.config import TransportConfig
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

MAX_QUEUED_SAMPLES = int(TransportConfig().max_queued_audio_s * OUTPUT_SAMPLE_RATE)


class PlayoutFull(Exception):
    """A push into a playout that already holds `max_samples` not sent (the shell pushes no more once `full`)."""


class Playout:
    def __init__(self, frame_samples: int, lead_samples: int, max_samples: int = MAX_QUEUED_SAMPLES) -> None:
        self.frame_samples = frame_samples
        self.lead_samples = lead_samples
        self.max_samples = max_samples
        self.sent = 0  # samples sent so far: the output stream's length
        self.seq = 0  # last frame number sent
        # (reply, PCM16 samples) not yet sent. Bounded by `push`: refused once it holds `max_samples`, so it
        # never holds more than `max_samples` plus one push (a TTS piece: a clause, a few seconds).
        self._queue: deque[tuple[int, np.ndarray]] = deque()
        self._ended: list[int] = []  # replies whose audio is complete, in order
        self.paused = False  # the client paused playback (speech over the reply): nothing goes out

    @property
    def queued(self) -> int:
        return sum(len(a) for _, a in self._queue)

    @property
    def full(self) -> bool:
        """The queue holds `max_samples` not sent: it takes no more audio until frames go out."""
        return self.queued >= self.max_samples

    def push(self, reply: int, samples: np.ndarray) -> None:
        """Queue audio of `reply`. Raises `PlayoutFull` when `full` (nothing is dropped, nothing added)."""
        if not len(samples):
            return
        if self.full:
            raise PlayoutFull(f"{self.queued} samples queued, at most {self.max_samples}")
        self._queue.append((reply, (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")))

    def end(self, reply: int) -> None:
        self._ended.append(reply)

    def stop(self, reply: int) -> None:
        """Forget everything of `reply` that was not sent."""
        self._queue = deque((r, a) for r, a in self._queue if r != reply)
        self._ended = [r for r in self._ended if r != reply]

    def take(self, played: int) -> tuple[list[tuple[int, bytes]], list[int]]:
        """Frames to send now, as (seq, PCM16 bytes), and the replies whose audio is now all sent.

        The conversation voices one reply at a time, so the queue holds one reply's audio."""
        frames: list[tuple[int, bytes]] = []
        while not self.paused and (available := self.queued) and self.sent - played < self.lead_samples:
            if available < self.frame_samples and not self._ended:
                break  # wait for more audio rather than send a short frame mid-reply
            reply = self._queue[0][0]
            n = min(self.frame_samples, sum(len(a) for r, a in self._queue if r == reply))
            frames.append((self._next_seq(), self._pop(reply, n).tobytes()))
        done: list[int] = []
        if not self._queue:
            done, self._ended = self._ended, []
        return frames, done

    def _pop(self, reply: int, n: int) -> np.ndarray:
        parts, need = [], n
        while need:
            r, a = self._queue[0]
            assert r == reply
            take = a[:need]
            parts.append(take)
            need -= len(take)
            if len(take) == len(a):
                self._queue.popleft()
            else:
                self._queue[0] = (r, a[len(take) :])
        self.sent += n
        return np.concatenate(parts)

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq
