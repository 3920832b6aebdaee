"""The datagram path: reply tokens as Eloquent packets over UDP, next to the WebSocket.

Why UDP with a per-session key rather than a WebRTC DataChannel: the clients that meet lossy paths with
no WebSocket fallback worth having are native (phones, embedded agents, SIP gateways, the load harness);
UDP needs no dependency, no ICE/DTLS/SCTP stack in the server, and a loss simulator can sit between real
sockets. A browser cannot open a UDP socket: it keeps the WebSocket (Eloquent acks and `session.resume`
protect it across reconnects), and an unordered, no-retransmit DataChannel is the way to give it this path
later (docs/protocol.md says so).

Negotiation: `session.start {datagram: true}` -> `session.started.datagram {host, port, tag, key}`. The
client sends `HELLO` from its UDP socket (the server learns its address from it, so NAT works), then
receives `TOKENS` packets and answers each with an `ACK`. Tokens from both paths merge at the client by
sequence number (`packetizer.Receiver`).

Every datagram: magic `DXD`, version, kind, 3 zero bytes, the session's 8-byte tag, a u32 counter
(strictly increasing per sender, so a replayed HELLO cannot move the session to another address), the
payload, and the first 16 bytes of HMAC-SHA256 over all that with the session's 32-byte key. The key
authenticates; it does not encrypt (TLS for the WebSocket, and this path's confidentiality, are separate).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from duplexd.transport.packetizer import Ack, Packet, Receiver, Token

log = logging.getLogger(__name__)

MAGIC = b"DXD"
VERSION = 1
HEADER = struct.Struct("<3sBB3x8sI")  # magic, version, kind, reserved, tag, counter
MAC_BYTES = 16
TAG_BYTES = 8
KEY_BYTES = 32
MAX_DATAGRAM_BYTES = 1400  # under a 1500-byte MTU with IP and UDP headers
MAX_PAYLOAD_BYTES = MAX_DATAGRAM_BYTES - HEADER.size - MAC_BYTES

_TOKENS_HEAD = struct.Struct("<IIH")  # packet number, first seq, count
_TOKEN = struct.Struct("<IH")  # reply, text bytes
_ACK = struct.Struct("<II")  # token_seq, packet number


class Kind(IntEnum):
    HELLO = 1  # client -> server: here is my address
    TOKENS = 2  # server -> client: an Eloquent packet
    ACK = 3  # client -> server: `Ack`


class DatagramError(ValueError):
    """A datagram that is not ours, is cut short, or fails its MAC: dropped and counted, never answered."""


@dataclass(frozen=True, slots=True)
class Datagram:
    kind: Kind
    tag: bytes
    counter: int
    payload: bytes


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def new_tag() -> bytes:
    return secrets.token_bytes(TAG_BYTES)


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()[:MAC_BYTES]


def encode(kind: Kind, tag: bytes, counter: int, payload: bytes, key: bytes) -> bytes:
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"datagram payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    body = HEADER.pack(MAGIC, VERSION, kind, tag, counter & 0xFFFFFFFF) + payload
    return body + _mac(key, body)


def peek_tag(data: bytes) -> bytes:
    """The session tag of a datagram (to find its key), or `DatagramError`."""
    if len(data) < HEADER.size + MAC_BYTES:
        raise DatagramError("datagram shorter than header and MAC")
    magic, version, _, tag, _ = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise DatagramError("not a duplexd datagram (magic or version)")
    return tag


def decode(data: bytes, key: bytes) -> Datagram:
    tag = peek_tag(data)
    body, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, body)):
        raise DatagramError("bad MAC")
    _, _, kind, _, counter = HEADER.unpack_from(body)
    try:
        return Datagram(Kind(kind), tag, counter, body[HEADER.size :])
    except ValueError:
        raise DatagramError(f"unknown datagram kind {kind}") from None


def encode_tokens(packet: Packet) -> bytes:
    parts = [_TOKENS_HEAD.pack(packet.number, packet.first_seq, len(packet.tokens))]
    for t in packet.tokens:
        text = t.text.encode()
        parts.append(_TOKEN.pack(t.reply, len(text)) + text)
    return b"".join(parts)


def decode_tokens(payload: bytes) -> Packet:
    try:
        number, first, count = _TOKENS_HEAD.unpack_from(payload)
        at, tokens = _TOKENS_HEAD.size, []
        for i in range(count):
            reply, n = _TOKEN.unpack_from(payload, at)
            at += _TOKEN.size
            text = payload[at : at + n].decode()
            if len(text.encode()) != n:
                raise DatagramError("token text cut short")
            at += n
            tokens.append(Token(first + i, reply, text))
    except (struct.error, UnicodeDecodeError) as exc:
        raise DatagramError(f"malformed TOKENS payload: {exc}") from None
    if not tokens or at != len(payload):
        raise DatagramError("TOKENS payload is empty or has trailing bytes")
    return Packet(number, tuple(tokens))


def encode_ack(ack: Ack) -> bytes:
    return _ACK.pack(ack.token_seq, ack.packet)


def decode_ack(payload: bytes) -> Ack:
    if len(payload) != _ACK.size:
        raise DatagramError("ACK payload of the wrong size")
    return Ack(*_ACK.unpack(payload))


# -- the server's endpoint ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Route:
    key: bytes
    on_ack: Callable[[Ack], None]
    addr: tuple[str, int] | None = None
    counter_in: int = -1
    counter_out: int = 0


@dataclass(slots=True)
class EndpointStats:
    received: int = 0
    dropped: int = 0  # not ours, bad MAC, replayed, unknown session
    sent: int = 0
    bytes_sent: int = 0


class DatagramEndpoint(asyncio.DatagramProtocol):
    """One UDP socket for every session of the server; routes by tag, authenticates by key."""

    def __init__(self) -> None:
        self.routes: dict[bytes, _Route] = {}
        self.stats = EndpointStats()
        self.transport: asyncio.DatagramTransport | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> DatagramEndpoint:
        loop = asyncio.get_running_loop()
        _, endpoint = await loop.create_datagram_endpoint(cls, local_addr=(host, port))
        return endpoint

    @property
    def port(self) -> int:
        assert self.transport is not None
        return self.transport.get_extra_info("sockname")[1]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (3.11's selector transport is not a subclass)

    def register(self, key: bytes, on_ack: Callable[[Ack], None]) -> bytes:
        tag = new_tag()
        self.routes[tag] = _Route(key, on_ack)
        return tag

    def unregister(self, tag: bytes) -> None:
        self.routes.pop(tag, None)

    def send(self, tag: bytes, packet: Packet) -> bool:
        """Send one Eloquent packet to the session's client; False while its address is not known."""
        route = self.routes.get(tag)
        if route is None or route.addr is None or self.transport is None:
            return False
        route.counter_out += 1
        data = encode(Kind.TOKENS, tag, route.counter_out, encode_tokens(packet), route.key)
        self.transport.sendto(data, route.addr)
        self.stats.sent += 1
        self.stats.bytes_sent += len(data)
        return True

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.stats.received += 1
        try:
            route = self.routes.get(peek_tag(data))
            if route is None:
                raise DatagramError("unknown session")
            dgram = decode(data, route.key)
            if dgram.counter <= route.counter_in:
                raise DatagramError("replayed or reordered counter")
            route.counter_in = dgram.counter
            route.addr = addr
            if dgram.kind == Kind.ACK:
                route.on_ack(decode_ack(dgram.payload))
            elif dgram.kind != Kind.HELLO:
                raise DatagramError(f"{dgram.kind.name} is not a client datagram")
        except DatagramError:
            self.stats.dropped += 1

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable and the like: the client may be gone
        log.debug("datagram path: %s", exc)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


# -- the client's side -----------------------------------------------------------------------------------


@dataclass(slots=True)
class ClientStats:
    packets: int = 0
    dropped: int = 0
    tokens_rendered: int = 0


@dataclass(slots=True)
class DatagramClient(asyncio.DatagramProtocol):
    """Receives a session's reply tokens over UDP into a shared `Receiver` and acks each packet.

    `on_tokens(tokens)` gets what a packet newly rendered (tokens that came over the WebSocket first are
    not rendered twice: both paths feed the one receiver)."""

    tag: bytes
    key: bytes
    receiver: Receiver
    on_tokens: Callable[[list[Token]], None] = lambda tokens: None
    stats: ClientStats = field(default_factory=ClientStats)
    transport: asyncio.DatagramTransport | None = None
    _counter: int = 0

    @classmethod
    async def connect(
        cls, host: str, port: int, tag: bytes, key: bytes, receiver: Receiver, on_tokens: Callable[[list[Token]], None]
    ) -> DatagramClient:
        loop = asyncio.get_running_loop()
        _, client = await loop.create_datagram_endpoint(
            lambda: cls(tag, key, receiver, on_tokens), remote_addr=(host, port)
        )
        client.hello()
        return client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (3.11's selector transport is not a subclass)

    def _send(self, kind: Kind, payload: bytes) -> None:
        if self.transport is not None:
            self._counter += 1
            self.transport.sendto(encode(kind, self.tag, self._counter, payload, self.key))

    def hello(self) -> None:
        self._send(Kind.HELLO, b"")

    def ack(self) -> None:
        self._send(Kind.ACK, encode_ack(self.receiver.ack()))

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            dgram = decode(data, self.key)
            if dgram.tag != self.tag or dgram.kind != Kind.TOKENS:
                raise DatagramError("not this session's tokens")
            packet = decode_tokens(dgram.payload)
        except DatagramError:
            self.stats.dropped += 1
            return
        self.stats.packets += 1
        rendered = self.receiver.receive(packet)
        self.stats.tokens_rendered += len(rendered)
        self.ack()
        if rendered:
            self.on_tokens(rendered)

    def error_received(self, exc: Exception) -> None:
        log.debug("datagram client: %s", exc)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
