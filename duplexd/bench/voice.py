"""`duplexd bench voice`: how fast the server answers, and how well it takes turns.

A real `duplexd serve` child process; one conversation at a time from a real-time client that plays the
reply audio and reports its playback (`clients.converse`), over scenarios composed from the shared clips:

- question: a clip, then silence. Latencies from the end of the speech (eos, where Silero VAD run offline
  over the composed audio last hears speech) to the first reply text and the first reply audio arriving
  at the client. A turn that ends before eos is a premature endpoint.
- pause: the same clip with a pause inserted at its quietest point mid-sentence; ending the turn during
  the pause is a premature endpoint.
- backchannel: "okay, okay" (a real meeting recording) said while the reply plays; any interruption is a
  false barge-in.
- echo: the reply's own audio leaks back into the microphone at -6 dB (no echo cancellation); any
  interruption is a false barge-in.
- talk-over: another clip said as soon as the reply's audio starts; the time from its start to
  `reply.interrupted` is the barge-in latency (a reply that ends before the words are recognized is
  not interrupted, and counts against the barge-in rate).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duplexd.bench import scenarios as sc
from duplexd.bench import write_result
from duplexd.bench.server import health, server_process
from duplexd.clients.clips import Clip, load_clips
from duplexd.clients.converse import ConversationResult, converse_pcm
from duplexd.clients.stats import percentile

QUESTION_MAX_S = 8.0  # single-speaker clips up to this long are the questions
PAUSE_S = 0.7


@dataclass(slots=True)
class Run:
    scenario: str
    clip: str
    eos_s: float
    turns: int
    premature: bool
    interrupted: bool
    eos_to_turn_end_s: float | None
    eos_to_first_token_s: float | None
    eos_to_first_audio_s: float | None
    reply_text: str
    reply_audio_s: float
    barge_in_s: float | None = None  # talk-over: from the start of the talk-over to reply.interrupted
    heard_over_reply: str = ""  # what the recognizer made of speech during the reply (last hypotheses)


def _first_at(result: ConversationResult, kind: str) -> float | None:
    found = result.of_type(kind)
    return found[0].t if found else None


def _measure(scenario: str, clip: Clip, result: ConversationResult, eos_s: float, resume_s: float | None) -> Run:
    eos_wall = result.wall_time(eos_s)
    turn_times = [r.t for r in result.of_type("turn.ended")]
    premature = any(t < eos_wall for t in turn_times)
    if resume_s is not None:  # a turn that ended during the pause ended too early
        premature = premature or any(t < result.wall_time(resume_s) for t in turn_times)
    turn = _first_at(result, "turn.ended")
    token = _first_at(result, "reply.delta")
    audio = result.audio[0].t if result.audio else None
    started = _first_at(result, "reply.started") or float("inf")
    over: dict[int, str] = {}
    for r in result.events:
        if r.t > started and r.event["type"] in ("transcript.partial", "transcript.final"):
            over[r.event["utterance"]] = r.event["text"]
    return Run(
        scenario=scenario,
        clip=clip.path.name,
        eos_s=round(eos_s, 3),
        turns=len(turn_times),
        premature=premature,
        interrupted=bool(result.of_type("reply.interrupted")),
        eos_to_turn_end_s=None if turn is None else round(turn - eos_wall, 3),
        eos_to_first_token_s=None if token is None else round(token - eos_wall, 3),
        eos_to_first_audio_s=None if audio is None else round(audio - eos_wall, 3),
        reply_text="".join(r.event["text"] for r in result.of_type("reply.delta")),
        reply_audio_s=round(sum(len(a.samples) for a in result.audio) / 24_000, 3),
        heard_over_reply=" | ".join(over.values()),
    )


async def _conversations(url: str, clips: list[Clip], quick: bool) -> list[Run]:
    speech_dir = clips[0].path.parent
    questions = [c for c in clips if c.speakers == 1 and c.text and c.duration_s <= QUESTION_MAX_S]
    if quick:
        questions = questions[:1]
    runs: list[Run] = []
    lead = sc.silence(0.5)
    for clip in questions:
        audio = np.concatenate([lead, sc.load(clip.path)])
        result = await converse_pcm(url, audio, sc.RATE, max_s=60)
        runs.append(_measure("question", clip, result, sc.speech_end_s(audio), None))
        print(f"  question {clip.path.name}: {asdict(runs[-1])}", flush=True)
    for clip in questions[: max(1, len(questions) // 2)]:
        speech = sc.load(clip.path)
        d = len(speech) / sc.RATE
        paused, resume_s = sc.with_pause(speech, 0.4 * d, 0.6 * d, PAUSE_S)
        audio = np.concatenate([lead, paused])
        result = await converse_pcm(url, audio, sc.RATE, max_s=60)
        runs.append(_measure("pause", clip, result, sc.speech_end_s(audio), len(lead) / sc.RATE + resume_s))
        print(f"  pause {clip.path.name}: turns={runs[-1].turns} premature={runs[-1].premature}", flush=True)
    for clip in questions[: max(1, len(questions) // 3)]:
        audio = np.concatenate([lead, sc.load(clip.path)])
        for scenario in ("backchannel", "echo"):
            inject = sc.During(sc.backchannel(speech_dir), after_s=0.3) if scenario == "backchannel" else None
            result = await converse_pcm(
                url, audio, sc.RATE, max_s=60, inject=inject, echo_gain=0.5 if scenario == "echo" else 0.0
            )
            runs.append(_measure(scenario, clip, result, sc.speech_end_s(audio), None))
            print(f"  {scenario} {clip.path.name}: interrupted={runs[-1].interrupted}", flush=True)
    talk = sc.load(speech_dir / "clip16_sb_example1.wav")
    for clip in questions[: max(1, len(questions) // 3)]:
        audio = np.concatenate([lead, sc.load(clip.path)])
        inject = sc.During(talk, after_s=0.0)
        result = await converse_pcm(url, audio, sc.RATE, max_s=60, inject=inject)
        run = _measure("talk_over", clip, result, sc.speech_end_s(audio), None)
        stops = result.of_type("reply.interrupted")
        if stops and inject.said_at is not None:
            run.barge_in_s = round(stops[0].t - inject.said_at, 3)
        runs.append(run)
        print(f"  talk-over {clip.path.name}: interrupted={run.interrupted} after {run.barge_in_s}", flush=True)
    return runs


def _stats(values: list[float | None]) -> dict[str, float | None]:
    v = [x for x in values if x is not None]
    return {"p50": percentile(v, 50), "p90": percentile(v, 90), "n": len(v)}


def run(data: Path | None, config: Path | None, quick: bool) -> dict[str, Any]:
    clips = load_clips(data)
    with server_process(config) as port:
        runs = asyncio.run(_conversations(f"ws://127.0.0.1:{port}/v1/stream", clips, quick))
        server = health(port)
    questions = [r for r in runs if r.scenario == "question"]
    turn_taking = [r for r in runs if r.scenario in ("question", "pause")]
    overlapped = [r for r in runs if r.scenario in ("backchannel", "echo")]
    talk_over = [r for r in runs if r.scenario == "talk_over"]
    barge_in = _stats([r.barge_in_s for r in talk_over])
    first_token = _stats([r.eos_to_first_token_s for r in questions])
    first_audio = _stats([r.eos_to_first_audio_s for r in questions])
    turn_end = _stats([r.eos_to_turn_end_s for r in questions])
    tts = server.get("tts") or {}
    return {
        "benchmark": "voice",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "eos_to_turn_end_p50_s": turn_end["p50"],
        "eos_to_turn_end_p90_s": turn_end["p90"],
        "eos_to_first_token_p50_s": first_token["p50"],
        "eos_to_first_token_p90_s": first_token["p90"],
        "eos_to_first_audio_p50_s": first_audio["p50"],
        "eos_to_first_audio_p90_s": first_audio["p90"],
        "tts_rtf": tts.get("rtf"),
        "premature_endpoint_rate": sum(r.premature for r in turn_taking) / max(1, len(turn_taking)),
        "false_barge_in_rate": sum(r.interrupted for r in overlapped) / max(1, len(overlapped)),
        "barge_in_rate": sum(r.interrupted for r in talk_over) / max(1, len(talk_over)),
        "barge_in_latency_p50_s": barge_in["p50"],
        "counts": {
            "question": len(questions),
            "pause": sum(r.scenario == "pause" for r in runs),
            "backchannel": sum(r.scenario == "backchannel" for r in runs),
            "echo": sum(r.scenario == "echo" for r in runs),
            "talk_over": len(talk_over),
        },
        "llm_steps": server.get("llm_steps"),  # engine step p50 alone vs beside another model's work
        "threads": server.get("threads"),
        "server": {k: server.get(k) for k in ("asr", "llm", "tts", "models", "llm_engine")},
        "runs": [asdict(r) for r in runs],
    }


def table(result: dict[str, Any]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    rows = [
        ("end of speech -> turn ended", result["eos_to_turn_end_p50_s"], result["eos_to_turn_end_p90_s"]),
        ("end of speech -> first reply token", result["eos_to_first_token_p50_s"], result["eos_to_first_token_p90_s"]),
        ("end of speech -> first reply audio", result["eos_to_first_audio_p50_s"], result["eos_to_first_audio_p90_s"]),
    ]
    lines = ["| latency (client side) | p50 | p90 |", "|---|---|---|"]
    lines += [f"| {name} | {s(p50)} | {s(p90)} |" for name, p50, p90 in rows]
    c = result["counts"]
    lines += [
        "",
        f"TTS real-time factor: {result['tts_rtf']}",
        f"premature endpoints: {result['premature_endpoint_rate']:.1%} of {c['question'] + c['pause']} turns",
        f"false barge-ins: {result['false_barge_in_rate']:.1%} of {c['backchannel'] + c['echo']} overlapped replies",
        f"talk-overs that interrupted: {result['barge_in_rate']:.1%} of {c['talk_over']}, "
        f"p50 {s(result['barge_in_latency_p50_s'])} after the talk-over began",
    ]
    steps, threads = result.get("llm_steps"), result.get("threads")
    if steps:
        lines.append(
            f"LLM step p50: {steps['alone_p50_ms']} ms alone ({steps['alone_n']} steps), "
            f"{steps['beside_other_model_p50_ms']} ms beside a recognizer pass or synthesis "
            f"({steps['beside_other_model_n']} steps): x{steps['ratio']}"
        )
    if threads:
        lines.append("threads: " + ", ".join(f"{k} {v}" for k, v in threads.items()))  # (openmp: the env it ran with)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args.data, args.config, args.quick)
    write_result(args.out, result, table(result))
    return 0
