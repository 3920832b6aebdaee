"""A UDP relay that simulates a lossy, slow network path (the asyncio shell over `loss.py`).

Clients send to the relay; the relay forwards to one upstream address. Like a NAT, each client address gets
its own upstream socket, so upstream's replies go back to the client that caused them. Each direction ("up":
client->upstream, "down": upstream->client) has its own `Link`: a packet is lost, or scheduled for delivery
at the time the link gives (`loop.call_at`, one timer per direction for its earliest packet).

Bounded: at most `max_in_flight` packets wait per direction and at most `max_clients` client addresses get an
upstream socket; past either, a packet is dropped and counted as overflow. A send that the kernel refuses
(buffer full, ICMP port unreachable) is dropped and counted as an error, never queued.

Process entry (stops on SIGTERM or SIGINT; prints `{"port": N}` once listening, then the stats, as JSON lines):

    python -m duplexd.bench.relay --listen 127.0.0.1:0 --to 127.0.0.1:9000 --loss ge:0.05:3 --rtt-ms 80
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar

from duplexd.bench.loss import Link, LinkConfig

Address = tuple[str, int]
SockAddr = tuple[Any, ...]  # (host, port), or (host, port, flowinfo, scope_id) for IPv6

UP_SEED_OFFSET = 0
DOWN_SEED_OFFSET = 1
MAX_DATAGRAM_BYTES = 65535
_READS_PER_WAKEUP = 256  # datagrams read per readiness callback, so one busy socket cannot starve the others

_Target = TypeVar("_Target")


@dataclass(slots=True)
class DirectionStats:
    received: int = 0  # packets that reached the relay
    delivered: int = 0  # ... handed to the kernel at their delivery time
    lost: int = 0  # ... dropped by the link's loss model
    overflow: int = 0  # ... dropped because max_in_flight (or, up, max_clients) was reached
    errors: int = 0  # sends the kernel refused, and socket errors reported for this direction
    in_flight: int = 0  # packets waiting for their delivery time now


@dataclass(slots=True)
class RelayStats:
    up: DirectionStats = field(default_factory=DirectionStats)
    down: DirectionStats = field(default_factory=DirectionStats)
    clients: int = 0  # client addresses with an upstream socket

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class _Pipe(Generic[_Target]):
    """One direction: packets waiting for their delivery time, earliest first (ties in arrival order)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        link: Link,
        max_in_flight: int,
        stats: DirectionStats,
        send: Callable[[bytes, _Target], bool],
    ) -> None:
        self._loop = loop
        self._link = link
        self._max_in_flight = max_in_flight
        self._stats = stats
        self._send = send
        self._heap: list[tuple[float, int, bytes, _Target]] = []
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None

    def admit(self) -> float | None:
        """Counts a received packet and asks the link for its delivery time (None: lost)."""
        self._stats.received += 1
        when = self._link.admit(self._loop.time())
        if when is None:
            self._stats.lost += 1
        return when

    def has_room(self) -> bool:
        return len(self._heap) < self._max_in_flight

    def overflow(self) -> None:
        self._stats.overflow += 1

    def push(self, when: float, data: bytes, target: _Target) -> None:
        if not self.has_room():
            self.overflow()
            return
        item = (when, self._seq, data, target)
        self._seq += 1
        heapq.heappush(self._heap, item)
        self._stats.in_flight = len(self._heap)
        if self._heap[0] is item:
            self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()
        self._stats.in_flight = 0

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        due = self._heap[0][0]
        self._timer = self._loop.call_at(due, self._fire, due)

    def _fire(self, due: float) -> None:
        self._timer = None
        # The loop runs a timer up to one clock tick early: deliver what was due, and anything due since.
        limit = max(due, self._loop.time())
        heap, stats = self._heap, self._stats
        while heap and heap[0][0] <= limit:
            _, _, data, target = heapq.heappop(heap)
            if self._send(data, target):
                stats.delivered += 1
            else:
                stats.errors += 1
        stats.in_flight = len(heap)
        if heap:
            self._arm()


class _Client:
    __slots__ = ("addr", "sock")

    def __init__(self, addr: SockAddr, sock: socket.socket) -> None:
        self.addr = addr
        self.sock = sock


class UdpRelay:
    """Forwards datagrams between clients and one upstream address through two simulated links."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        listen_sock: socket.socket,
        upstream: tuple[int, SockAddr],
        up: LinkConfig,
        down: LinkConfig,
        max_in_flight: int,
        max_clients: int,
    ) -> None:
        """Use `UdpRelay.start`."""
        self._loop = loop
        self._sock = listen_sock
        self._upstream_family, self._upstream_addr = upstream
        self._max_clients = max_clients
        self._clients: dict[SockAddr, _Client] = {}
        self.stats = RelayStats()
        self._up: _Pipe[_Client] = _Pipe(loop, Link(up, UP_SEED_OFFSET), max_in_flight, self.stats.up, self._send_up)
        self._down: _Pipe[SockAddr] = _Pipe(
            loop, Link(down, DOWN_SEED_OFFSET), max_in_flight, self.stats.down, self._send_down
        )
        self._closed = False
        loop.add_reader(listen_sock.fileno(), self._on_client_readable)

    @classmethod
    async def start(
        cls,
        *,
        upstream: Address,
        listen: Address = ("127.0.0.1", 0),
        up: LinkConfig | None = None,
        down: LinkConfig | None = None,
        max_in_flight: int = 4096,
        max_clients: int = 1024,
    ) -> UdpRelay:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight!r}")
        if max_clients < 1:
            raise ValueError(f"max_clients must be >= 1, got {max_clients!r}")
        if upstream[1] <= 0:
            raise ValueError(f"upstream must name a port, got {upstream!r}")
        loop = asyncio.get_running_loop()
        listen_family, listen_addr = await _resolve(loop, listen)
        upstream_resolved = await _resolve(loop, upstream)
        sock = socket.socket(listen_family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.bind(listen_addr)
            return cls(
                loop, sock, upstream_resolved, up or LinkConfig(), down or LinkConfig(), max_in_flight, max_clients
            )
        except BaseException:
            sock.close()
            raise

    @property
    def address(self) -> Address:
        host, port = self._sock.getsockname()[:2]
        return host, port

    @property
    def port(self) -> int:
        return self.address[1]

    def close(self) -> None:
        """Stops at once: packets still in flight are dropped (they stay counted as received)."""
        if self._closed:
            return
        self._closed = True
        self._up.close()
        self._down.close()
        for client in self._clients.values():
            self._loop.remove_reader(client.sock.fileno())
            client.sock.close()
        self._clients.clear()
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    async def __aenter__(self) -> UdpRelay:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # Up: client -> relay -> (per-client socket) -> upstream.

    def _on_client_readable(self) -> None:
        for _ in range(_READS_PER_WAKEUP):
            try:
                data, raw_addr = self._sock.recvfrom(MAX_DATAGRAM_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.stats.down.errors += 1  # an error queued by an earlier send to a client
                continue
            when = self._up.admit()
            if when is None:
                continue
            addr: SockAddr = raw_addr
            client = self._clients.get(addr)
            if client is None:
                if not self._up.has_room() or len(self._clients) >= self._max_clients:
                    self._up.overflow()
                    continue
                client = self._open_client(addr)
            self._up.push(when, data, client)

    def _open_client(self, addr: SockAddr) -> _Client:
        sock = socket.socket(self._upstream_family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.connect(self._upstream_addr)  # replies from anyone else are filtered by the kernel
        except BaseException:
            sock.close()
            raise
        client = _Client(addr, sock)
        self._clients[addr] = client
        self.stats.clients = len(self._clients)
        self._loop.add_reader(sock.fileno(), self._on_upstream_readable, client)
        return client

    def _send_up(self, data: bytes, client: _Client) -> bool:
        try:
            client.sock.send(data)
        except OSError:  # buffer full, or upstream's port unreachable (reported on a later send)
            return False
        return True

    # Down: upstream -> client's socket -> relay -> client.

    def _on_upstream_readable(self, client: _Client) -> None:
        for _ in range(_READS_PER_WAKEUP):
            try:
                data = client.sock.recv(MAX_DATAGRAM_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.stats.up.errors += 1  # e.g. ICMP port unreachable from upstream
                continue
            when = self._down.admit()
            if when is not None:
                self._down.push(when, data, client.addr)

    def _send_down(self, data: bytes, addr: SockAddr) -> bool:
        try:
            self._sock.sendto(data, addr)
        except OSError:
            return False
        return True


async def _resolve(loop: asyncio.AbstractEventLoop, address: Address) -> tuple[int, SockAddr]:
    host, port = address
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    if not infos:
        raise ValueError(f"cannot resolve {host!r}")
    family, _, _, _, sockaddr = infos[0]
    return family, tuple(sockaddr)


def _host_port(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6HOST]:PORT` or `:PORT` (loopback)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in {text!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range in {text!r}")
    return host or "127.0.0.1", number


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="duplexd relay",
        description="UDP relay that simulates loss, delay and jitter between clients and one upstream address.",
    )
    p.add_argument("--listen", type=_host_port, default=("127.0.0.1", 0), help="HOST:PORT (default 127.0.0.1:0)")
    p.add_argument("--to", type=_host_port, required=True, help="upstream HOST:PORT")
    p.add_argument(
        "--loss", default="none", help="loss spec: none, bernoulli:P, ge:MEAN_LOSS:BURST_PACKETS or trace:PATH"
    )
    p.add_argument("--loss-down", default=None, help="loss spec of the upstream->client direction (default: --loss)")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip delay; each direction adds half")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform jitter of each one-way delay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-in-flight", type=int, default=4096, help="packets waiting per direction")
    p.add_argument("--max-clients", type=int, default=1024)
    return p


async def _serve(args: argparse.Namespace, up: LinkConfig, down: LinkConfig) -> RelayStats:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with await UdpRelay.start(
        listen=args.listen,
        upstream=args.to,
        up=up,
        down=down,
        max_in_flight=args.max_in_flight,
        max_clients=args.max_clients,
    ) as relay:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            print(json.dumps({"port": relay.port}), flush=True)
            await stop.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        return relay.stats


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        up = LinkConfig(loss=args.loss, rtt_ms=args.rtt_ms, jitter_ms=args.jitter_ms, seed=args.seed)
        down_loss = args.loss if args.loss_down is None else args.loss_down
        down = LinkConfig(loss=down_loss, rtt_ms=args.rtt_ms, jitter_ms=args.jitter_ms, seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    if args.max_in_flight < 1 or args.max_clients < 1:
        parser.error("--max-in-flight and --max-clients must be >= 1")
    try:
        stats = asyncio.run(_serve(args, up, down))
    except OSError as e:  # e.g. the listen address is taken
        print(f"duplexd relay: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
