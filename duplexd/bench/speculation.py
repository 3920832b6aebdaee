"""`duplexd bench speculation`: what speculative listening buys, on and off in one run.

Three real `duplexd serve` child processes run side by side, and every question clip (a single speaker,
≤ 8 s, 0.5 s of silence before it) is asked of each in turn, one conversation at a time, the order rotated
from clip to clip so that drift in this machine's speed spreads over all three:

- `on`: the defaults: the utterance is finalized at the pause (`turn.pause_ms`) and replies are drafted
  while the user pauses (`speculation.enabled`).
- `pause_only`: finalized at the pause, no drafts (what drafting alone adds: `on` against this).
- `off`: neither: the pipeline without this feature (finalized when VAD reports the end of speech).

Latencies are client-side arrival times: from the end of speech (eos, where Silero VAD run offline over
the composed audio last hears speech) and from the `turn.ended` event (the endpoint firing). Lossless:
for every clip whose user turn came out as the same text with and without drafts (`on`, `pause_only`),
the reply text must be the same.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import time
from dataclasses import asdict, dataclass
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
MODES: dict[str, dict[str, str]] = {
    "on": {},
    "pause_only": {"speculation.enabled": "false"},
    "off": {"speculation.enabled": "false", "turn.pause_ms": "0"},
}


@dataclass(slots=True)
class Run:
    mode: str
    clip: str
    turn_text: str
    reply_text: str
    eos_to_turn_end_s: float | None
    endpoint_to_first_token_s: float | None
    eos_to_first_token_s: float | None
    eos_to_first_audio_s: float | None
    drafts: int
    hit: bool
    draft_tokens: int


def _measure(mode: str, clip: Clip, result: ConversationResult, eos_s: float) -> Run:
    eos = result.wall_time(eos_s)

    def first(kind: str) -> float | None:
        found = result.of_type(kind)
        return found[0].t if found else None

    def since(t0: float | None, t: float | None) -> float | None:
        return None if t0 is None or t is None else round(t - t0, 3)

    turns = result.of_type("turn.ended")
    turn = turns[0].t if turns else None
    token = first("reply.delta")
    audio = result.audio[0].t if result.audio else None
    spec = result.of_type("reply.speculation")
    info = spec[0].event if spec else {"drafts": 0, "hit": False, "draft_tokens": 0}
    return Run(
        mode=mode,
        clip=clip.path.name,
        turn_text=turns[0].event["text"] if turns else "",
        reply_text="".join(r.event["text"] for r in result.of_type("reply.delta") if r.event["reply"] == 1),
        eos_to_turn_end_s=since(eos, turn),
        endpoint_to_first_token_s=since(turn, token),
        eos_to_first_token_s=since(eos, token),
        eos_to_first_audio_s=since(eos, audio),
        drafts=info["drafts"],
        hit=info["hit"],
        draft_tokens=info["draft_tokens"],
    )


def _until_reply_done(events: list[Any]) -> bool:
    return any(r.event["type"] == "reply.done" for r in events)


async def _conversations(ports: dict[str, int], clips: list[Clip], quick: bool) -> list[Run]:
    questions = [c for c in clips if c.speakers == 1 and c.text and c.duration_s <= QUESTION_MAX_S]
    if quick:
        questions = questions[:2]
    runs: list[Run] = []
    modes = list(ports)
    for i, clip in enumerate(questions):
        audio = np.concatenate([sc.silence(0.5), sc.load(clip.path)])
        eos_s = sc.speech_end_s(audio)
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            url = f"ws://127.0.0.1:{ports[mode]}/v1/stream"
            result = await converse_pcm(url, audio, sc.RATE, max_s=60, until=_until_reply_done)
            runs.append(_measure(mode, clip, result, eos_s))
            r = runs[-1]
            print(
                f"  {clip.path.name} {mode:>10}: eos->audio {r.eos_to_first_audio_s} s, endpoint->token "
                f"{r.endpoint_to_first_token_s} s, drafts {r.drafts}, hit {r.hit} ({r.draft_tokens} tokens)",
                flush=True,
            )
    return runs


def _summary(runs: list[Run]) -> dict[str, Any]:
    def stat(name: str) -> dict[str, float | None]:
        values = [v for r in runs if (v := getattr(r, name)) is not None]
        return {"p50": percentile(values, 50), "p90": percentile(values, 90)}

    out: dict[str, Any] = {"n": len(runs)}
    for name in ("eos_to_turn_end", "endpoint_to_first_token", "eos_to_first_token", "eos_to_first_audio"):
        s = stat(f"{name}_s")
        out[f"{name}_p50_s"], out[f"{name}_p90_s"] = s["p50"], s["p90"]
    drafted = [r for r in runs if r.drafts]
    out["hit_rate"] = round(sum(r.hit for r in drafted) / len(drafted), 3) if drafted else 0.0
    out["drafted_turns"] = len(drafted)
    return out


def _reduction(on: float | None, off: float | None) -> float | None:
    return None if on is None or not off else round(1 - on / off, 3)


def run(data: Path | None, config: Path | None, quick: bool, remote: bool = False) -> dict[str, Any]:
    """`remote`: every server's replies stream from one `duplexd serve-llm` (`[dialog] backend = "remote"`):
    no P(end of turn), so drafts are early requests made at the pause."""
    clips = load_clips(data)
    with contextlib.ExitStack() as stack:
        extra = {}
        if remote:  # one `duplexd serve-llm` (the same model, greedy) for every server
            llm_port = stack.enter_context(serve_llm_process())
            extra = {"dialog.backend": "remote", "dialog.remote_url": f"http://127.0.0.1:{llm_port}/v1"}
        ports = {
            mode: stack.enter_context(server_process(config, settings={**s, **extra})) for mode, s in MODES.items()
        }
        runs = asyncio.run(_conversations(ports, clips, quick))
        servers = {mode: health(port) for mode, port in ports.items()}
    by_mode = {mode: [r for r in runs if r.mode == mode] for mode in MODES}
    compared = matched = 0
    mismatches: list[str] = []
    for a, b in zip(by_mode["on"], by_mode["pause_only"], strict=True):
        if a.turn_text == b.turn_text:
            compared += 1
            if a.reply_text == b.reply_text:
                matched += 1
            else:
                mismatches.append(a.clip)
    spec = servers["on"].get("speculation") or {}
    llm = servers["on"].get("llm") or {}
    result: dict[str, Any] = {
        "benchmark": "speculation",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "dialog_backend": "remote (duplexd serve-llm)" if remote else "local",
        **{mode: _summary(rs) for mode, rs in by_mode.items()},
        "hit_rate": spec.get("hit_rate"),
        "wasted_draft_tokens": spec.get("wasted_tokens"),
        "draft_compute_share": (
            round(llm["draft_busy_s"] / llm["busy_s"], 3) if llm.get("busy_s") and "draft_busy_s" in llm else None
        ),
        "lossless": compared > 0 and matched == compared,
        "lossless_compared": compared,
        "lossless_mismatches": mismatches,
        "asr_pass_p50_s": {mode: (s.get("asr") or {}).get("pass_p50_s") for mode, s in servers.items()},
        "server_speculation": spec,
        "runs": [asdict(r) for r in runs],
    }
    on, off = result["on"], result["off"]
    result["reduction_vs_off"] = {
        k: _reduction(on[k], off[k])
        for k in ("endpoint_to_first_token_p50_s", "eos_to_first_token_p50_s", "eos_to_first_audio_p50_s")
    }
    result["reduction_vs_pause_only"] = {
        k: _reduction(on[k], result["pause_only"][k])
        for k in ("endpoint_to_first_token_p50_s", "eos_to_first_token_p50_s", "eos_to_first_audio_p50_s")
    }
    return result


def table(result: dict[str, Any]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        "| p50 / p90 (s) | on | pause_only | off |",
        "|---|---|---|---|",
    ]
    for name, label in (
        ("eos_to_turn_end", "end of speech -> turn ended"),
        ("endpoint_to_first_token", "turn ended -> first token"),
        ("eos_to_first_token", "end of speech -> first token"),
        ("eos_to_first_audio", "end of speech -> first audio"),
    ):
        cells = [f"{s(result[m][f'{name}_p50_s'])} / {s(result[m][f'{name}_p90_s'])}" for m in MODES]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"hit rate {result['hit_rate']} ({result['on']['drafted_turns']} drafted turns), wasted draft tokens "
        f"{result['wasted_draft_tokens']}, draft share of LLM compute {result['draft_compute_share']}",
        f"lossless: {result['lossless']} ({result['lossless_compared']} replies compared)",
        f"reduction vs off: {result['reduction_vs_off']}",
        f"ASR pass p50 (s): {result['asr_pass_p50_s']}",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args.data, args.config, args.quick, remote=args.remote_llm)
    write_result(args.out, result, table(result))
    return 0
