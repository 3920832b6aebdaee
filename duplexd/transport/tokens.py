"""A session's reply tokens on their way to the client.

Every token is numbered and kept by the Eloquent sender until acknowledged (`ack.token_seq` over the
WebSocket, or a datagram ack), so a resume can send again what a dead socket swallowed. Over the WebSocket a
token goes once (reliable and ordered: redundancy would add bytes, not robustness). Over the datagram path,
when the client opened one, each new token goes as an Eloquent packet carrying the unacknowledged tokens
that still need copies, and the sender's timers (its 5 ms repeat, the RTO) run in `run`. A WebRTC call's
unreliable data channel (`open_channel`) carries the same packets, without the datagram's header and MAC:
the channel is inside the call's DTLS.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable
from typing import Any

from duplexd.aio import wait_set
from duplexd.config import TransportConfig
from duplexd.transport.datagram import (
    MAX_PAYLOAD_BYTES,
    DatagramEndpoint,
    DatagramError,
    decode_ack,
    encode_tokens,
    new_key,
)
from duplexd.transport.packetizer import Ack, Eloquent, Packet, SenderConfig


class ReplyTokens:
    def __init__(self, config: TransportConfig, datagram: DatagramEndpoint | None) -> None:
        self.config = config
        self.sender = Eloquent(
            SenderConfig(
                max_tokens=config.max_unacked_tokens,
                max_bytes=config.max_unacked_bytes,
                max_packet_bytes=MAX_PAYLOAD_BYTES - 64,
            )
        )
        self._datagram = datagram
        self.tag: bytes | None = None  # the client's datagram tag, once it opened the path
        self._channel: Callable[[bytes], None] | None = None  # a WebRTC call's unreliable channel, once open
        self._wake = asyncio.Event()

    @property
    def last_seq(self) -> int:
        return self.sender.last_seq

    def open_datagram(self) -> dict[str, Any] | None:
        """Register the session on the datagram endpoint: what the client needs to reach it (None: no
        endpoint on this server)."""
        if self._datagram is None:
            return None
        key = new_key()
        self.tag = self._datagram.register(key, self._on_datagram_ack)
        return {
            "host": self.config.datagram_host or self.config.host,
            "port": self._datagram.port,
            "tag": self.tag.hex(),
            "key": base64.b64encode(key).decode(),
        }

    def open_channel(self, send: Callable[[bytes], None]) -> None:
        """A WebRTC call's unreliable, unordered data channel: every token from now on goes as Eloquent
        packets through `send` (TOKENS payloads), acknowledged by `channel_ack`."""
        self._channel = send

    def channel_ack(self, payload: bytes) -> None:
        """An ACK payload from the call's channel (a malformed or impossible one is ignored, as on UDP)."""
        try:
            ack = decode_ack(payload)
        except DatagramError:
            return
        if ack.token_seq <= self.sender.last_seq:
            self.sender.ack(ack, time.monotonic())

    @property
    def redundant(self) -> bool:
        """Tokens go as Eloquent packets (a datagram path or a call's channel is open)."""
        return self.tag is not None or self._channel is not None

    def close(self) -> None:
        self._channel = None
        if self.tag is not None and self._datagram is not None:
            self._datagram.unregister(self.tag)

    def push(self, reply: int, text: str) -> int:
        """A new token of `reply`: kept, and sent on the datagram path if open. Its number."""
        packets: list[Packet] = []
        if not self.redundant:
            self.sender.add(reply, [text])
        else:
            packets = self.sender.push(reply, [text], time.monotonic())
            self._send(packets)
            self._wake.set()
        return self.sender.last_seq

    def ack(self, seq: int, now: float) -> None:
        """The client has every token through `seq`."""
        self.sender.ack(Ack(seq), now)

    def _on_datagram_ack(self, ack: Ack) -> None:
        if ack.token_seq <= self.sender.last_seq:  # (an authenticated client; a bad ack is just ignored)
            self.sender.ack(ack, time.monotonic())

    def _send(self, packets: list[Packet]) -> None:
        if self._datagram is not None and self.tag is not None:
            for packet in packets:
                self._datagram.send(self.tag, packet)
        if self._channel is not None:
            for packet in packets:
                self._channel(encode_tokens(packet))

    async def run(self) -> None:
        """Eloquent's timers: a packet's repeat 5 ms later, and the unacknowledged tokens after an RTO."""
        while True:
            due = self.sender.next_timer() if self.redundant else None
            self._wake.clear()
            if due is None:
                await self._wake.wait()
                continue
            delay = due - time.monotonic()
            if delay > 0:
                await wait_set(self._wake, delay)
                continue
            self._send(self.sender.poll(time.monotonic()))
