"""What a connection owes its socket: the bounded outbox, how it wants the socket closed, the socket's face.

The sans-socket core (`transport.connection.Connection`) fills these; the WebSocket shell
(`transport.shell.WebSocketShell`) writes the outbox and closes as asked.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Protocol

# RFC 6455 close codes.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY = 1008
CLOSE_INTERNAL = 1011
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_WILL_RESUME = 4000  # a client closing with this code keeps its session for `session.resume`

SLOW_CLOSE_S = 2.0  # a client that does not read: how long its closing handshake may take before the drop


class Closing(Exception):
    """Raised inside the core (by it or its codec) to end the connection; `receive` / `open` catch it."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Close:
    """How the core wants its socket closed. `flush`: after what is queued has been written (else at once:
    a client that does not read, or a resume refused, with only `final` written first)."""

    code: int
    reason: str
    flush: bool = True
    final: tuple[str, ...] = ()


class Link(Protocol):
    """The socket a connection is attached to, as the core sees it (`transport.shell.WebSocketShell`)."""

    def buffered(self) -> int: ...  # bytes written to the socket and not yet sent
    def abort(self) -> None: ...  # drop the socket, no closing handshake (a half-open one, before a resume)


class Outbox:
    """What waits to be written to the client: at most `limit` messages (`transport.outbound_queue`);
    `put` says False when it is full. `ready` is set whenever there is something to write."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: deque[str | bytes] = deque()
        self.ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return sum(len(m) for m in self._items)

    def put(self, msg: str | bytes) -> bool:
        if len(self._items) >= self.limit:
            return False
        self._items.append(msg)
        self.ready.set()
        return True

    def take(self) -> list[str | bytes]:
        items = list(self._items)
        self._items.clear()
        return items

    def replace(self, items: list[str | bytes]) -> None:
        """A resume's handover: what a new socket gets first (bounded by its parts: the resume's audio and
        token buffers, and what this queue held), then room for `limit` more."""
        self._items = deque(items)
        if items:
            self.ready.set()
