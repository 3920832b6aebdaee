"""`duplexd bench cluster`: scale-out through HAProxy on this machine.

- **Balancer latency**: one transcription-only worker behind HAProxy; two sessions on it at the same time,
  one through the balancer and one straight to the worker, each streaming 20 ms frames in real time. A
  frame's round trip is from its send to the `frame.ack` that covers it; the balancer's added latency is
  the difference of the two sessions' medians (same worker, same moments: only the path differs).
- **N\\* by worker count**: for 1, 2, 3, ... `duplexd serve` workers (admission off, so nothing is
  refused) behind HAProxy, `duplexd loadtest`'s conversational users through the balancer at N = 1, 2, ...
  until two N in a row fail `bench capacity`'s criteria; reports each run's sessions per worker. Every
  worker gets `cpus // workers` threads per engine; on a 2-core machine they still share the same two
  cores, so N\\* cannot grow with the workers here: the figures say what the processes cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from duplexd.bench import write_result
from duplexd.bench.capacity import MAX_FIRST_AUDIO_P90_S, MAX_MISS_RATIO, MAX_WORD_LATENCY_P90_S, _summary, sweep
from duplexd.clients import loadtest
from duplexd.clients.clips import load_clips
from duplexd.clients.stats import percentile
from duplexd.clients.stream import StreamClient
from duplexd.cluster import Cluster

RATE = 16_000
FRAME_S = 0.02


async def _round_trips(url: str, seconds: float) -> list[float]:
    """One session streaming silence in real time for `seconds`: each ack's round trip in ms (from the
    send of the frame it names)."""
    client = await StreamClient.connect(url)
    await client.start(RATE)
    sent: dict[int, float] = {}
    rtts: list[float] = []
    frame = np.zeros(int(RATE * FRAME_S), "<i2").tobytes()

    async def listen() -> None:
        async for msg in client.ws:
            if isinstance(msg, str) and (ev := json.loads(msg))["type"] == "frame.ack" and ev["seq"] in sent:
                rtts.append(1000 * (time.monotonic() - sent[ev["seq"]]))

    reader = asyncio.create_task(listen())
    t0 = time.monotonic()
    for i in range(int(seconds / FRAME_S)):
        await asyncio.sleep(max(0.0, t0 + i * FRAME_S - time.monotonic()))
        sent[client.seq + 1] = time.monotonic()
        await client.send_pcm(frame)
    await asyncio.sleep(0.5)
    await client.close()
    await asyncio.gather(reader, return_exceptions=True)
    return rtts


def balancer_latency(seconds: float) -> dict[str, Any]:
    with Cluster(1, serve_args=["--no-dialog"], stats_port=None) as cluster:
        w = cluster.workers[0]

        async def both() -> tuple[list[float], list[float]]:
            direct = f"ws://{w.host}:{w.port}/v1/stream"
            a, b = await asyncio.gather(_round_trips(cluster.url, seconds), _round_trips(direct, seconds))
            return a, b

        balanced, direct = asyncio.run(both())
    rtt = {
        name: {q: percentile(xs, q) for q in (50, 90, 99)} for name, xs in (("balanced", balanced), ("direct", direct))
    }
    out: dict[str, Any] = {"seconds": seconds}
    for name, xs in (("balanced", balanced), ("direct", direct)):
        out[name] = {"acks": len(xs), **{f"rtt_p{q}_ms": _round(v) for q, v in rtt[name].items()}}
    if balanced and direct:
        for q in (50, 90):
            out[f"added_p{q}_ms"] = round(rtt["balanced"][q] - rtt["direct"][q], 3)  # type: ignore[operator]
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def n_star(workers: int, args: argparse.Namespace, clips: list) -> dict[str, Any]:
    serve_args = ["--config", str(args.config)] if args.config else []

    def measure(n: int) -> dict[str, Any]:
        print(f"{workers} worker(s), N = {n}", flush=True)
        with Cluster(workers, serve_args=serve_args, env={"DUPLEXD_ADMISSION__ENABLED": "false"}) as cluster:
            r = _summary(asyncio.run(loadtest.run(cluster.url, n, args.duration, clips, ramp=False)))
            r["scraped"] = cluster.scrape()  # each worker's own counters, side by side
        print(f"  per worker {r['nodes']}", flush=True)
        return r

    best, rows = sweep(args.max_sessions, measure)
    return {"workers": workers, "n_star": best, "runs": rows}


def main(args: argparse.Namespace) -> int:
    clips = load_clips(args.data)
    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "cluster",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count()},
        "duration_s": args.duration,
        "criteria": {
            "deadline_miss_ratio_max": MAX_MISS_RATIO,
            "partial_word_latency_p90_s_max": MAX_WORD_LATENCY_P90_S,
            "eos_to_first_audio_p90_s_max": MAX_FIRST_AUDIO_P90_S,
        },
        "balancer": balancer_latency(args.latency_s),
        "scale": [n_star(w, args, clips) for w in counts],
    }
    result["wall_s"] = round(time.monotonic() - t0, 1)
    write_result(Path(args.out), result, table(result))
    return 0


def table(result: dict[str, Any]) -> str:
    b = result["balancer"]
    lines = [
        f"frame round trip p50: {b['balanced']['rtt_p50_ms']} ms through HAProxy, {b['direct']['rtt_p50_ms']} ms "
        f"direct (added {b.get('added_p50_ms')} ms; p90 added {b.get('added_p90_ms')} ms)",
        f"{'workers':>8} {'N*':>4}  runs (N: misses, first audio p90 s, sessions per worker)",
    ]
    for s in result["scale"]:
        runs = "; ".join(
            f"{r['sessions_offered']}: {r['deadline_miss_ratio']:.3f}, {r['eos_to_first_audio_p90_s']}, {r['nodes']}"
            if r["deadline_miss_ratio"] is not None
            else f"{r['sessions_offered']}: -"
            for r in s["runs"]
        )
        lines.append(f"{s['workers']:>8} {s['n_star']:>4}  {runs}")
    return "\n".join(lines)
