"""`duplexd bench webrtc-tokens`: a WebRTC call's reply tokens under packet loss, on the reliable events channel
alone against the events channel merged with the unreliable `eloquent` channel (what the page and
`clients.rtc` show).

A `duplexd serve` child. Each question is typed (`conversation.item.create` + `response.create`) in a call
from `clients.rtc.RtcClient(tokens=True)` whose UDP goes through the loss simulator (`bench.relay.UdpRelay`;
the answer's ICE candidates are replaced by the relay's address, so every packet of the call, audio, both
channels and the acks, crosses it): first without loss, then under each loss model on the path to the
client (the path from it lossless), both directions delayed by half the RTT. Both channels ride one SCTP
association over that one path: the same losses hit both.

Each token is shown at the first of its two arrivals (`merged`: what the page shows); the events channel
alone would show it at its delta's arrival (`events`, never earlier: the merge includes it). Per condition:
`lead_p50_ms` / `lead_p90_ms` / `lead_max_ms` of events - merged over the tokens, the share of tokens shown
at least 10 ms earlier thanks to the `eloquent` channel, and `events_behind_ratio`: the time during which
the events channel alone shows fewer tokens than the merge (`bench.transport.stall_time`, with the merged
times as due) over the replies' span. `none` (no loss, the same delays) is the measure's floor. (A stall
ratio against a lossless due time was tried first: from a lossless call of the same question, the
server's decode pace moved by more than the losses cost, so both channels "stalled" 30-85 %.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

from duplexd.bench import write_result
from duplexd.bench.loss import LinkConfig
from duplexd.bench.relay import UdpRelay
from duplexd.bench.server import server_process
from duplexd.bench.transport import GRACE_S, QUESTIONS, stall_time
from duplexd.clients.stats import percentile

LOSSES = ("none", "bernoulli:0.05", "bernoulli:0.1", "ge:0.05:4", "outage:0.1:200")
RTT_MS = 50
EARLIER_S = 0.010
_CANDIDATE = re.compile(r"^a=candidate:\S+ 1 udp \d+ (\d+\.\d+\.\d+\.\d+) (\d+) typ host", re.MULTILINE)


def through(answer: str, relay: tuple[str, int]) -> str:
    """The SDP answer with its ICE candidates replaced by one: the relay's address."""
    lines = [line for line in answer.split("\r\n") if not line.startswith("a=candidate:")]
    out: list[str] = []
    for line in lines:
        out.append(line)
        if line.startswith("m="):
            out.append(f"a=candidate:1 1 udp 2130706431 {relay[0]} {relay[1]} typ host")
    return "\r\n".join(out)


def server_candidate(answer: str) -> tuple[str, int]:
    found = _CANDIDATE.search(answer)
    if found is None:
        raise RuntimeError("the answer has no IPv4 host candidate")
    return found.group(1), int(found.group(2))


async def _call(base_url: str, question: str, loss: str, seed: int) -> dict[str, Any]:
    from duplexd.clients.rtc import RtcClient, post_offer  # (aiortc: only here)

    client = RtcClient(tokens=True)
    relay: UdpRelay | None = None
    try:
        answer, _ = await asyncio.to_thread(post_offer, base_url, await client.offer())
        host, port = server_candidate(answer)
        relay = await UdpRelay.start(
            upstream=(host, port),
            listen=(host, 0),
            up=LinkConfig(rtt_ms=RTT_MS),
            down=LinkConfig(loss=loss, rtt_ms=RTT_MS, seed=seed),
        )
        await client.connect(through(answer, relay.address))
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]}
        client.send({"type": "conversation.item.create", "item": item})
        asked = time.monotonic()
        client.send({"type": "response.create"})
        await client.wait_for(lambda e: any(x["type"] == "response.done" for x in e), 90)
        deltas = [
            (e["token_seq"], t)
            for e, t in zip(client.events, client.event_times, strict=True)
            if e["type"].endswith("_transcript.delta") or e["type"] == "response.output_text.delta"
        ]
        n = len(deltas)
        return {
            "tokens": n,
            "text": client.text,
            "events": [t - asked for _, t in sorted(deltas)],
            "merged": [r.at - asked for r in client.tokens[:n]],
            "relay": {"down_lost": relay.stats.down.lost, "down_received": relay.stats.down.received},
        }
    finally:
        await client.close()
        if relay is not None:
            relay.close()


async def _measure(base_url: str, questions: tuple[str, ...], losses: tuple[str, ...]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for loss in losses:
        runs = []
        for i, question in enumerate(questions):
            run = await _call(base_url, question, loss, seed=i + 1)
            runs.append({"question": question, **run})
            print(f"  {loss} {question[:30]!r}: {_summary([run])}", flush=True)
        rows[loss] = {**_summary(runs), "runs": runs}
    return rows


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    leads = sorted(e - m for r in runs for e, m in zip(r["events"], r["merged"], strict=True))
    behind = sum(stall_time(r["merged"], r["events"], GRACE_S) for r in runs if r["tokens"])
    span = sum(max(r["events"]) - min(r["merged"]) for r in runs if r["tokens"])

    def ms(q: float) -> float | None:
        return round(1000 * percentile(leads, q), 1) if leads else None

    return {
        "replies": len(runs),
        "tokens": len(leads),
        "lead_p50_ms": ms(50),
        "lead_p90_ms": ms(90),
        "lead_max_ms": round(1000 * leads[-1], 1) if leads else None,
        "earlier_share": round(sum(x >= EARLIER_S for x in leads) / len(leads), 4) if leads else None,
        "events_behind_ratio": round(behind / span, 5) if span else None,
        "down_lost": sum(r["relay"]["down_lost"] for r in runs),
        "down_received": sum(r["relay"]["down_received"] for r in runs),
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"| loss (to the client), RTT {result['rtt_ms']} ms | packets lost | tokens | shown earlier via `eloquent` "
        "| lead p50 / p90 / max | events channel alone behind |",
        "|---|---|---|---|---|---|",
    ]
    for loss, row in result["conditions"].items():
        lost = f"{row['down_lost']} of {row['down_received']}"
        lead = f"{row['lead_p50_ms']} / {row['lead_p90_ms']} / {row['lead_max_ms']} ms"
        earlier = "-" if row["earlier_share"] is None else f"{100 * row['earlier_share']:.1f} %"
        behind = "-" if row["events_behind_ratio"] is None else f"{100 * row['events_behind_ratio']:.2f} %"
        lines.append(f"| {loss} | {lost} | {row['tokens']} | {earlier} | {lead} | {behind} |")
    return "\n".join(lines)


def run(config: Path | None, quick: bool) -> dict[str, Any]:
    questions = QUESTIONS[:1] if quick else QUESTIONS
    losses = LOSSES[:2] if quick else LOSSES
    with server_process(config) as port:
        conditions = asyncio.run(_measure(f"http://127.0.0.1:{port}/v1", questions, losses))
    return {
        "benchmark": "webrtc-tokens",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "rtt_ms": RTT_MS,
        "grace_s": GRACE_S,
        "questions": list(questions),
        "conditions": conditions,
    }


def main(args: argparse.Namespace) -> int:
    result = run(args.config, args.quick)
    write_result(args.out, result, table(result))
    return 0
