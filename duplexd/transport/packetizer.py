"""Reply tokens over a lossy or interrupted path: Eloquent redundant packets, and the two baselines.

Every reply piece (a `Token`: the text of one decode step) gets a sequence number, per session and across
replies, from 1. A sender turns tokens into `Packet`s; a `Receiver` renders the longest contiguous prefix
it has and acknowledges it (`Ack`). Three senders behind one interface (`push`, `ack`, `poll`):

- `Eloquent` (after the paper's scheme): every packet carries the new tokens and the unacknowledged ones
  that need it, so a packet that arrives after a loss renders on its own. A token needs it until it has
  gone out twice (once while the path shows no loss; three or four times when it loses 5 % or 25 % of
  the packets or their acks, the extra copies riding in the next tokens' packets), and again once it is
  *suspect*: unacknowledged one RTO (without backoff) after it last went out, lost by every sign.
  Redundancy in time: each packet goes again `repeat_after_s` (5 ms) later unless a newer one has gone
  out meanwhile, so a lost packet costs 5 ms, not the wait for the next token or an RTO. When the oldest
  token has gone an RTO without an ack, every unacknowledged token goes again (also the tail of a reply,
  which has no later packet to carry it). The paper's sender puts every unacknowledged token in every
  packet: at tens of tokens a second and an RTT of 100 ms that is several times a token's bytes, for
  little gain once it has gone out twice. The repeats stop while the path shows no loss
  (`repeat_clean_packets` packets in a row acknowledged) and start again at the first packet lost.
- `Retransmit`: each token once; tokens unacknowledged after an RTO are sent again.
- `Duplicate`: `Retransmit`, with every packet sent twice.

All three use one RTT estimator (RFC 6298; samples from the packet number an ack echoes, so resent data is
never ambiguous) and one bounded buffer of unacknowledged tokens.

**The bound** (`max_tokens`, `max_bytes`): a receiver that stops acknowledging cannot make the sender hold
a reply without limit. When a new token would pass the bound the *oldest* unacknowledged tokens are
forgotten (`evicted` counts them): the receiver then renders up to the gap and stops there (still a prefix
of what was sent), and a resume from before the gap is told what was lost. A packet never carries more
than `max_packet_bytes` (a datagram must fit the path MTU): when the unacknowledged tokens do not fit,
it carries the oldest ones, so the receiver's prefix grows with every packet that arrives.

Pure: time comes in as `now` (seconds); no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

TOKEN_OVERHEAD_BYTES = 8  # per token on the wire beyond its text (reply number, framing); the bounds count it


@dataclass(frozen=True, slots=True)
class Token:
    seq: int
    reply: int
    text: str

    @property
    def size_bytes(self) -> int:
        return len(self.text.encode()) + TOKEN_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class Packet:
    """Tokens with consecutive sequence numbers. `number` counts packets per sender (a duplicate copy keeps
    its original's number); an `Ack` echoes it for the RTT."""

    number: int
    tokens: tuple[Token, ...]

    @property
    def first_seq(self) -> int:
        return self.tokens[0].seq

    @property
    def last_seq(self) -> int:
        return self.tokens[-1].seq

    @property
    def size_bytes(self) -> int:
        return 8 + sum(t.size_bytes for t in self.tokens)


@dataclass(frozen=True, slots=True)
class Ack:
    token_seq: int  # the receiver has rendered every token up to and including this one
    packet: int = 0  # the highest packet number it has received (0: none, or not known)


@dataclass(frozen=True, slots=True)
class SenderConfig:
    max_tokens: int = 1024
    max_bytes: int = 64 * 1024
    max_packet_bytes: int = 1200
    initial_rto_s: float = 0.2
    min_rto_s: float = 0.01
    max_rto_s: float = 2.0
    repeat_after_s: float = 0.005  # Eloquent: each packet again this much later (0: never)
    repeat_clean_packets: int = 200  # ... unless this many packets in a row were acknowledged (0: always)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"packetizer.max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.max_bytes < 64:
            raise ValueError(f"packetizer.max_bytes must be >= 64, got {self.max_bytes!r}")
        if not 64 <= self.max_packet_bytes:
            raise ValueError(f"packetizer.max_packet_bytes must be >= 64, got {self.max_packet_bytes!r}")
        if not 0 < self.min_rto_s <= self.initial_rto_s <= self.max_rto_s:
            raise ValueError(
                "packetizer RTOs must satisfy 0 < min_rto_s <= initial_rto_s <= max_rto_s, got "
                f"{self.min_rto_s!r}, {self.initial_rto_s!r}, {self.max_rto_s!r}"
            )
        if not 0 <= self.repeat_after_s < self.min_rto_s:
            raise ValueError(
                f"packetizer.repeat_after_s must be in [0, min_rto_s={self.min_rto_s!r}), got {self.repeat_after_s!r}"
            )
        if self.repeat_clean_packets < 0:
            raise ValueError(f"packetizer.repeat_clean_packets must be >= 0, got {self.repeat_clean_packets!r}")


class RttEstimator:
    """RFC 6298: smoothed RTT and variation; RTO = srtt + 4 rttvar, clamped; doubled on each timeout."""

    def __init__(self, config: SenderConfig) -> None:
        self.config = config
        self.srtt_s: float | None = None
        self.rttvar_s = 0.0
        self._backoff = 1

    def sample(self, rtt_s: float) -> None:
        if self.srtt_s is None:
            self.srtt_s, self.rttvar_s = rtt_s, rtt_s / 2
        else:
            self.rttvar_s = 0.75 * self.rttvar_s + 0.25 * abs(self.srtt_s - rtt_s)
            self.srtt_s = 0.875 * self.srtt_s + 0.125 * rtt_s
        self._backoff = 1

    def timed_out(self) -> None:
        self._backoff = min(self._backoff * 2, 64)

    def progressed(self) -> None:
        self._backoff = 1

    @property
    def rto_s(self) -> float:
        return min(self.config.max_rto_s, self.base_rto_s * self._backoff)

    @property
    def base_rto_s(self) -> float:
        """The RTO without backoff: how long an ack may take."""
        c = self.config
        base = c.initial_rto_s if self.srtt_s is None else self.srtt_s + 4 * self.rttvar_s
        return min(c.max_rto_s, max(c.min_rto_s, base))


@dataclass(slots=True)
class SenderStats:
    packets: int = 0  # datagrams handed to the path (a duplicate counts twice)
    bytes: int = 0
    tokens: int = 0  # distinct tokens pushed
    token_bytes: int = 0  # their size once each: `bytes / token_bytes` is the scheme's overhead
    timeouts: int = 0
    evicted: int = 0
    repeats: int = 0  # Eloquent's packets sent again `repeat_after_s` later


class Sender(Protocol):
    config: SenderConfig
    stats: SenderStats

    def push(self, reply: int, texts: Sequence[str], now: float) -> list[Packet]:
        """New tokens of `reply`: the packets to send now."""
        ...

    def ack(self, ack: Ack, now: float) -> None: ...

    def poll(self, now: float) -> list[Packet]:
        """Timer work due at `now`: the packets to send."""
        ...

    def next_timer(self) -> float | None:
        """When `poll` next has something to do (None: nothing outstanding)."""
        ...


@dataclass(slots=True)
class _Pending:
    token: Token
    sent_at: float = -1.0  # last time it went out (-1: not yet)
    copies: int = 0  # packets it went out in


@dataclass(slots=True)
class _Buffer:
    """The unacknowledged tokens, oldest first, bounded in count and bytes."""

    config: SenderConfig
    items: deque[_Pending] = field(default_factory=deque)
    bytes: int = 0
    next_seq: int = 1
    acked: int = 0  # highest cumulative ack seen
    evicted_through: int = 0  # tokens up to here were forgotten unacknowledged

    def add(self, reply: int, text: str) -> tuple[Token, int]:
        """Append a token; returns it and how many old tokens were evicted to keep the bound."""
        token = Token(self.next_seq, reply, text)
        self.next_seq += 1
        self.items.append(_Pending(token))
        self.bytes += token.size_bytes
        evicted = 0
        while len(self.items) > self.config.max_tokens or (self.bytes > self.config.max_bytes and len(self.items) > 1):
            old = self.items.popleft()
            self.bytes -= old.token.size_bytes
            self.evicted_through = old.token.seq
            evicted += 1
        return token, evicted

    def ack(self, token_seq: int) -> bool:
        """Forget tokens up to `token_seq`; True if that is progress."""
        token_seq = min(token_seq, self.next_seq - 1)
        if token_seq <= self.acked:
            return False
        self.acked = token_seq
        while self.items and self.items[0].token.seq <= token_seq:
            self.bytes -= self.items.popleft().token.size_bytes
        return True

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1


class _SenderBase:
    copies = 1

    def __init__(self, config: SenderConfig | None = None) -> None:
        self.config = config or SenderConfig()
        self.stats = SenderStats()
        self.rtt = RttEstimator(self.config)
        self.buffer = _Buffer(self.config)
        self._packet_no = 0
        self._sent_at: deque[tuple[int, float]] = deque(maxlen=512)  # (packet number, when): for RTT samples
        self._last_sampled = 0

    @property
    def unacked(self) -> int:
        return len(self.buffer.items)

    @property
    def buffered_bytes(self) -> int:
        return self.buffer.bytes

    @property
    def last_seq(self) -> int:
        return self.buffer.last_seq

    @property
    def evicted_through(self) -> int:
        return self.buffer.evicted_through

    def add(self, reply: int, texts: Sequence[str]) -> None:
        """Keep new tokens until acknowledged without sending them (a reliable path carries them)."""
        self._add(reply, texts)

    def _add(self, reply: int, texts: Sequence[str]) -> list[_Pending]:
        start = len(self.buffer.items)
        for text in texts:
            token, evicted = self.buffer.add(reply, text)
            self.stats.tokens += 1
            self.stats.token_bytes += token.size_bytes
            self.stats.evicted += evicted
            start -= evicted
        return list(self.buffer.items)[max(0, start) :]

    def _packets(self, pending: Sequence[_Pending], now: float) -> list[Packet]:
        """`pending` (consecutive) as packets of at most `max_packet_bytes`, each sent `copies` times."""
        out: list[Packet] = []
        i = 0
        while i < len(pending):
            size, j = 8, i
            while j < len(pending) and (j == i or size + pending[j].token.size_bytes <= self.config.max_packet_bytes):
                size += pending[j].token.size_bytes
                j += 1
            out.extend(self._emit(pending[i:j], now))
            i = j
        return out

    def _emit(self, pending: Sequence[_Pending], now: float) -> list[Packet]:
        """One packet of these tokens, numbered, timed, counted; `copies` times."""
        self._packet_no += 1
        self._sent_at.append((self._packet_no, now))
        for p in pending:
            p.sent_at = now
            p.copies += 1
        packet = Packet(self._packet_no, tuple(p.token for p in pending))
        self.stats.packets += self.copies
        self.stats.bytes += self.copies * packet.size_bytes
        return [packet] * self.copies

    def ack(self, ack: Ack, now: float) -> None:
        if ack.packet > self._last_sampled:
            self._last_sampled = ack.packet
            for number, at in reversed(self._sent_at):
                if number == ack.packet:
                    self.rtt.sample(now - at)
                    break
                if number < ack.packet:
                    break
        if self.buffer.ack(ack.token_seq):
            self.rtt.progressed()

    def next_timer(self) -> float | None:
        sent = [p.sent_at for p in self.buffer.items if p.sent_at >= 0]
        return min(sent) + self.rtt.rto_s if sent else None


LOSS_WINDOW_PACKETS = 512  # packets not yet acknowledged that the loss detector follows
EXTRA_COPY_LOSS = (0.05, 0.25)  # round-trip loss from which Eloquent sends each token once more, twice more


class Eloquent(_SenderBase):
    """Every packet: the unacknowledged tokens from the oldest that still needs copies or is suspect (oldest
    first, up to `max_packet_bytes`); each packet again `repeat_after_s` later unless a newer one went out
    first, while the path loses packets; when the oldest token has gone unacknowledged for an RTO, every
    unacknowledged token."""

    def __init__(self, config: SenderConfig | None = None) -> None:
        super().__init__(config)
        self._last_send = -1.0
        self._repeat_at: float | None = None  # when the newest packet goes again
        self._in_flight: deque[int] = deque()  # numbers of the packets sent and not acknowledged, in order
        self._clean = 0  # packets acknowledged in a row since the last one lost
        self.loss = 0.0  # round-trip packet loss (a packet or its ack), smoothed over ~32 packets

    @property
    def repeating(self) -> bool:
        """The path has lost a packet lately (or has not shown yet that it does not)."""
        c = self.config
        return c.repeat_after_s > 0 and (c.repeat_clean_packets == 0 or self._clean < c.repeat_clean_packets)

    @property
    def token_copies(self) -> int:
        """How many packets a token goes out in before only a suspicion of loss sends it again: 1 on a clean
        path; 2 (its packet and the repeat); one more from 5 % round-trip loss, another from 25 %. The extra
        copies ride in the packets of the next tokens: a few bytes each, no datagram of their own."""
        if not self.repeating:
            return 1
        return 2 + (self.loss >= EXTRA_COPY_LOSS[0]) + (self.loss >= EXTRA_COPY_LOSS[1])

    def push(self, reply: int, texts: Sequence[str], now: float) -> list[Packet]:
        self._add(reply, texts)
        return self.packet(now)

    def packet(self, now: float, *, repeat: bool = True, everything: bool = False) -> list[Packet]:
        """One packet of the unacknowledged tokens that need to go (`everything`: all of them; none if all
        are acknowledged); `repeat`: it goes again `repeat_after_s` later unless a newer one goes first."""
        items = self.buffer.items
        if not items:
            return []
        copies = self.token_copies
        suspect = now - self.rtt.base_rto_s  # (sent before then and not acknowledged: lost, by every sign)
        start = 0 if everything else len(items) - 1  # (a packet carries consecutive tokens: from the oldest needed)
        for i, p in enumerate(items):
            if p.copies < copies or p.sent_at <= suspect:
                start = min(start, i)
                break
        size, n = 8, 0
        for i in range(start, len(items)):
            if n and size + items[i].token.size_bytes > self.config.max_packet_bytes:
                break
            size += items[i].token.size_bytes
            n += 1
        self._last_send = now
        self._repeat_at = now + self.config.repeat_after_s if repeat and self.repeating else None
        out = self._emit([items[i] for i in range(start, start + n)], now)
        self._in_flight.append(out[0].number)
        if len(self._in_flight) > LOSS_WINDOW_PACKETS:  # (never acknowledged: the receiver is gone, or the path)
            self._in_flight.popleft()
            self._lost()
        return out

    def _lost(self) -> None:
        self._clean = 0
        self.loss += (1 - self.loss) / 32

    def ack(self, ack: Ack, now: float) -> None:
        super().ack(ack, now)
        # Acks echo the highest packet received: one sent before it that has no ack was lost (or its ack was).
        while self._in_flight and self._in_flight[0] <= ack.packet:
            if self._in_flight.popleft() == ack.packet:
                self._clean += 1
                self.loss -= self.loss / 32
            else:
                self._lost()
        if not self.buffer.items:
            self._repeat_at = None

    def _timeout_at(self) -> float | None:
        """When the oldest token has been unacknowledged for an RTO since it went out (one that did not fit in
        a packet yet: since the last packet). None: nothing has gone out."""
        if not self.buffer.items or self._last_send < 0:
            return None
        return min(p.sent_at if p.sent_at >= 0 else self._last_send for p in self.buffer.items) + self.rtt.rto_s

    def poll(self, now: float) -> list[Packet]:
        timeout = self._timeout_at()
        if timeout is not None and now >= timeout:
            self.stats.timeouts += 1
            self.rtt.timed_out()
            return self.packet(now, everything=True)
        if self._repeat_at is not None and now >= self._repeat_at and self.buffer.items:
            self.stats.repeats += 1
            return self.packet(now, repeat=False)
        return []

    def next_timer(self) -> float | None:
        timeout = self._timeout_at()
        if timeout is None or self._repeat_at is None:
            return timeout
        return min(timeout, self._repeat_at)


class Retransmit(_SenderBase):
    """Each token once; unacknowledged after an RTO: sent again (all that timed out, in order)."""

    def push(self, reply: int, texts: Sequence[str], now: float) -> list[Packet]:
        return self._packets(self._add(reply, texts), now)

    def poll(self, now: float) -> list[Packet]:
        rto = self.rtt.rto_s
        expired = [p for p in self.buffer.items if 0 <= p.sent_at and p.sent_at + rto <= now]
        if not expired:
            return []
        self.stats.timeouts += 1
        self.rtt.timed_out()
        # Acks are cumulative, so what timed out is a run from the oldest unacknowledged token.
        return self._packets(expired, now)


class Duplicate(Retransmit):
    """`Retransmit` with every packet sent twice."""

    copies = 2


SCHEMES: dict[str, type[_SenderBase]] = {"eloquent": Eloquent, "retransmit": Retransmit, "duplicate": Duplicate}


def make_sender(scheme: str, config: SenderConfig | None = None) -> Eloquent | Retransmit | Duplicate:
    try:
        return SCHEMES[scheme](config)  # type: ignore[return-value]
    except KeyError:
        raise ValueError(f"unknown transport scheme {scheme!r} (one of {', '.join(SCHEMES)})") from None


class Receiver:
    """Renders the longest contiguous prefix of the tokens it has received; holds out-of-order tokens (at
    most `window_tokens` past the prefix) until the gap before them fills."""

    def __init__(self, window_tokens: int = 1024) -> None:
        if window_tokens < 1:
            raise ValueError(f"receiver window_tokens must be >= 1, got {window_tokens!r}")
        self.window_tokens = window_tokens
        self.contiguous = 0
        self.highest_packet = 0
        self._held: dict[int, Token] = {}

    def receive(self, packet: Packet) -> list[Token]:
        """The tokens this packet lets the receiver render, in order (none if it brought nothing new)."""
        self.highest_packet = max(self.highest_packet, packet.number)
        for token in packet.tokens:
            if self.contiguous < token.seq <= self.contiguous + self.window_tokens:
                self._held.setdefault(token.seq, token)
        rendered: list[Token] = []
        while (token := self._held.pop(self.contiguous + 1, None)) is not None:
            rendered.append(token)
            self.contiguous += 1
        return rendered

    def ack(self) -> Ack:
        return Ack(self.contiguous, self.highest_packet)

    @property
    def held(self) -> int:
        return len(self._held)
