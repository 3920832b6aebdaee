"""The WebSocket under a session's connection: the only code that reads or writes a session's socket.

`WebSocketShell` attaches a `connection.Connection` (the sans-socket core) to one WebSocket: a reader hands
it each message with the time it arrived, a sender writes what the core queues, a pacer ticks its reply audio,
the reply tokens' timer repeats unacknowledged datagrams, and the socket is closed as the core asks. When the
socket goes, the core hears it (`link_lost`), and keeps its session for a resume if the link merely dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

from duplexd.transport import protocol
from duplexd.transport.connection import Connection
from duplexd.transport.outbox import SLOW_CLOSE_S, Close


class WebSocketShell:
    def __init__(self, conn: Connection, ws: ServerConnection, idle_timeout_s: float) -> None:
        self.conn = conn
        self.ws = ws
        self.idle_s = idle_timeout_s or None

    # `connection.Link`: the socket as the core sees it

    def buffered(self) -> int:
        transport = self.ws.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    def abort(self) -> None:
        if self.ws.transport is not None:
            self.ws.transport.abort()

    async def run(self, resume: protocol.SessionResume | None = None) -> None:
        """Serve the connection on this socket until either side ends it; `resume`: this socket continues
        the connection's session (`session.resume`)."""
        conn = self.conn
        conn.attach(self)
        # (apart from the task group: a failing reader must not cancel a close in progress)
        closer = asyncio.get_running_loop().create_task(self._close_when_urgent())
        try:
            if resume is not None:
                conn.take_over(resume, time.monotonic())
            async with asyncio.TaskGroup() as tg:
                sender = tg.create_task(self._send_loop())
                timers = [tg.create_task(conn.pace()), tg.create_task(conn.tokens.run())]
                try:
                    if conn.close is None:
                        await conn.open(time.monotonic())
                    if conn.close is None:
                        await self._read_loop()
                    conn.finish()
                    await sender
                    if conn.close is not None and conn.close.flush:
                        await self.ws.close(conn.close.code, conn.close.reason)
                finally:
                    for task in timers:
                        task.cancel()
        except* ConnectionClosed:
            pass
        finally:
            if conn.urgent.is_set():
                await closer  # (bounded: SLOW_CLOSE_S, then the socket is dropped)
            else:
                closer.cancel()
            close = self.ws.protocol.close_rcvd  # (None: the link failed without a closing handshake)
            conn.link_lost(None if close is None else close.code, time.monotonic())

    async def _read_loop(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.idle_s):  # (not wait_for: see duplexd/aio.py)
                    message = await self.ws.recv()
            except TimeoutError:
                self.conn.timed_out(self.idle_s or 0.0)
                return
            except ConnectionClosedOK:
                return
            if await self.conn.receive(message, time.monotonic()):
                return

    async def _send_loop(self) -> None:
        conn = self.conn
        while not conn.urgent.is_set():
            batch = conn.data_to_send()
            if not batch:
                if conn.finished:
                    return
                conn.outbox.ready.clear()
                await conn.outbox.ready.wait()
                continue
            for msg in batch:
                await self.ws.send(msg)

    async def _close_when_urgent(self) -> None:
        """A close that does not wait for the outbox (a client that does not read, a resume refused): write
        only its own last words, and drop the socket if the closing handshake does not finish in time."""
        await self.conn.urgent.wait()
        close: Close | None = self.conn.close
        assert close is not None
        with contextlib.suppress(TimeoutError, ConnectionClosed):
            async with asyncio.timeout(SLOW_CLOSE_S):
                for msg in close.final:
                    await self.ws.send(msg)
                await self.ws.close(close.code, close.reason)
        self.abort()
