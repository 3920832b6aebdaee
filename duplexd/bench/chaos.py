"""Misbehaving clients against a real server: fuzzed messages on both endpoints (hypothesis strategies),
abrupt disconnects with resume, and a bystander whose session must not notice.

The strategies generate what a buggy or hostile client sends: every message type of both protocols with
fields of the wrong type, missing, out of range or unknown; JSON that is not an object; text that is not
JSON; binary frames with random headers, kinds, sequence numbers and payload sizes. `corpus` draws them
with hypothesis (derandomized, so a seed reproduces a run); `duplexd bench chaos` and
tests/transport/test_fuzz.py send them over real sockets.

Requires the test extras (hypothesis).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import platform
import resource
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

log = logging.getLogger(__name__)

NATIVE_TYPES = ["session.start", "session.end", "playback", "reply.cancel", "ack", "session.resume"]
REALTIME_TYPES = [
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "response.create",
    "response.cancel",
    "conversation.item.truncate",
]
# A server that closes for a reason says so: 1011 (an internal error) or a dropped TCP stream is a crash.
CLEAN_CLOSES = {1000, 1001, 1002, 1003, 1007, 1008, 1009, 1013}
SOAK_KEYS = ("sessions_admitted", "deadline_miss_ratio", "eos_to_first_audio_p90_s", "collapsed")
SUMMARY_KEYS = (
    "fuzz_messages",
    "crashes",
    "reconnect_cycles",
    "lost_tokens",
    "lost_events",
    "soak_rss_growth_mb",
    "slow_reader_max_buffer_bytes",
)

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12,
)


def _valid_native() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("session.start"), "version": st.just(1), "sample_rate": st.sampled_from([16000, 48000])},
            optional={"dialog": st.booleans(), "datagram": st.booleans()},
        ),
        st.fixed_dictionaries({"type": st.just("playback"), "played_ms": st.floats(-10, 1e6)}),
        st.fixed_dictionaries({"type": st.just("ack"), "token_seq": st.integers(-5, 1000)}),
        st.just({"type": "reply.cancel"}),
    )


def _valid_realtime() -> st.SearchStrategy[dict[str, Any]]:
    audio = st.binary(min_size=0, max_size=4800).map(lambda b: base64.b64encode(b).decode())
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("input_audio_buffer.append"), "audio": audio}),
        st.fixed_dictionaries(
            {
                "type": st.just("session.update"),
                "session": st.fixed_dictionaries(
                    {"type": st.just("realtime")},
                    optional={
                        "instructions": st.text(max_size=60),
                        "output_modalities": st.sampled_from([["audio"], ["text"], ["video"], []]),
                        "audio": st.fixed_dictionaries(
                            {},
                            optional={
                                "input": st.fixed_dictionaries(
                                    {},
                                    optional={
                                        "turn_detection": st.one_of(
                                            st.none(),
                                            st.fixed_dictionaries(
                                                {"type": st.just("server_vad")},
                                                optional={"silence_duration_ms": st.integers(-100, 20000)},
                                            ),
                                        )
                                    },
                                )
                            },
                        ),
                    },
                ),
            }
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("conversation.item.create"),
                "item": st.fixed_dictionaries(
                    {
                        "type": st.just("message"),
                        "role": st.sampled_from(["user", "assistant", "system"]),
                        "content": st.lists(
                            st.fixed_dictionaries(
                                {"type": st.sampled_from(["input_text", "input_audio"]), "text": st.text(max_size=40)}
                            ),
                            max_size=2,
                        ),
                    }
                ),
            }
        ),
        st.sampled_from([{"type": t} for t in REALTIME_TYPES]),
        st.fixed_dictionaries(
            {
                "type": st.just("conversation.item.truncate"),
                "item_id": st.text(max_size=10),
                "audio_end_ms": st.integers(-10, 10**7),
            }
        ),
    )


def _mutated(types: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """A known `type` with arbitrary fields, or an arbitrary `type`."""
    return st.builds(
        lambda t, extra: {"type": t, **extra},
        st.one_of(st.sampled_from(types), st.text(max_size=30), _scalars),
        st.dictionaries(st.text(max_size=16), _json, max_size=5),
    )


def _binary() -> st.SearchStrategy[bytes]:
    header = st.builds(
        lambda kind, seq: struct.pack("<B3xI", kind, seq), st.integers(0, 255), st.integers(0, 2**32 - 1)
    )
    return st.one_of(
        st.binary(max_size=64),
        st.builds(lambda h, body: h + body, header, st.binary(max_size=9000)),
        st.builds(
            lambda seq, n: struct.pack("<B3xI", 1, seq) + bytes(2 * n), st.integers(0, 2**32 - 1), st.integers(0, 5000)
        ),
    )


def messages(endpoint: str) -> st.SearchStrategy[str | bytes]:
    valid = _valid_native() if endpoint == "stream" else _valid_realtime()
    types = NATIVE_TYPES if endpoint == "stream" else REALTIME_TYPES
    as_json = st.one_of(valid, _mutated(types), _json).map(lambda m: json.dumps(m, allow_nan=True))
    return st.one_of(as_json, as_json, st.text(max_size=80), _binary())


def corpus(endpoint: str, examples: int, max_per_connection: int = 40) -> list[list[str | bytes]]:
    """`examples` message sequences (one per connection), drawn by hypothesis from `messages(endpoint)`
    (derandomized: the same corpus every run);
    stream sequences start with a valid `session.start` half of the time (so the session's own handlers,
    not only the handshake's, get the rest)."""
    out: list[list[str | bytes]] = []
    start = json.dumps({"type": "session.start", "version": 1, "sample_rate": 16000, "dialog": True})

    @settings(
        max_examples=examples,
        database=None,
        derandomize=True,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.booleans(), st.lists(messages(endpoint), min_size=1, max_size=max_per_connection))
    def collect(started: bool, msgs: list[str | bytes]) -> None:
        out.append(([start] if started and endpoint == "stream" else []) + msgs)

    collect()
    return out


def corpus_of(endpoint: str, messages: int) -> list[list[str | bytes]]:
    """A corpus of at least `messages` messages (hypothesis decides the sequences' lengths)."""
    examples = max(1, messages // 4)
    while True:
        sequences = corpus(endpoint, examples)
        if sum(map(len, sequences)) >= messages:
            return sequences
        examples = int(examples * 1.5) + 1


@dataclass(slots=True)
class FuzzResult:
    connections: int = 0
    messages: int = 0
    closes: dict[str, int] = field(default_factory=dict)
    crashes: int = 0  # connections that ended with an unclean close (1011, or no close frame)
    refused_handshakes: int = 0
    refusals: dict[str, int] = field(default_factory=dict)  # HTTP status -> count


async def fuzz(url: str, sequences: Sequence[Sequence[str | bytes]], *, concurrency: int = 4) -> FuzzResult:
    """Send each sequence on its own connection (`concurrency` at a time); record how each ended."""
    result = FuzzResult()
    queue = list(sequences)

    async def one(seq: Sequence[str | bytes]) -> None:
        try:
            async with connect(url, open_timeout=20, close_timeout=5, max_size=2**22) as ws:
                result.connections += 1

                async def drain() -> None:
                    try:
                        async for _ in ws:
                            pass
                    except ConnectionClosed:
                        pass  # (how it closed is read from `close_code` below)

                async with asyncio.TaskGroup() as tg:
                    reader = tg.create_task(drain())
                    for msg in seq:
                        try:
                            await ws.send(msg)
                            result.messages += 1
                        except ConnectionClosed:
                            break
                    try:
                        await asyncio.wait_for(ws.close(), 10)
                    except TimeoutError:
                        pass
                    reader.cancel()
        except ConnectionClosed:
            pass
        except InvalidStatus as exc:
            result.refused_handshakes += 1
            status = str(exc.response.status_code)
            result.refusals[status] = result.refusals.get(status, 0) + 1
            return
        code = ws.close_code
        result.closes[str(code)] = result.closes.get(str(code), 0) + 1
        if code not in CLEAN_CLOSES:
            result.crashes += 1
            log.warning("connection ended with %s after %d messages", code, len(seq))

    async def worker() -> None:
        while queue:
            await one(queue.pop())

    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    return result


def plot_soak(result: dict[str, Any], path: Path) -> None:
    """The server's RSS over the soak, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [x["t_s"] for x in result["soak_rss_mb"]]
    ys = [x["rss_mb"] for x in result["soak_rss_mb"]]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(xs, ys, marker=".", lw=1)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title(f"soak: {result['soak_sessions']} conversation(s), {result['soak_s']:.0f} s")
    ax.set_ylim(min(ys) - 100, max(ys) + 100)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(args: argparse.Namespace) -> int:
    import sys

    from duplexd.bench import scenarios as sc
    from duplexd.bench.server import child_process, health
    from duplexd.clients import loadtest
    from duplexd.clients.clips import load_clips
    from duplexd.netutil import free_port

    t0 = time.monotonic()
    clips = load_clips(args.data) if args.data else load_clips()
    speech = sc.load(next(c for c in clips if c.path.name.startswith("clip22")).path)
    port = free_port()
    # Fuzzing the handlers, not the admission controller: garbage audio makes lag, and a server that
    # refuses the next sessions would spare its handlers the rest of the corpus. (And every client here
    # comes from one address: no per-address limit either.)
    env = dict(os.environ)
    env.update(
        {
            "DUPLEXD_SECURITY__AUDIO_BURST_S": "0",
            "DUPLEXD_ADMISSION__ENABLED": "false",
            "DUPLEXD_SECURITY__MAX_CONNECTIONS_PER_IP": "100000",
        }
    )
    cmd = [sys.executable, "-m", "duplexd", "serve", "--port", str(port)]
    out: dict[str, Any] = {
        "bench": "chaos",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    with child_process(cmd, name="duplexd serve", up=lambda: health(port), env=env) as proc:
        base = f"ws://127.0.0.1:{port}"
        results = {}
        for endpoint, path in (("stream", "/v1/stream"), ("realtime", "/v1/realtime")) if args.fuzz_messages else ():
            sequences = corpus_of(endpoint, args.fuzz_messages // 2)
            results[endpoint] = asyncio.run(fuzz(base + path, sequences))
            log.info("fuzzed %s: %s", endpoint, results[endpoint])
        out["fuzz_messages"] = sum(r.messages for r in results.values())
        out["fuzz_connections"] = sum(r.connections for r in results.values())
        out["crashes"] = sum(r.crashes for r in results.values()) if results else None
        out["fuzz"] = {k: asdict(v) for k, v in results.items()}
        out["healthy_after_fuzz"] = health(port)["status"] == "ok"
        # Fuzz clients that vanished mid-session left their sessions waiting for a resume (30 s).
        deadline = time.monotonic() + 60
        while health(port)["sessions"] and time.monotonic() < deadline:
            time.sleep(1)
        out["sessions_left_after_fuzz"] = health(port)["sessions"]

        if args.cycles:
            t = time.monotonic()

            def progress(i: int) -> None:
                if i % 100 == 99:
                    log.info("reconnect cycle %d", i + 1)

            cycles = asyncio.run(reconnect_cycles(base + "/v1/stream", speech, sc.RATE, args.cycles, on_cycle=progress))
            log.info("reconnect cycles: %s", cycles)
            out.update(
                reconnect_cycles=cycles.cycles,
                lost_tokens=cycles.lost_tokens,
                lost_events=cycles.lost_events,
                cycles=asdict(cycles) | {"wall_s": round(time.monotonic() - t, 1)},
            )

        if args.soak_s:
            samples: list[dict[str, float]] = []
            t = time.monotonic()

            async def soak() -> dict[str, Any]:
                async def sample() -> None:
                    while True:
                        samples.append({"t_s": round(time.monotonic() - t, 1), "rss_mb": round(rss_mb(proc.pid), 1)})
                        await asyncio.sleep(10)

                sampler = asyncio.create_task(sample())
                try:
                    return await loadtest.run(
                        base + "/v1/stream", args.n_star, args.soak_s, clips, ramp=False, session_s=60.0
                    )
                finally:
                    sampler.cancel()

            load = asyncio.run(soak())
            rss = [x["rss_mb"] for x in samples]
            out.update(
                soak_sessions=args.n_star,
                soak_s=args.soak_s,
                soak_rss_mb=samples,
                soak_rss_growth_mb=round(rss[-1] - rss[min(6, len(rss) - 1)], 1) if rss else None,
                soak_load={
                    k: load[k]
                    for k in ("sessions_admitted", "deadline_miss_ratio", "eos_to_first_audio_p90_s", "collapsed")
                },
            )
        if args.slow_reader_s:
            slow = asyncio.run(
                slow_reader(base + "/v1/stream", speech, sc.RATE, args.slow_reader_s, lambda: health(port))
            )
            log.info("slow reader: %s", slow)
            out.update(slow_reader_max_buffer_bytes=slow["max_buffer_bytes"], slow_reader=slow)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    if out.get("soak_rss_mb"):
        plot_soak(out, args.out.with_name(args.out.stem + "-soak.png"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out.get(k) for k in (*SUMMARY_KEYS, "wall_s")}))
    return 0 if not out["crashes"] and not out.get("lost_tokens") and not out.get("lost_events") else 1


@dataclass(slots=True)
class CycleResult:
    cycles: int = 0
    lost_tokens: int = 0  # tokens the server sent that the client never rendered
    lost_events: int = 0  # gaps in the events' `n`
    duplicates_skipped: int = 0  # events and tokens replayed that the client already had (expected)
    replies: int = 0
    replies_mismatched: int = 0  # rendered text != reply.done text
    finals: int = 0
    resume_refused: int = 0


async def reconnect_cycles(
    url: str,
    speech: Any,
    rate: int,
    cycles: int,
    *,
    seed: int = 0,
    on_cycle: Any = None,
    final_s: float = 20.0,
    pause_s: float = 3.0,
) -> CycleResult:
    """One conversation whose connection is killed (no closing handshake) `cycles` times, each after a
    random 50–400 ms, and resumed at once; the client talks (`speech` again and again, `pause_s` apart)
    and renders replies. Counts what never arrived: tokens, events (`n`), and replies that do not match.
    A reply is done only once it has played out: one longer than the pause is interrupted by the next
    repetition, so a caller that needs a finished reply pauses longer than the reply speaks."""
    import random

    import numpy as np

    from duplexd.clients.stream import SessionRefused, StreamClient
    from duplexd.transport.packetizer import Packet, Receiver, Token
    from duplexd.transport.protocol import parse_audio_out

    rng = random.Random(seed)
    result = CycleResult()
    receiver = Receiver()
    texts: dict[int, str] = {}
    done_texts: dict[int, str] = {}
    state = {"event_seq": 0, "audio_bytes": 0, "last_token": 0}
    step = rate // 50
    pause = np.zeros(round(rate * pause_s), np.int16)
    mic = np.concatenate([speech, pause]).astype("<i2")
    position = 0
    client = await StreamClient.connect(url)
    started = await client.start(rate, dialog=True)
    state["event_seq"] = started["n"]

    def take(event: dict) -> bool:
        n = event.get("n")
        if n is not None:
            if n <= state["event_seq"]:
                result.duplicates_skipped += 1
                return False
            if n != state["event_seq"] + 1:
                result.lost_events += n - state["event_seq"] - 1
            state["event_seq"] = n
        return True

    def render(tokens: tuple[Token, ...]) -> None:
        for t in receiver.receive(Packet(0, tokens)):
            texts[t.reply] = texts.get(t.reply, "") + t.text

    for cycle in range(cycles + 1):
        live_s = rng.uniform(0.05, 0.4) if cycle < cycles else final_s
        deadline = time.monotonic() + live_s

        async def receive(c: StreamClient = client) -> None:
            async for raw in c.ws:
                if isinstance(raw, bytes):
                    state["audio_bytes"] += len(parse_audio_out(raw).pcm)
                    continue
                event = json.loads(raw)
                if not take(event):
                    continue
                kind = event["type"]
                if kind == "reply.delta":
                    state["last_token"] = max(state["last_token"], event["token_seq"])
                    render((Token(event["token_seq"], event["reply"], event["text"]),))
                    await c.ack(receiver.contiguous, state["event_seq"])
                elif kind == "reply.done":
                    done_texts[event["reply"]] = event["text"]
                elif kind == "transcript.final":
                    result.finals += 1

        async with asyncio.TaskGroup() as tg:
            reader = tg.create_task(receive())
            while time.monotonic() < deadline:
                frame = mic[position : position + step]
                position = (position + step) % (len(mic) - step)
                try:
                    await client.send_pcm(frame.tobytes())
                except ConnectionClosed:
                    break
                await asyncio.sleep(0.02)
            if cycle == cycles:  # the last lap: end cleanly, let everything arrive
                await client.end()
                await asyncio.wait_for(reader, 60)
            else:
                assert client.ws.transport is not None
                client.ws.transport.abort()
                reader.cancel()
        if cycle == cycles:
            break
        result.cycles += 1
        if on_cycle is not None:
            on_cycle(cycle)
        try:
            client, resumed = await StreamClient.resume(
                url,
                started,
                token_seq=receiver.contiguous,
                audio_ms=1000 * state["audio_bytes"] / 2 / 24000,
                seq=client.seq,
                event_seq=state["event_seq"],
            )
        except SessionRefused:
            result.resume_refused += 1
            break
        take(resumed)
        if resumed["tokens"]:
            first = resumed["token_seq"]
            tokens = tuple(Token(first + i, r, t) for i, (r, t) in enumerate(resumed["tokens"]))
            state["last_token"] = max(state["last_token"], tokens[-1].seq)
            render(tokens)
    await client.close()
    result.lost_tokens = max(0, state["last_token"] - receiver.contiguous)
    result.replies = len(done_texts)
    result.replies_mismatched = sum(1 for r, text in done_texts.items() if texts.get(r, "") != text)
    return result


async def slow_reader(url: str, speech: Any, rate: int, seconds: float, sample: Any) -> dict[str, Any]:
    """A client that talks (asks again and again) but never reads what the server sends: its socket's
    receive buffer is small and its WebSocket queue holds one message, so TCP pushes back at once. The
    server must keep what it holds for the client bounded and close the session. `sample()` returns the
    server's /healthz."""
    import socket
    from urllib.parse import urlsplit

    import numpy as np

    from duplexd.transport.protocol import encode_audio_frame

    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.hostname, parts.port))
    sock.setblocking(False)
    ws = await connect(url, sock=sock, max_queue=1, max_size=2**22)
    await ws.send(json.dumps({"type": "session.start", "version": 1, "sample_rate": rate, "dialog": True}))
    mic = np.concatenate([speech, np.zeros(rate * 4, np.int16)]).astype("<i2")
    step, position, seq = rate // 50, 0, 0
    t0 = time.monotonic()
    peak, closed_after = 0, None
    next_sample = t0
    while time.monotonic() - t0 < seconds:
        seq += 1
        try:
            await asyncio.wait_for(ws.send(encode_audio_frame(seq, mic[position : position + step].tobytes())), 5)
        except (ConnectionClosed, TimeoutError):
            pass
        position = (position + step) % (len(mic) - step)
        if time.monotonic() >= next_sample:
            next_sample += 1.0
            h = await asyncio.to_thread(sample)
            peak = max(peak, h["outbound_bytes_max"])
            if h["counters"]["slow_consumers"] and closed_after is None:
                closed_after = time.monotonic() - t0
                break
        await asyncio.sleep(0.02)
    code = reason = None
    try:  # now read: what the server said before it closed
        while True:
            await asyncio.wait_for(ws.recv(), 5)
    except ConnectionClosed:
        code, reason = ws.close_code, ws.close_reason
    except TimeoutError:
        pass
    await ws.close()
    return {
        "seconds": round(time.monotonic() - t0, 1),
        "closed_after_s": None if closed_after is None else round(closed_after, 1),
        "max_buffer_bytes": peak,
        "close_code_seen": code,
        "close_reason_seen": reason,
    }
