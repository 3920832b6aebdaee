"""Three real `duplexd serve` processes behind a real HAProxy (`duplexd.cluster`), on loopback: sessions
spread over the workers, a full worker gets no new sessions while the others have room, a resume reaches
the process that owns the session (even while it is full), and a worker that dies ends only its own
sessions, with a refusal its clients can act on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from duplexd.clients.loadtest import DEADLINE_MS
from duplexd.clients.stream import SessionRefused, StreamClient
from duplexd.cluster import Cluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (scripts/install-test-deps)"),
]

RATE = 16_000
SILENCE = np.zeros(RATE // 50, "<i2").tobytes()  # 20 ms
PER_WORKER = 2
SETTINGS = {
    "DUPLEXD_TRANSPORT__MAX_SESSIONS": str(PER_WORKER),
    # Capacity is the hard limit here, not the latency controller (which would follow this busy machine).
    "DUPLEXD_ADMISSION__ENABLED": "false",
    "DUPLEXD_SECURITY__AUDIO_BURST_S": "0",
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(3, serve_args=["--no-dialog"], env=SETTINGS, check_ms=200) as c:
        yield c


def wait_status(cluster: Cluster, node: str, status: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {row["svname"]: row["status"] for row in cluster.server_stats()}
        if seen[node] == status:
            return
        assert time.monotonic() < deadline, f"HAProxy never saw {node} {status}: {seen}"
        time.sleep(0.05)


async def open_session(url: str) -> tuple[StreamClient, dict]:
    client = await StreamClient.connect(url)
    return client, await client.start(RATE)


async def acked_past(client: StreamClient, seq: int) -> int:
    """Send silence until the server acknowledges a frame after `seq`; that frame's number."""
    while True:
        await client.send_pcm(SILENCE)
        with contextlib.suppress(TimeoutError):
            while True:
                msg = await asyncio.wait_for(client.ws.recv(), 0.02)
                if isinstance(msg, str) and (ev := json.loads(msg))["type"] == "frame.ack" and ev["seq"] > seq:
                    return int(ev["seq"])


async def close_all(clients: list[StreamClient]) -> None:
    for c in clients:
        await c.close()


async def test_sessions_spread_and_a_full_worker_gets_none(cluster: Cluster) -> None:
    clients, started = [], []
    for _ in range(3):
        c, s = await open_session(cluster.url)
        clients.append(c)
        started.append(s)
    assert sorted(s["node"] for s in started) == ["w1", "w2", "w3"]  # least connections first
    # Each process's own /metrics, scraped through the balancer: one session admitted by each.
    metrics = cluster.scrape()
    assert {node: m["duplexd_sessions_admitted_total"] for node, m in metrics.items()} == {
        "w1": 1.0,
        "w2": 1.0,
        "w3": 1.0,
    }
    assert all(m["duplexd_sessions_active"] == 1.0 for m in metrics.values())
    await close_all(clients)

    # Fill w1 behind the balancer's back: its /readyz turns 503 and HAProxy takes it out of rotation.
    w1 = cluster.worker("w1")
    direct = [(await open_session(f"ws://{w1.host}:{w1.port}/v1/stream"))[0] for _ in range(PER_WORKER)]
    wait_status(cluster, "w1", "DOWN")
    through = [await open_session(cluster.url) for _ in range(2 * PER_WORKER)]  # the room the others have
    assert Counter(s["node"] for _, s in through) == {"w2": PER_WORKER, "w3": PER_WORKER}  # no 1013 for any
    for node in ("w1", "w2", "w3"):  # (one process's /healthz through the balancer: ?node=)
        assert cluster.node_health(node)["sessions"] == PER_WORKER
        wait_status(cluster, node, "DOWN")
    with pytest.raises(InvalidStatus) as refused:  # every worker full: the balancer itself says so
        await open_session(cluster.url)
    assert refused.value.response.status_code == 503

    await close_all(direct + [c for c, _ in through])
    for node in ("w1", "w2", "w3"):
        wait_status(cluster, node, "UP")


async def test_a_resume_reaches_the_owner_even_while_it_is_full(cluster: Cluster) -> None:
    for node in ("w1", "w2", "w3"):
        wait_status(cluster, node, "UP")
    sessions = [await open_session(cluster.url) for _ in range(3)]
    owners = {s["node"]: (c, s) for c, s in sessions}
    assert set(owners) == {"w1", "w2", "w3"}
    # w2 full: the session there plus one opened directly.
    w2 = cluster.worker("w2")
    filler, _ = await open_session(f"ws://{w2.host}:{w2.port}/v1/stream")
    wait_status(cluster, "w2", "DOWN")
    for node, (client, started) in owners.items():
        seq = await acked_past(client, 0)
        assert client.ws.transport is not None
        client.ws.transport.abort()  # the network drops: no closing handshake, the session waits
        resumed, reply = await StreamClient.resume(cluster.url, started, token_seq=0, audio_ms=0, seq=client.seq)
        assert reply["session_id"] == started["session_id"], node
        assert await acked_past(resumed, seq) > seq  # the same session goes on where it was
        owners[node] = (resumed, started)
    await close_all([c for c, _ in owners.values()] + [filler])


async def test_a_dead_worker_ends_only_its_sessions_and_its_clients_can_start_over(cluster_for_kill: Cluster) -> None:
    cluster = cluster_for_kill
    sessions = [await open_session(cluster.url) for _ in range(3)]
    by_node = {s["node"]: (c, s) for c, s in sessions}
    assert set(by_node) == {"w1", "w2", "w3"}
    stop = asyncio.Event()
    lags: dict[str, list[float]] = {"w1": [], "w3": []}

    async def talk(node: str) -> None:  # the survivors stream audio in real time throughout
        client = by_node[node][0]
        t0, i = time.monotonic(), 0
        while not stop.is_set():
            i += 1
            await client.send_pcm(SILENCE)
            await asyncio.sleep(max(0.0, t0 + i * 0.02 - time.monotonic()))

    async def listen(node: str) -> None:
        async for msg in by_node[node][0].ws:
            if isinstance(msg, str) and (ev := json.loads(msg))["type"] == "frame.ack":
                lags[node].append(ev["lag_ms"])

    async with asyncio.TaskGroup() as tg:
        talkers = [tg.create_task(talk(n)) for n in ("w1", "w3")]
        listeners = [tg.create_task(listen(n)) for n in ("w1", "w3")]
        await asyncio.sleep(1.0)
        cluster.kill("w2")
        victim, started = by_node["w2"]
        with pytest.raises(ConnectionClosed):  # the balancer closes the client's side at once
            await asyncio.wait_for(victim.ws.recv(), 10)
        # The client acts on it: a resume (to w2, gone: redispatched) is refused, a new session works.
        with pytest.raises((SessionRefused, InvalidStatus)) as refusal:
            await StreamClient.resume(cluster.url, started, token_seq=0, audio_ms=0, seq=victim.seq)
        if isinstance(refusal.value, SessionRefused):
            assert refusal.value.reply["code"] == "resume_refused"
        again, restarted = await open_session(cluster.url)
        assert restarted["node"] in ("w1", "w3")
        await again.close()
        await asyncio.sleep(2.0)
        stop.set()
        for node in ("w1", "w3"):  # the others kept their deadlines, and were never cut
            assert by_node[node][0].ws.close_code is None
            await by_node[node][0].close()
    assert all(t.exception() is None for t in talkers + listeners)
    for node in ("w1", "w3"):
        assert len(lags[node]) >= 20, node
        assert max(lags[node]) < DEADLINE_MS, (node, max(lags[node]))


@pytest.fixture
def cluster_for_kill() -> Iterator[Cluster]:
    with Cluster(3, serve_args=["--no-dialog"], env=SETTINGS, check_ms=200) as c:
        yield c
