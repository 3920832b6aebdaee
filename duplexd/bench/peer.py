"""ASR against a peer: WhisperLive and duplexd's transcription-only mode, same clips, same model folder.

    scripts/install-whisperlive-peer .venv-peer      # once: WhisperLive in its own venv (see the script)
    python -m duplexd.bench.peer --peer-python .venv-peer/bin/python --out peer.json

Both servers run as child processes on this machine, one after the other, with the same whisper tiny.en
CTranslate2 folder; the same real-time-paced clients stream the same programs (clips with 1 s gaps) at
1, 2, 4, 8 concurrent streams, `--rounds` times per level (each round's programs start where the last
round's first program ended, so more rounds cover more of the clips: one ~40 s program holds ~90 words,
where one word is 1 % of WER). Word latency = when a word was first shown minus when its end (offline word
timestamps) was sent, the same measure for both (a peer's transcript is rebuilt from its segment
messages). N* here = the most concurrent streams with word latency p90 <= 2 s. Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import connect

from duplexd.asr.commit import norm
from duplexd.asr.engine import default_asr_model
from duplexd.bench import write_result
from duplexd.bench.asr import RATE, Program, _offline, _program
from duplexd.bench.data import wer
from duplexd.bench.latency import aligned, word_timings
from duplexd.bench.server import child_process, server_process
from duplexd.clients.clips import Clip, load_clips
from duplexd.clients.stats import percentile
from duplexd.clients.stream import stream_pcm
from duplexd.events import Word
from duplexd.netutil import free_port

MAX_WORD_LATENCY_P90_S = 2.0
STREAM_S = 40.0  # seconds of speech per program (about 90 words)
CHUNK_S = 0.02  # 20 ms of float32 audio per message, paced as duplexd's own client paces its frames


@dataclass(slots=True)
class PeerResult:
    started_at: float
    snapshots: list[tuple[float, list[str]]] = field(default_factory=list)  # (arrival, words shown)

    @property
    def text(self) -> str:
        return " ".join(self.snapshots[-1][1]) if self.snapshots else ""


async def whisperlive_stream(url: str, pcm: np.ndarray, uid: str) -> PeerResult:
    """Stream `pcm` (int16, 16 kHz) to a WhisperLive server the way its own client does, in real time."""
    async with connect(url, max_size=None) as ws:
        await ws.send(
            json.dumps({"uid": uid, "language": "en", "task": "transcribe", "model": "tiny.en", "use_vad": True})
        )
        while json.loads(await ws.recv()).get("message") != "SERVER_READY":
            pass
        result = PeerResult(time.monotonic())
        segments: dict[float, str] = {}

        async def receive() -> None:
            async for message in ws:
                msg = json.loads(message)
                if "segments" not in msg:
                    continue
                first = min(float(s["start"]) for s in msg["segments"])
                for start in [s for s in segments if s >= first]:
                    del segments[start]  # the message re-sends the tail from here on
                for s in msg["segments"]:
                    segments[float(s["start"])] = s["text"]
                words = [w for _, text in sorted(segments.items()) for w in text.split()]
                result.snapshots.append((time.monotonic(), words))

        reader = asyncio.create_task(receive())
        audio = pcm.astype(np.float32) / 32768.0
        step = int(CHUNK_S * RATE)
        for k, i in enumerate(range(0, len(audio), step)):
            await asyncio.sleep(max(0.0, result.started_at + k * CHUNK_S - time.monotonic()))
            await ws.send(audio[i : i + step].tobytes())
        await ws.send(b"END_OF_AUDIO")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reader, 60)
        return result


def peer_latencies(result: PeerResult, program: Program) -> list[float]:
    """First-shown latency of each final word that matches an offline word (same rule as duplexd's)."""
    if not result.snapshots:
        return []
    final = result.snapshots[-1][1]
    first: list[float] = []
    for i, word in enumerate(final):
        shown = next(t for t, words in result.snapshots if len(words) > i and norm(words[i]) == norm(word))
        first.append(shown)
    return [first[i] - (result.started_at + word.end_s) for i, word in aligned(final, program.words)]


@contextlib.contextmanager
def whisperlive_process(python: str, model: Path) -> Iterator[int]:
    port = free_port()
    code = (
        "from whisper_live.server import TranscriptionServer\n"
        f"TranscriptionServer().run('127.0.0.1', {port}, backend='faster_whisper',"
        f" faster_whisper_custom_model_path={str(model)!r}, single_model=True, max_clients=16,"
        " max_connection_time=3600)\n"
    )
    with child_process([python, "-c", code], name="WhisperLive", up=lambda: _connect(port), poll_s=0.5):
        yield port


def _connect(port: int) -> None:
    socket.create_connection(("127.0.0.1", port), timeout=1).close()


def _row(latencies: list[float], refs: list[str], texts: list[str]) -> dict[str, Any]:
    return {
        "word_latency_p50_s": percentile(latencies, 50),
        "word_latency_p90_s": percentile(latencies, 90),
        "words_timed": len(latencies),
        "wer": wer(refs, texts),
        "streams": [{"ref": ref, "text": text} for ref, text in zip(refs, texts, strict=True)],
    }


def _rounds(
    clips: list[Clip], offline: dict[Path, list[Word]], n: int, rounds: int, stream_s: float
) -> list[list[Program]]:
    """Per round, `n` concurrent programs (rotated 3 clips apart), each round starting after the clips the
    last round's first program held."""
    batches: list[list[Program]] = []
    start = 0
    for _ in range(rounds):
        batches.append([_program(clips, offline, stream_s, rotate=start + 3 * k) for k in range(n)])
        start += len(batches[-1][0].refs)
    return batches


def run(args: argparse.Namespace) -> dict[str, Any]:
    clips = [c for c in load_clips(args.data) if c.text]
    print(f"offline transcription of {len(clips)} clips (word end times) ...", flush=True)
    offline, _, _ = _offline(clips, None)
    levels = [int(n) for n in args.streams.split(",")]
    model = default_asr_model()
    out: dict[str, Any] = {"benchmark": "asr-peer", "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out["model"] = str(model)
    out["stream_s"] = args.stream_s
    out["rounds"] = args.rounds
    for name in ("duplexd", "whisperlive"):
        rows: dict[str, Any] = {}
        server = (
            server_process(None, settings={"dialog.enabled": "false", "admission.enabled": "false"})
            if name == "duplexd"
            else whisperlive_process(args.peer_python, model)
        )
        with server as port:
            for n in levels:
                print(f"{name}: {n} concurrent stream(s) of ~{args.stream_s:.0f} s ...", flush=True)
                batches = _rounds(clips, offline, n, args.rounds, args.stream_s)
                latencies, texts = [], []
                for r, batch in enumerate(batches):  # (one round at a time: n streams at once)
                    if name == "duplexd":
                        url = f"ws://127.0.0.1:{port}/v1/stream"
                        results = asyncio.run(_gather([stream_pcm(url, p.pcm, RATE) for p in batch]))
                        latencies += [
                            t.partial_latency_s
                            for p, res in zip(batch, results, strict=True)
                            for t in word_timings(res, p.words)
                        ]
                        texts += [res.text for res in results]
                    else:
                        url = f"ws://127.0.0.1:{port}"
                        peer = asyncio.run(
                            _gather([whisperlive_stream(url, p.pcm, f"u{r}-{k}") for k, p in enumerate(batch)])
                        )
                        latencies += [x for p, res in zip(batch, peer, strict=True) for x in peer_latencies(res, p)]
                        texts += [res.text for res in peer]
                rows[str(n)] = _row(latencies, [" ".join(p.refs) for batch in batches for p in batch], texts)
                summary = {k: v for k, v in rows[str(n)].items() if k != "streams"}
                print(f"  {summary}", flush=True)
        ok = [
            n
            for n in levels
            if (p90 := rows[str(n)]["word_latency_p90_s"]) is not None and p90 <= MAX_WORD_LATENCY_P90_S
        ]
        out[name] = {"levels": rows, "n_star": max((n for n in ok if all(m in ok for m in levels if m < n)), default=0)}
    return out


async def _gather(coros: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*coros))


def table(r: dict[str, Any]) -> str:
    lines = [
        "| streams | duplexd p50 / p90 (s) | duplexd WER | WhisperLive p50 / p90 (s) | WhisperLive WER |",
        "|---|---|---|---|---|",
    ]
    f = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
    for n, d in r["duplexd"]["levels"].items():
        w = r["whisperlive"]["levels"][n]
        lines.append(
            f"| {n} | {f(d['word_latency_p50_s'])} / {f(d['word_latency_p90_s'])} | {f(d['wer'])} "
            f"| {f(w['word_latency_p50_s'])} / {f(w['word_latency_p90_s'])} | {f(w['wer'])} |"
        )
    lines.append(
        f"N* (word latency p90 <= 2 s): duplexd {r['duplexd']['n_star']}, WhisperLive {r['whisperlive']['n_star']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m duplexd.bench.peer", description=__doc__.splitlines()[0])
    p.add_argument("--peer-python", default=".venv-peer/bin/python", help="the python of the WhisperLive venv")
    p.add_argument(
        "--data", type=Path, default=None, help="speech clips (default $DUPLEXD_TEST_DATA or ../shared/data)"
    )
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--stream-s", type=float, default=STREAM_S, help="seconds of speech per stream")
    p.add_argument("--rounds", type=int, default=1, help="programs per stream and level, one after another")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    result = run(args)
    write_result(args.out, result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
