"""`duplexd bench relay`: dual-path replies (`[dialog] mode = "relay"`) against the local and the remote model
alone, by how late the remote model answers.

One `duplexd serve-llm` at nice 19 (as if on its own machine) is the remote model, behind `DelayingProxy`,
which holds each request back by a set time before forwarding it (a hosted model's time to first token: 0,
300 and 600 ms). Three real `duplexd
serve` children run side by side: `local` (the embedded engine), `remote` (`backend = "remote"` through the
proxy) and `relay` (`mode = "relay"` through the proxy). Every question clip (one speaker, <= 8 s) is asked
of each, one conversation at a time, the order rotated from clip to clip; then the proxy's delay moves on.
Latencies are client-side: from the end of speech (Silero VAD over the composed audio) and from the
`turn.ended` event to the first reply audio.

Relay's own keys: `prefix_accept_rate` (replies that began with the local model's words), `prefix_words_mean`
(over those), `seam_exact` (replies whose text is exactly their `reply.relayed` prefix followed by the rest of
their `reply.delta`s, and the same as `reply.done`'s) and `same_as_remote` (of the clips whose turn text both
heard the same, replies identical to the remote mode's: the remote model here is the same SmolLM2, greedy).
`--baseline` adds a fourth server, `relay_at_once` (`[relay] remote_at_once = true`: the remote model is
asked at the end of the turn, beside the local model's decision), to measure what that brings.
What this machine cannot say: whether a bigger remote model's answers are better (it is the same model).
`--remote-url URL` (`--remote-model NAME`, the key in `DUPLEXD_DIALOG__REMOTE_API_KEY`) puts any
OpenAI-compatible server behind the proxy instead: every reply of every mode is in the JSON (`runs`), so
relay's against remote's can be read side by side, clip by clip.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import os
import platform
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from duplexd.bench import scenarios as sc
from duplexd.bench import write_result
from duplexd.bench.server import health, serve_llm_process, server_process
from duplexd.clients.clips import Clip, load_clips
from duplexd.clients.converse import ConversationResult, converse_pcm
from duplexd.clients.stats import percentile

QUESTION_MAX_S = 8.0
DELAYS_MS = (0, 300, 600)
MODES = ("local", "remote", "relay")
BASELINE = "relay_at_once"  # (`--baseline`: relay that asks the remote model beside the prefix's decision)


class DelayingProxy:
    """An HTTP proxy to one upstream server that holds every request `delay_ms` before forwarding it, then
    streams the answer back as it comes (the body as read, the connection closed at its end). A client
    that goes away closes the upstream request too (the upstream server then stops decoding)."""

    def __init__(self, upstream: str, delay_ms: float = 0.0) -> None:  # (http:// or https://)
        self.upstream = urllib.parse.urlsplit(upstream)
        self.delay_ms = delay_ms
        self.requests = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def do_GET(self) -> None:
                proxy._forward(self, "GET")

            def do_POST(self) -> None:
                proxy._forward(self, "POST")

            def log_message(self, format: str, *args: object) -> None:  # (quiet)
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="delaying-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{self.upstream.path}"

    def __enter__(self) -> DelayingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _forward(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        self.requests += 1
        time.sleep(self.delay_ms / 1000)
        kind = http.client.HTTPSConnection if self.upstream.scheme == "https" else http.client.HTTPConnection
        conn = kind(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "connection")}
            conn.request(method, handler.path, body=body or None, headers=headers)  # (`url` keeps the path)
            response = conn.getresponse()
            handler.send_response(response.status)
            for key, value in response.getheaders():
                if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                    handler.send_header(key, value)
            handler.send_header("Connection", "close")
            handler.end_headers()
            while chunk := response.read1(65536):
                handler.wfile.write(chunk)
                handler.wfile.flush()
        except OSError:  # (the client went away, or the upstream did: either way this request is over)
            pass
        finally:
            conn.close()


@dataclass(slots=True)
class Run:
    mode: str
    delay_ms: int
    clip: str
    turn_text: str
    reply_text: str
    done_text: str | None
    prefix: str | None  # `reply.relayed` text (relay only)
    eos_to_first_audio_s: float | None
    turn_end_to_first_audio_s: float | None


def first_audio(result: ConversationResult, eos_s: float) -> tuple[str, float | None, float | None]:
    """The first turn's text, and the client's seconds from the end of speech (`eos_s`, stream time) and from
    `turn.ended` to the first reply audio (None: no such event, or no audio)."""
    eos = result.wall_time(eos_s)
    turns = result.of_type("turn.ended")
    turn = turns[0].t if turns else None
    audio = result.audio[0].t if result.audio else None
    return (
        turns[0].event["text"] if turns else "",
        None if eos is None or audio is None else round(audio - eos, 3),
        None if turn is None or audio is None else round(audio - turn, 3),
    )


def _measure(mode: str, delay_ms: int, clip: Clip, result: ConversationResult, eos_s: float) -> Run:
    turn_text, eos_to_audio, turn_to_audio = first_audio(result, eos_s)
    done = [r.event for r in result.of_type("reply.done") if r.event["reply"] == 1]
    relayed = [r.event for r in result.of_type("reply.relayed") if r.event["reply"] == 1]
    return Run(
        mode=mode,
        delay_ms=delay_ms,
        clip=clip.path.name,
        turn_text=turn_text,
        reply_text="".join(r.event["text"] for r in result.of_type("reply.delta") if r.event["reply"] == 1),
        done_text=done[0]["text"] if done else None,
        prefix=relayed[0]["text"] if relayed else None,
        eos_to_first_audio_s=eos_to_audio,
        turn_end_to_first_audio_s=turn_to_audio,
    )


def until_reply_done(events: list[Any]) -> bool:
    return any(r.event["type"] == "reply.done" for r in events)


def questions(clips: list[Clip], quick: bool) -> list[Clip]:
    chosen = [c for c in clips if c.speakers == 1 and c.text and c.duration_s <= QUESTION_MAX_S]
    return chosen[:2] if quick else chosen


async def _conversations(
    ports: dict[str, int], proxy: DelayingProxy, clips: list[Clip], delays: tuple[int, ...]
) -> list[Run]:
    runs: list[Run] = []
    modes = list(ports)
    for delay in delays:
        proxy.delay_ms = delay
        for i, clip in enumerate(clips):
            audio = np.concatenate([sc.silence(0.5), sc.load(clip.path)])
            eos_s = sc.speech_end_s(audio)
            for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                url = f"ws://127.0.0.1:{ports[mode]}/v1/stream"
                result = await converse_pcm(url, audio, sc.RATE, max_s=60, until=until_reply_done)
                r = _measure(mode, delay, clip, result, eos_s)
                runs.append(r)
                print(
                    f"  {delay:>3} ms {clip.path.name} {mode:>6}: eos->audio {r.eos_to_first_audio_s} s, "
                    f"turn->audio {r.turn_end_to_first_audio_s} s, prefix {r.prefix!r}",
                    flush=True,
                )
    return runs


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Per mode and delay: the latencies; for relay, its prefix and seam keys (see the module docstring)."""
    out: dict[str, Any] = {}
    for mode in (*MODES, BASELINE):
        if mode == BASELINE and not any(r.mode == mode for r in runs):
            continue
        out[mode] = {}
        for delay in sorted({r.delay_ms for r in runs}):
            rs = [r for r in runs if r.mode == mode and r.delay_ms == delay]
            if not rs:
                continue
            entry: dict[str, Any] = {"n": len(rs)}
            for name in ("eos_to_first_audio", "turn_end_to_first_audio"):
                values = [v for r in rs if (v := getattr(r, f"{name}_s")) is not None]
                entry[f"{name}_p50_s"] = percentile(values, 50)
                entry[f"{name}_p90_s"] = percentile(values, 90)
            if mode.startswith("relay"):
                prefixed = [r for r in rs if r.prefix]
                entry["prefix_accept_rate"] = round(len(prefixed) / len(rs), 3)
                entry["prefix_words_mean"] = (
                    round(sum(len((r.prefix or "").split()) for r in prefixed) / len(prefixed), 2) if prefixed else None
                )
                exact = [
                    r.prefix is not None and r.reply_text.startswith(r.prefix) and r.done_text == r.reply_text
                    for r in rs
                ]
                entry["seam_exact"] = round(sum(exact) / len(rs), 3)
                pairs = [
                    (r, o)
                    for r in rs
                    for o in runs
                    if o.mode == "remote" and o.delay_ms == delay and o.clip == r.clip and o.turn_text == r.turn_text
                ]
                entry["same_as_remote"] = (
                    round(sum(r.reply_text == o.reply_text for r, o in pairs) / len(pairs), 3) if pairs else None
                )
                entry["same_as_remote_compared"] = len(pairs)
            out[mode][str(delay)] = entry
    return out


def targets(summary: dict[str, Any]) -> dict[str, Any]:
    """Relay's end of speech -> first audio p50 over local's at every delay (target <= 1.10), and its
    reduction against remote's at the longest delay (target >= 0.40)."""
    over_local = {}
    for delay, entry in summary.get("relay", {}).items():
        local = summary.get("local", {}).get(delay, {}).get("eos_to_first_audio_p50_s")
        mine = entry.get("eos_to_first_audio_p50_s")
        over_local[delay] = None if local is None or mine is None else round(mine / local, 3)
    longest = max(summary.get("relay", {}), key=int, default=None)
    below_remote = None
    if longest is not None:
        remote = summary.get("remote", {}).get(longest, {}).get("eos_to_first_audio_p50_s")
        mine = summary["relay"][longest].get("eos_to_first_audio_p50_s")
        below_remote = None if remote in (None, 0) or mine is None else round(1 - mine / remote, 3)
    return {"relay_over_local_eos_to_first_audio": over_local, "relay_below_remote_at_longest_delay": below_remote}


def run(
    data: Path | None,
    config: Path | None,
    quick: bool,
    delays: tuple[int, ...] = DELAYS_MS,
    remote_url: str | None = None,
    remote_model: str = "",
    baseline: bool = False,
) -> dict[str, Any]:
    """`remote_url`: the remote model's server (default: a `duplexd serve-llm` started here); `baseline`:
    also the relay that asks the remote model beside the prefix's decision (`BASELINE`)."""
    clips = questions(load_clips(data), quick)
    remote_name = remote_url or "duplexd serve-llm (SmolLM2, this machine)"
    with contextlib.ExitStack() as stack:
        if remote_url is None:  # (at nice 19: a remote model takes none of the recognizer's CPU, as on its own
            # machine; beside it at equal priority, a request at the pause slowed the turn's final pass ~2x)
            remote_url = f"http://127.0.0.1:{stack.enter_context(serve_llm_process(niceness=19))}/v1"
        proxy = stack.enter_context(DelayingProxy(remote_url))
        remote = {"dialog.backend": "remote", "dialog.remote_url": proxy.url}
        if remote_model:
            remote["dialog.remote_model"] = remote_model
        settings = {"local": {}, "remote": remote, "relay": {**remote, "dialog.mode": "relay"}}
        if baseline:
            settings[BASELINE] = {**settings["relay"], "relay.remote_at_once": "true"}
        ports = {
            mode: stack.enter_context(server_process(config, settings=setting)) for mode, setting in settings.items()
        }
        runs = asyncio.run(_conversations(ports, proxy, clips, delays))
        relay_health = health(ports["relay"]).get("relay")
    summary = summarize(runs)
    return {
        "benchmark": "relay",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "delays_ms": list(delays),
        **summary,
        "targets": targets(summary),
        "server_relay": relay_health,
        "remote_server": remote_name,
        "quality": "not scored: read `runs` (relay's replies against remote's, clip by clip)",
        "runs": [asdict(r) for r in runs],
    }


def table(result: dict[str, Any]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        "| delay | mode | eos -> first audio p50 / p90 | turn ended -> first audio p50 / p90 | relay |",
        "|---|---|---|---|---|",
    ]
    for delay in map(str, result["delays_ms"]):
        for mode in (*MODES, BASELINE):
            e = result.get(mode, {}).get(delay)
            if e is None:
                continue
            extra = ""
            if mode.startswith("relay"):
                extra = (
                    f"accepted {e['prefix_accept_rate']}, {e['prefix_words_mean']} words, seam exact "
                    f"{e['seam_exact']}, same as remote {e['same_as_remote']} ({e['same_as_remote_compared']})"
                )
            lines.append(
                f"| {delay} ms | {mode} | {s(e['eos_to_first_audio_p50_s'])} / {s(e['eos_to_first_audio_p90_s'])} "
                f"| {s(e['turn_end_to_first_audio_p50_s'])} / {s(e['turn_end_to_first_audio_p90_s'])} | {extra} |"
            )
    lines.append(f"targets: {result['targets']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    delays = tuple(int(d) for d in args.delays.split(",")) if args.delays else DELAYS_MS
    result = run(
        args.data,
        args.config,
        args.quick,
        delays,
        remote_url=args.remote_url,
        remote_model=args.remote_model,
        baseline=args.baseline,
    )
    write_result(args.out, result, table(result))
    return 0
