"""The UDP relay shell: real sockets on loopback, a real echo server upstream, no mocks."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import cast

import pytest

import duplexd
from duplexd.bench.loss import Link, LinkConfig, Trace
from duplexd.bench.relay import UP_SEED_OFFSET, UdpRelay, main

TIMEOUT_S = 10.0
REPO_ROOT = Path(duplexd.__file__).resolve().parents[1]


class _Peer(asyncio.DatagramProtocol):
    """A UDP endpoint that queues what it receives (with the arrival time) and, as upstream, echoes it."""

    def __init__(self, echo: bool) -> None:
        self.echo = echo
        self.received: asyncio.Queue[tuple[bytes, tuple[str, int], float]] = asyncio.Queue(maxsize=10_000)
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # the selector's isn't a subclass in 3.11

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.received.put_nowait((data, addr, time.monotonic()))
        if self.echo:
            assert self.transport is not None
            self.transport.sendto(b"echo:" + data, addr)

    @property
    def port(self) -> int:
        assert self.transport is not None
        return self.transport.get_extra_info("sockname")[1]

    def send(self, data: bytes, port: int) -> None:
        assert self.transport is not None
        self.transport.sendto(data, ("127.0.0.1", port))

    async def recv(self) -> tuple[bytes, tuple[str, int], float]:
        return await asyncio.wait_for(self.received.get(), TIMEOUT_S)

    async def recv_n(self, n: int) -> list[bytes]:
        return [(await self.recv())[0] for _ in range(n)]


async def _open_peer(echo: bool = False) -> _Peer:
    loop = asyncio.get_running_loop()
    _, peer = await loop.create_datagram_endpoint(lambda: _Peer(echo), local_addr=("127.0.0.1", 0))
    return peer


OpenPeer = Callable[..., Awaitable[_Peer]]


@pytest.fixture
async def peers() -> AsyncIterator[OpenPeer]:
    opened: list[_Peer] = []

    async def open_peer(echo: bool = False) -> _Peer:
        peer = await _open_peer(echo)
        opened.append(peer)
        return peer

    yield open_peer
    for peer in opened:
        assert peer.transport is not None
        peer.transport.close()


async def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


async def _settle() -> None:
    """Gives a wrongly delivered packet time to show up (the relay's links here add no delay)."""
    await asyncio.sleep(0.05)


async def test_lossless_both_ways_to_the_right_client(peers: OpenPeer) -> None:
    upstream = await peers(echo=True)
    a, b = await peers(), await peers()
    async with await UdpRelay.start(upstream=("127.0.0.1", upstream.port)) as relay:
        for i in range(5):
            a.send(b"a%d" % i, relay.port)
            b.send(b"b%d" % i, relay.port)
        assert await a.recv_n(5) == [b"echo:a%d" % i for i in range(5)]
        assert await b.recv_n(5) == [b"echo:b%d" % i for i in range(5)]
        seen = [await upstream.recv() for _ in range(10)]
        await _settle()
        assert a.received.empty() and b.received.empty()
        # Like a NAT: one upstream socket per client, neither of them the client's own address.
        sources = {data[:1]: addr for data, addr, _ in seen}
        assert len(set(sources.values())) == 2
        assert sources[b"a"][1] not in (a.port, b.port) and sources[b"b"][1] not in (a.port, b.port)
        stats = relay.stats
        assert (stats.up.received, stats.up.delivered, stats.up.lost, stats.up.overflow) == (10, 10, 0, 0)
        assert (stats.down.received, stats.down.delivered, stats.down.lost, stats.down.overflow) == (10, 10, 0, 0)
        assert stats.clients == 2 and stats.up.in_flight == stats.down.in_flight == 0
        assert stats.as_dict()["up"] == {
            "received": 10,
            "delivered": 10,
            "lost": 0,
            "overflow": 0,
            "errors": 0,
            "in_flight": 0,
        }


async def test_bernoulli_1_drops_everything_up(peers: OpenPeer) -> None:
    upstream = await peers(echo=True)
    client = await peers()
    up = LinkConfig(loss="bernoulli:1")
    async with await UdpRelay.start(upstream=("127.0.0.1", upstream.port), up=up) as relay:
        for i in range(20):
            client.send(b"%d" % i, relay.port)
        await _until(lambda: relay.stats.up.received == 20)
        await _settle()
        assert upstream.received.empty() and client.received.empty()
        assert relay.stats.up.lost == 20 and relay.stats.up.delivered == 0
        assert relay.stats.clients == 0  # no upstream socket for a client whose packets were all lost


async def test_bernoulli_1_drops_everything_down(peers: OpenPeer) -> None:
    upstream = await peers(echo=True)
    client = await peers()
    down = LinkConfig(loss="bernoulli:1")
    async with await UdpRelay.start(upstream=("127.0.0.1", upstream.port), down=down) as relay:
        for i in range(20):
            client.send(b"%d" % i, relay.port)
        assert await upstream.recv_n(20) == [b"%d" % i for i in range(20)]
        await _until(lambda: relay.stats.down.received == 20)
        await _settle()
        assert client.received.empty()
        assert relay.stats.down.lost == 20 and relay.stats.down.delivered == 0
        assert relay.stats.up.delivered == 20 and relay.stats.up.lost == 0


async def test_trace_drops_exactly_the_listed_packets_in_order(peers: OpenPeer, tmp_path: Path) -> None:
    up_pattern = [False, True, True, False, False, True, False, False]  # looped over 20 packets
    down_pattern = [True, False, False, False, True, True, False, False, False, False, False, False, True]
    Trace.save(tmp_path / "up.trace", up_pattern, comment="up")
    Trace.save(tmp_path / "down.trace", down_pattern, comment="down")
    up = LinkConfig(loss=f"trace:{tmp_path / 'up.trace'}")
    down = LinkConfig(loss=f"trace:{tmp_path / 'down.trace'}")
    upstream = await peers(echo=True)
    client = await peers()
    async with await UdpRelay.start(upstream=("127.0.0.1", upstream.port), up=up, down=down) as relay:
        for i in range(20):
            client.send(b"%d" % i, relay.port)
        up_expected = [b"%d" % i for i in range(20) if not up_pattern[i % len(up_pattern)]]
        assert await upstream.recv_n(len(up_expected)) == up_expected
        down_expected = [b"echo:" + d for j, d in enumerate(up_expected) if not down_pattern[j % len(down_pattern)]]
        assert await client.recv_n(len(down_expected)) == down_expected
        await _until(lambda: relay.stats.down.received == len(up_expected))
        await _settle()
        assert upstream.received.empty() and client.received.empty()
        assert relay.stats.up.lost == 20 - len(up_expected)
        assert relay.stats.down.lost == len(up_expected) - len(down_expected)


async def test_one_way_delay_is_half_the_rtt_each_way(peers: OpenPeer) -> None:
    upstream = await peers(echo=True)
    client = await peers()
    link = LinkConfig(rtt_ms=100.0)
    async with await UdpRelay.start(upstream=("127.0.0.1", upstream.port), up=link, down=link) as relay:
        for i in range(3):
            sent = time.monotonic()
            client.send(b"%d" % i, relay.port)
            data, _, arrived_up = await upstream.recv()
            echo, _, arrived_back = await client.recv()
            assert (data, echo) == (b"%d" % i, b"echo:%d" % i)
            # Lower bounds only: a busy machine adds delay, never removes it.
            assert arrived_up - sent >= 0.050 - 0.001
            assert arrived_back - sent >= 0.100 - 0.001


async def test_jitter_delays_each_packet_by_its_draw_and_reorders(peers: OpenPeer) -> None:
    upstream = await peers()
    client = await peers()
    up = LinkConfig(rtt_ms=60.0, jitter_ms=30.0, seed=5)
    replica = Link(up, UP_SEED_OFFSET)  # draws the same delays as the relay's up link
    delays = [replica.admit(0.0) for _ in range(10)]
    # The draws put some packet at least 20 ms behind a later one: the relay must reorder them.
    assert any(d_i - d_j > 0.020 for i, d_i in enumerate(delays) for d_j in delays[i + 1 :])  # type: ignore[operator]
    async with await UdpRelay.start(upstream=("127.0.0.1", upstream.port), up=up) as relay:
        sent: list[float] = []
        for i in range(10):
            sent.append(time.monotonic())
            client.send(b"%d" % i, relay.port)
        arrivals = [await upstream.recv() for _ in range(10)]
    order = [int(data) for data, _, _ in arrivals]
    assert sorted(order) == list(range(10)) and order != list(range(10))
    for data, _, arrived in arrivals:
        i = int(data)
        assert arrived - sent[i] >= delays[i] - 0.001  # type: ignore[operator]


async def test_overflow_is_counted_past_max_in_flight(peers: OpenPeer) -> None:
    upstream = await peers()
    client = await peers()
    up = LinkConfig(rtt_ms=20_000.0)  # nothing is delivered during the test
    relay = await UdpRelay.start(upstream=("127.0.0.1", upstream.port), up=up, max_in_flight=2)
    try:
        for i in range(10):
            client.send(b"%d" % i, relay.port)
        await _until(lambda: relay.stats.up.received == 10)
        stats = relay.stats.up
        assert (stats.overflow, stats.in_flight, stats.delivered, stats.lost) == (8, 2, 0, 0)
    finally:
        relay.close()
    relay.close()  # idempotent
    assert relay.stats.up.in_flight == 0 and upstream.received.empty()


async def test_clients_past_max_clients_overflow(peers: OpenPeer) -> None:
    upstream = await peers(echo=True)
    a, b = await peers(), await peers()
    async with await UdpRelay.start(upstream=("127.0.0.1", upstream.port), max_clients=1) as relay:
        a.send(b"a", relay.port)
        assert (await a.recv())[0] == b"echo:a"
        b.send(b"b", relay.port)
        a.send(b"a2", relay.port)
        assert (await a.recv())[0] == b"echo:a2"
        await _settle()
        assert b.received.empty()
        assert relay.stats.clients == 1 and relay.stats.up.overflow == 1 and relay.stats.up.delivered == 2


async def test_start_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        await UdpRelay.start(upstream=("127.0.0.1", 9), max_in_flight=0)
    with pytest.raises(ValueError, match="upstream"):
        await UdpRelay.start(upstream=("127.0.0.1", 0))


def test_main_rejects_a_bad_spec(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--to", "127.0.0.1:9", "--loss", "bernoulli:7"])
    assert exit_info.value.code == 2
    assert "bernoulli:7" in capsys.readouterr().err


async def test_process_entry_forwards_and_stops_on_sigterm(peers: OpenPeer) -> None:
    upstream = await peers(echo=True)
    client = await peers()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "duplexd.bench.relay",
        "--listen",
        "127.0.0.1:0",
        "--to",
        f"127.0.0.1:{upstream.port}",
        "--loss",
        "none",
        "--rtt-ms",
        "10",
        "--jitter-ms",
        "2",
        "--seed",
        "3",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO_ROOT,  # `-m` imports from here: the code under test, wherever pytest was started
    )
    try:
        assert proc.stdout is not None
        first = await asyncio.wait_for(proc.stdout.readline(), 60)
        port = json.loads(first)["port"]
        assert isinstance(port, int) and port > 0
        client.send(b"hello", port)
        assert (await upstream.recv())[0] == b"hello"
        assert (await client.recv())[0] == b"echo:hello"
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    stats = json.loads(out.decode().strip().splitlines()[-1])
    assert stats["up"]["received"] == stats["up"]["delivered"] == 1
    assert stats["down"]["received"] == stats["down"]["delivered"] == 1
    assert stats["clients"] == 1
