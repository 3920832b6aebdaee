"""`duplexd bench transport`: reply token streams over a lossy UDP path, Eloquent against its baselines.

1. Real replies: the dialog engine (the server's own model and prompt) answers a few questions on this
   machine; each token's text and the moment it was decoded are recorded (a token stream).
2. Every stream is replayed, at its recorded pace, through the datagram path (`transport.datagram`'s codec,
   real UDP sockets on loopback) and the loss simulator (`bench.relay`) with each scheme
   (`eloquent`, `retransmit`, `duplicate`, and `eloquent_paper`: the paper's sender, every unacknowledged
   token in every packet and no repeats, as duplexd's was before), for every loss model and RTT. Within one
   condition every scheme gets the same seeded loss process, per direction (acks can be lost too); `--replicates` seeds
   per stream.
3. The receiver renders the contiguous prefix and acks each packet. A token is *due* one one-way delay
   after it was decoded (when a lossless path of the same RTT would show it); it *stalls* from then
   (+ `GRACE_S`, scheduling noise on loopback) until it renders. `stall_ratio` = time during which at
   least one due token has not rendered / the stream's length (first due -> last rendered).

`reduction_vs_X` = 1 - stall(eloquent) / stall(X), from stall times summed over a condition's streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from duplexd.aio import wait_set
from duplexd.bench.loss import LinkConfig
from duplexd.bench.relay import UdpRelay
from duplexd.transport import datagram as dg
from duplexd.transport.packetizer import Eloquent, Packet, Receiver, SenderConfig, make_sender

log = logging.getLogger(__name__)

SCHEMES = ("eloquent", "retransmit", "duplicate", "eloquent_paper")


class PaperEloquent(Eloquent):
    """The paper's Eloquent: every unacknowledged token in every packet, no repeats in time (an ablation)."""

    def packet(self, now: float, *, repeat: bool = True, everything: bool = False) -> list[Packet]:
        return super().packet(now, repeat=False, everything=True)


def _sender(scheme: str, config: SenderConfig) -> Any:
    return PaperEloquent(config) if scheme == "eloquent_paper" else make_sender(scheme, config)


# Independent loss; bursts counted in packets (Gilbert-Elliott); bursts in time (the path is down for ~100 or
# ~200 ms at a time, as a radio fade or handover: every packet sent meanwhile is lost, copies included).
LOSSES = (
    "bernoulli:0.01",
    "bernoulli:0.05",
    "bernoulli:0.1",
    "bernoulli:0.2",
    "ge:0.05:4",
    "outage:0.05:100",
    "outage:0.1:200",
)
RTTS_MS = (20, 50, 100, 200)
QUESTIONS = (
    "What should I pack for a weekend hiking trip in the mountains?",
    "Can you explain how a heat pump warms a house in winter?",
    "Tell me a short story about a fox who learns to swim.",
    "What are three good habits for learning a new language?",
)
GRACE_S = 0.01
STREAM_TIMEOUT_S = 60.0
HELLO_EVERY_S = 0.02


@dataclass(frozen=True, slots=True)
class TokenStream:
    """A real reply: each token's text and when it was decoded (seconds after the first)."""

    question: str
    texts: tuple[str, ...]
    at_s: tuple[float, ...]

    @property
    def duration_s(self) -> float:
        return self.at_s[-1] if self.at_s else 0.0


def record_replies(questions: Sequence[str], max_tokens: int) -> list[TokenStream]:
    """Decode a reply to each question with the server's dialog engine, timing each token."""
    from duplexd.config import ServerConfig
    from duplexd.dialog.engine import DialogEngine, EngineConfig

    config = ServerConfig().dialog
    engine = DialogEngine.load(EngineConfig.from_config(config))
    tok = engine.tokenizer
    streams = []
    for question in questions:
        sid = engine.open(config.system_prompt)
        engine.append_user_text(sid, question)
        engine.start_reply(sid)
        texts: list[str] = []
        times: list[float] = []
        shown = ""
        while engine.busy() and len(times) < max_tokens:
            engine.step()
            now = time.monotonic()
            ids = engine.reply_tokens(sid)
            while len(times) < len(ids):
                text = tok.decode(ids[: len(times) + 1])
                texts.append(text[len(shown) :] if text.startswith(shown) else text)
                shown = text
                times.append(now)
        engine.close(sid)
        texts_nonempty = [(t, at) for t, at in zip(texts, times, strict=True) if t]
        t0 = texts_nonempty[0][1]
        streams.append(
            TokenStream(question, tuple(t for t, _ in texts_nonempty), tuple(at - t0 for _, at in texts_nonempty))
        )
    return streams


@dataclass(slots=True)
class StreamRun:
    scheme: str
    complete: bool
    tokens: int
    stall_s: float
    span_s: float
    packets: int
    bytes_sent: int
    token_bytes: int
    lost_down: int
    lost_up: int
    timeouts: int
    due_s: list[float] = field(default_factory=list)
    rendered_s: list[float] = field(default_factory=list)


def stall_time(due: Sequence[float], rendered: Sequence[float], grace_s: float = GRACE_S) -> float:
    """Length of the union of [due_i + grace, rendered_i]: time during which some due token is missing."""
    total, reach = 0.0, float("-inf")
    for d, r in sorted(zip(due, rendered, strict=True)):
        start = max(d + grace_s, reach)
        if r > start:
            total += r - start
            reach = r
    return total


class _ServerSide(asyncio.DatagramProtocol):
    def __init__(self, key: bytes, on_ack: Any) -> None:
        self.key = key
        self.on_ack = on_ack
        self.addr: tuple[str, int] | None = None
        self.hello = asyncio.Event()
        self.transport: Any = None
        self.counter = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            d = dg.decode(data, self.key)
        except dg.DatagramError:
            return
        self.addr = addr
        self.hello.set()
        if d.kind == dg.Kind.ACK:
            self.on_ack(dg.decode_ack(d.payload))

    def send(self, tag: bytes, packet: Any) -> int:
        assert self.addr is not None
        self.counter += 1
        data = dg.encode(dg.Kind.TOKENS, tag, self.counter, dg.encode_tokens(packet), self.key)
        self.transport.sendto(data, self.addr)
        return len(data)


async def run_stream(
    stream: TokenStream, scheme: str, loss: str, rtt_ms: float, seed: int, config: SenderConfig
) -> StreamRun:
    """Replay `stream` through a fresh relay with `scheme`; the receiver's view of every token."""
    loop = asyncio.get_running_loop()
    sender = _sender(scheme, config)
    key, tag = dg.new_key(), dg.new_tag()
    wake = asyncio.Event()

    def on_ack(ack: Any) -> None:
        sender.ack(ack, time.monotonic())
        wake.set()

    _, server = await loop.create_datagram_endpoint(lambda: _ServerSide(key, on_ack), local_addr=("127.0.0.1", 0))
    link = LinkConfig(loss=loss, rtt_ms=rtt_ms, seed=seed)
    relay = await UdpRelay.start(
        upstream=("127.0.0.1", server.transport.get_extra_info("sockname")[1]), up=link, down=link
    )
    n = len(stream.texts)
    receiver = Receiver(window_tokens=config.max_tokens)
    rendered_at: dict[int, float] = {}
    generated_at: dict[int, float] = {}
    done = asyncio.Event()
    bytes_sent = 0

    def on_tokens(tokens: list[Any]) -> None:
        now = time.monotonic()
        for t in tokens:
            rendered_at[t.seq] = now
        if receiver.contiguous >= n:
            done.set()

    client = await dg.DatagramClient.connect("127.0.0.1", relay.port, tag, key, receiver, on_tokens)

    async def hello() -> None:
        while not server.hello.is_set():
            client.hello()
            await asyncio.sleep(HELLO_EVERY_S)

    async def produce() -> None:
        nonlocal bytes_sent
        await server.hello.wait()
        t0 = time.monotonic()
        for text, at in zip(stream.texts, stream.at_s, strict=True):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            now = time.monotonic()
            for packet in sender.push(1, [text], now):
                bytes_sent += server.send(tag, packet)
            generated_at[sender.last_seq] = now
            wake.set()

    async def timers() -> None:
        nonlocal bytes_sent
        while not done.is_set():
            due = sender.next_timer()
            wake.clear()
            timeout = 0.05 if due is None else max(0.0, due - time.monotonic())
            await wait_set(wake, timeout)
            for packet in sender.poll(time.monotonic()):
                bytes_sent += server.send(tag, packet)

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(hello())
            tasks = [tg.create_task(produce()), tg.create_task(timers())]
            await wait_set(done, stream.duration_s + STREAM_TIMEOUT_S)
            done.set()
            for task in tasks:
                task.cancel()
    finally:
        client.close()
        relay.close()
        server.transport.close()
    one_way = rtt_ms / 2000
    seqs = sorted(s for s in generated_at if s in rendered_at)
    due = [generated_at[s] + one_way for s in seqs]
    rendered = [rendered_at[s] for s in seqs]
    complete = len(seqs) == n
    span = (max(rendered) - min(due)) if seqs else 0.0
    return StreamRun(
        scheme=scheme,
        complete=complete,
        tokens=n,
        stall_s=stall_time(due, rendered),
        span_s=span,
        packets=sender.stats.packets,
        bytes_sent=bytes_sent,
        token_bytes=sum(len(t.encode()) for t in stream.texts),
        lost_down=relay.stats.down.lost,
        lost_up=relay.stats.up.lost,
        timeouts=sender.stats.timeouts,
        due_s=[d - min(due) for d in due] if seqs else [],
        rendered_s=[r - min(due) for r in rendered] if seqs else [],
    )


async def run_condition(
    streams: Sequence[TokenStream],
    loss: str,
    rtt_ms: float,
    seed: int,
    config: SenderConfig,
    replicates: int = 1,
) -> dict[str, Any]:
    """Every scheme over every stream (`replicates` seeds each), with the same seeded loss per stream and seed
    for every scheme: the schemes and streams of one seed concurrently, the seeds one after another (more at
    once and this one event loop, not the path, would delay the tokens)."""
    jobs = [(scheme, i, s) for scheme in SCHEMES for i, s in enumerate(list(streams) * replicates)]
    runs: list[StreamRun] = []
    for r in range(replicates):
        batch = [(scheme, i, s) for scheme, i, s in jobs if i // len(streams) == r]
        runs += await asyncio.gather(
            *(run_stream(s, scheme, loss, rtt_ms, seed * 1000 + i, config) for scheme, i, s in batch)
        )
    jobs = [job for r in range(replicates) for job in jobs if job[1] // len(streams) == r]
    by: dict[str, list[StreamRun]] = {s: [] for s in SCHEMES}
    for (scheme, _, _), run in zip(jobs, runs, strict=True):
        by[scheme].append(run)
    stall = {s: sum(r.stall_s for r in by[s]) for s in SCHEMES}
    span = {s: sum(r.span_s for r in by[s]) for s in SCHEMES}
    out: dict[str, Any] = {
        "loss": loss,
        "rtt_ms": rtt_ms,
        "streams": len(jobs) // len(SCHEMES),
        "stall_ratio": {s: round(stall[s] / span[s], 5) if span[s] else None for s in SCHEMES},
        "stall_s": {s: round(stall[s], 4) for s in SCHEMES},
        "complete": {s: all(r.complete for r in by[s]) for s in SCHEMES},
        "packets": {s: sum(r.packets for r in by[s]) for s in SCHEMES},
        "bytes_sent": {s: sum(r.bytes_sent for r in by[s]) for s in SCHEMES},
        "token_bytes": sum(r.token_bytes for r in by["eloquent"]),
        "measured_loss_down": {
            s: round(sum(r.lost_down for r in by[s]) / max(1, sum(r.packets for r in by[s])), 4) for s in SCHEMES
        },
    }
    for base in ("retransmit", "duplicate"):
        out[f"reduction_vs_{base}"] = round(1 - stall["eloquent"] / stall[base], 4) if stall[base] > 0 else None
    return out


def summarize(conditions: list[dict[str, Any]]) -> dict[str, Any]:
    def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
        stall = {s: sum(r["stall_s"][s] for r in rows) for s in SCHEMES}
        return {
            "stall_s": {s: round(v, 3) for s, v in stall.items()},
            **{
                f"reduction_vs_{b}": round(1 - stall["eloquent"] / stall[b], 4) if stall[b] > 0 else None
                for b in ("retransmit", "duplicate")
            },
        }

    by_loss = {
        loss: pooled([c for c in conditions if c["loss"] == loss])
        for loss in dict.fromkeys(c["loss"] for c in conditions)
    }
    token_bytes = sum(c["token_bytes"] for c in conditions)
    return {
        "all": pooled(conditions),
        "by_loss": by_loss,
        # The target: in every loss model, pooled over the RTTs, no more stall than either baseline.
        "eloquent_at_most_baselines_in_every_loss": all(
            row["stall_s"]["eloquent"] <= min(row["stall_s"]["retransmit"], row["stall_s"]["duplicate"])
            for row in by_loss.values()
        ),
        "bytes_overhead": {s: round(sum(c["bytes_sent"][s] for c in conditions) / token_bytes, 3) for s in SCHEMES},
        "median_condition_reduction_vs_retransmit": _median(c["reduction_vs_retransmit"] for c in conditions),
        "median_condition_reduction_vs_duplicate": _median(c["reduction_vs_duplicate"] for c in conditions),
    }


def _median(values: Any) -> float | None:
    v = [x for x in values if x is not None]
    return round(statistics.median(v), 4) if v else None


def table(result: dict[str, Any]) -> str:
    lines = [
        "| loss | RTT ms | stall eloquent | retransmit | duplicate | paper's eloquent | reduction vs retransmit"
        " | vs duplicate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in result["conditions"]:
        r = c["stall_ratio"]
        red = [c["reduction_vs_retransmit"], c["reduction_vs_duplicate"]]
        lines.append(
            f"| {c['loss']} | {c['rtt_ms']:g} | {_pct(r['eloquent'])} | {_pct(r['retransmit'])} | "
            f"{_pct(r['duplicate'])} | {_pct(r['eloquent_paper'])} | {_pct(red[0])} | {_pct(red[1])} |"
        )
    s = result["summary"]
    lines.append("")
    lines.append(
        f"pooled: reduction vs retransmit {_pct(s['all']['reduction_vs_retransmit'])}, "
        f"vs duplicate {_pct(s['all']['reduction_vs_duplicate'])}; bytes per token byte: "
        + ", ".join(f"{k} {v}" for k, v in s["bytes_overhead"].items())
    )
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _label(loss: str) -> str:
    kind, _, rest = loss.partition(":")
    return {"bernoulli": "B", "ge": "GE", "outage": "out"}.get(kind, kind) + " " + rest


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rtts = sorted({c["rtt_ms"] for c in result["conditions"]})
    losses = list(dict.fromkeys(c["loss"] for c in result["conditions"]))
    fig, axes = plt.subplots(1, len(rtts), figsize=(4 * len(rtts), 3.6), sharey=True, squeeze=False)
    for ax, rtt in zip(axes[0], rtts, strict=True):
        rows = {c["loss"]: c for c in result["conditions"] if c["rtt_ms"] == rtt}
        for k, scheme in enumerate(SCHEMES):
            ys = [100 * (rows[loss]["stall_ratio"][scheme] or 0) for loss in losses]
            ax.bar([i + (k - 1.5) * 0.2 for i in range(len(losses))], ys, width=0.2, label=scheme)
        ax.set_xticks(range(len(losses)), [_label(loss) for loss in losses], rotation=45)
        ax.set_title(f"RTT {rtt:g} ms")
        ax.set_ylabel("stall ratio (%)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run_bench(
    streams: list[TokenStream], losses: Sequence[str], rtts: Sequence[float], config: SenderConfig, replicates: int
) -> list[dict[str, Any]]:
    conditions = []
    for k, loss in enumerate(losses):
        for j, rtt in enumerate(rtts):
            c = await run_condition(streams, loss, rtt, seed=100 * k + j + 1, config=config, replicates=replicates)
            log.info("%s rtt %g ms: stall %s", loss, rtt, {s: c["stall_ratio"][s] for s in SCHEMES})
            conditions.append(c)
    return conditions


def main(args: argparse.Namespace) -> int:
    losses = ("bernoulli:0.05", "outage:0.05:100") if args.quick else LOSSES
    rtts = (50, 200) if args.quick else RTTS_MS
    questions = QUESTIONS[:2] if args.quick else QUESTIONS
    config = SenderConfig(max_packet_bytes=dg.MAX_PAYLOAD_BYTES - 64)
    log.info("recording %d real replies with the dialog engine", len(questions))
    streams = record_replies(questions, max_tokens=1000)
    if args.tokens_per_s:  # (the same tokens at an even, slower or faster pace)
        pace = args.tokens_per_s
        streams = [TokenStream(s.question, s.texts, tuple(i / pace for i in range(len(s.texts)))) for s in streams]
    t0 = time.monotonic()
    replicates = 1 if args.quick else args.replicates
    conditions = asyncio.run(run_bench(streams, losses, rtts, config, replicates))
    result = {
        "bench": "transport",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "grace_s": GRACE_S,
        "replicates": replicates,
        "tokens_per_s": args.tokens_per_s,  # (None: as decoded)
        "sender": asdict(config),
        "streams": [
            {
                "question": s.question,
                "tokens": len(s.texts),
                "duration_s": round(s.duration_s, 3),
                "tok_per_s": round(len(s.texts) / s.duration_s, 1) if s.duration_s else None,
            }
            for s in streams
        ],
        "conditions": conditions,
        "summary": summarize(conditions),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(table(result))
    return 0
