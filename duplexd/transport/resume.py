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
from duplexd.transport.packetizer import Ack, Eloquent
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE


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


@dataclass(frozen=True, slots=True)
class Handover:
    """What a resuming connection sends, in order: `resumed` (the `session.resumed` message, with the reply
    tokens the client has not acknowledged), the audio frames it has not received (`frames`, PCM16 out), then
    what was queued for the old socket (`queued`)."""

    resumed: dict[str, Any]
    frames: list[bytes]
    queued: list[str | bytes]


def refusal(request: protocol.SessionResume, tokens: Eloquent, audio: SentAudio) -> str | None:
    """Why a resume from `request`'s position cannot be granted (None: it can): the client claims more
    tokens or audio than were sent."""
    position = round(request.audio_ms * OUTPUT_SAMPLE_RATE / 1000)
    if request.token_seq > tokens.last_seq or position > audio.end + 1:
        return (
            f"resume position (token {request.token_seq}, {request.audio_ms:.0f} ms) is past what was sent "
            f"(token {tokens.last_seq}, {1000 * audio.end / OUTPUT_SAMPLE_RATE:.0f} ms)"
        )
    return None


def hand_over(
    request: protocol.SessionResume,
    session_id: str,
    tokens: Eloquent,
    audio: SentAudio,
    events: EventLog,
    queued: list[str | bytes | None],
    now: float,
) -> Handover:
    """Continue the session where the client's copy ends (`request`, which `refusal` accepted), from what
    the old connection kept: its tokens (acknowledged through `request.token_seq` here), its sent audio, its
    event log, and what was `queued` for its socket."""
    position = round(request.audio_ms * OUTPUT_SAMPLE_RATE / 1000)
    tokens.ack(Ack(request.token_seq), now)
    unacked = list(tokens.buffer.items)
    frames, missing = audio.since(position)
    resend = {f.seq: f for f in frames}
    # What was queued for the old socket, in order: reply text goes again as tokens (above), audio frames
    # from `audio` (cut where the client's copy ends); frames sent before the drop but not received go
    # first, since they left before anything still queued.
    later: list[str | bytes] = []
    replay = request.event_seq is not None
    if request.event_seq is not None:  # every event after the client's last, from the log (queued ones too)
        later += events.since(request.event_seq)
    for item in queued:
        if isinstance(item, bytes):
            f = resend.pop(protocol.BINARY_HEADER.unpack_from(item)[1], None)
            if f is not None:
                later.append(protocol.encode_audio_frame(f.seq, f.pcm, protocol.BinaryKind.AUDIO_OUT))
        elif item is not None and not replay and not item.startswith('{"type":"reply.delta"'):
            later.append(item)
    resumed = {
        "type": protocol.ServerType.SESSION_RESUMED,
        "session_id": session_id,
        "token_seq": unacked[0].token.seq if unacked else tokens.last_seq + 1,
        "tokens": [[p.token.reply, p.token.text] for p in unacked],
        "tokens_lost": max(0, tokens.evicted_through - request.token_seq),
        "audio_ms": round(1000 * (position + missing) / OUTPUT_SAMPLE_RATE, 3),
        "audio_lost_ms": round(1000 * missing / OUTPUT_SAMPLE_RATE, 3),
        "events_lost": events.lost_since(request.event_seq) if request.event_seq is not None else None,
    }
    out_frames = [protocol.encode_audio_frame(f.seq, f.pcm, protocol.BinaryKind.AUDIO_OUT) for f in resend.values()]
    return Handover(resumed, out_frames, later)
