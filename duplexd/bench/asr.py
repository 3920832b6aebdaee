"""`duplexd bench asr`: streaming vs offline WER, word latencies, ASR cost, and 1/2/4 concurrent streams.

Everything is measured in one run on this machine: the offline transcription of the same clips by the
same model (faster-whisper's own whole-file `transcribe`, same beam size) is the accuracy baseline; a real
`duplexd serve` child process serves real-time-paced clients.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from duplexd.bench import write_result
from duplexd.bench.data import wer
from duplexd.bench.latency import WordTiming, rejoined, withdrawn_words, word_timings
from duplexd.bench.server import health, server_process
from duplexd.clients.clips import Clip, load_clips
from duplexd.clients.stats import percentile
from duplexd.clients.stream import Final, read_audio, stream_pcm
from duplexd.config import load_config
from duplexd.events import Word

if TYPE_CHECKING:
    from duplexd.asr.engine import AsrEngine
    from duplexd.asr.vad import SileroVad
    from duplexd.streaming.session import SessionConfig

RATE = 16_000
GAP_S = 1.0


@dataclass(frozen=True, slots=True)
class Program:
    """What one client streams: clips laid end to end with silence between them."""

    pcm: np.ndarray
    words: list[Word]  # offline words in stream time
    refs: list[str]

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / RATE


def _offline(clips: list[Clip], config_path: Path | None) -> tuple[dict[Path, list[Word]], dict[Path, str], float]:
    from duplexd.asr.engine import FasterWhisperEngine

    engine = FasterWhisperEngine(load_config(config_path).asr)
    words: dict[Path, list[Word]] = {}
    texts: dict[Path, str] = {}
    busy = 0.0
    for clip in clips:
        pcm, rate = read_audio(clip.path)
        assert rate == RATE, f"{clip.path} is not 16 kHz"
        t0 = time.perf_counter()
        result = engine.transcribe_offline(pcm.astype(np.float32) / 32768.0)
        busy += time.perf_counter() - t0
        words[clip.path] = result.words
        texts[clip.path] = " ".join(w.text for w in result.words)
    return words, texts, busy


OFFLINE_LEADS_S = (0.1, 0.2, 0.3, 0.4, 0.5)  # (and 0: the baseline itself)


def offline_by_lead(
    transcribe: Callable[[np.ndarray], str], audio: list[np.ndarray], refs: list[str], leads_s: Sequence[float]
) -> dict[str, float]:
    """The offline baseline's own spread: its WER over the clips (`audio` int16, 16 kHz) with each of
    `leads_s` seconds of silence before every clip, the same speech starting a little later. One proper
    name's spelling moves with it (clip20's "Claflin", "Klafflin": 4 to 6 errors of 241 words over 0-0.5 s),
    and a streaming window starts wherever VAD heard the onset: the ratio against one offline decode is
    partly that decode's luck."""
    out = {}
    for lead in leads_s:
        pad = np.zeros(round(lead * RATE), np.float32)
        hyps = [transcribe(np.concatenate([pad, pcm.astype(np.float32) / 32768.0])) for pcm in audio]
        out[f"{lead:g}"] = wer(refs, hyps)
    return out


def _program(clips: list[Clip], offline: dict[Path, list[Word]], target_s: float, rotate: int) -> Program:
    parts: list[np.ndarray] = []
    words: list[Word] = []
    refs: list[str] = []
    t = 0.0
    i = rotate
    while True:  # at least one clip, then until target_s (each clip at most once)
        clip = clips[i % len(clips)]
        i += 1
        pcm, _ = read_audio(clip.path)
        parts += [pcm, np.zeros(int(GAP_S * RATE), np.int16)]
        words += [Word(w.text, w.start_s + t, w.end_s + t) for w in offline[clip.path]]
        refs.append(clip.text or "")
        t += len(pcm) / RATE + GAP_S
        if t >= target_s or i - rotate >= len(clips):
            break
    return Program(np.concatenate(parts), words, refs)


def _stats(timings: list[WordTiming]) -> dict[str, float | None]:
    partial = [t.partial_latency_s for t in timings]
    commit = [t.commit_latency_s for t in timings]
    return {
        "partial_latency_p50_s": percentile(partial, 50),
        "partial_latency_p90_s": percentile(partial, 90),
        "commit_latency_p50_s": percentile(commit, 50),
        "commit_latency_p90_s": percentile(commit, 90),
        "words_timed": len(timings),
    }


async def _run_streams(url: str, programs: list[Program]) -> list[Any]:
    return await asyncio.gather(*(stream_pcm(url, p.pcm, RATE) for p in programs))


def _asr_load(before: dict[str, Any], after: dict[str, Any], wall_audio_s: float) -> dict[str, float | None]:
    """Server-side ASR cost over a run: busy share of real time, passes per second, mean window."""
    passes = after["passes"] - before["passes"]
    return {
        "rtf": (after["busy_s"] - before["busy_s"]) / wall_audio_s,
        "passes_per_audio_s": passes / wall_audio_s,
        "mean_pass_s": (after["busy_s"] - before["busy_s"]) / passes if passes else None,
        "mean_window_s": (after["window_audio_s"] - before["window_audio_s"]) / passes if passes else None,
    }


def _readability(results: list[Any], offline: list[list[Word]]) -> dict[str, Any]:
    """Flicker (words partials showed that the final withdrew, per 100 final words) and how the utterances
    split at a pause read where the speaker went on (joins that read as the offline transcript does)."""
    withdrawn = final_words = splits = rejoins = 0
    for result, words in zip(results, offline, strict=True):
        partials = [(e["utterance"], [w["w"] for w in e["words"]]) for e in _events(result, "transcript.partial")]
        finals = [Final.of(e) for e in result.finals]
        withdrawn += withdrawn_words(partials, {f.utterance: f.text.split() for f in finals})
        final_words += sum(len(f.text.split()) for f in finals)
        n, ok = rejoined(finals, words)
        splits, rejoins = splits + n, rejoins + ok
    return {
        "flicker_per_100_words": 100 * withdrawn / max(final_words, 1),
        "split_utterances_rejoined": {"splits": splits, "rejoined": rejoins},
    }


def _events(result: Any, kind: str) -> list[dict[str, Any]]:
    return [r.event for r in result.of_type(kind)]


def _frame_lag_p99(results: list[Any]) -> float | None:
    lags = [r.event["max_lag_ms"] for res in results for r in res.of_type("frame.ack")]
    return percentile(lags, 99)


def _growth(timings: list[WordTiming], duration_s: float) -> float | None:
    first = [t.partial_latency_s for t in timings if t.audio_end_s < duration_s / 2]
    second = [t.partial_latency_s for t in timings if t.audio_end_s >= duration_s / 2]
    a, b = percentile(first, 50), percentile(second, 50)
    return None if not a or b is None else b / a


def _replays(
    clips: list[Clip], config_path: Path | None, models: list[str], clocks: tuple[float, ...] = (), n_programs: int = 0
) -> dict[str, Any]:
    """Each model (`[asr] model` values; "" the bundled tiny.en) over the clips in this process, virtual
    time, each pass taking its own wall time (`bench.asr_replay`): accuracy, flicker, joins, latency and
    the pass cost, side by side in one run. `clocks`: the replay again with every pass taking the fitted
    cost times each factor. Where one run's passes happen to fall decides a word now and then (a name's
    spelling, "so" or "sew", changes with 0.3 s more audio in the window, offline too); WER over several
    clocks is less at the mercy of that. `n_programs`: also `bench peer`'s first one-stream programs
    (`_replay_programs`)."""
    import dataclasses

    from duplexd.asr.engine import FasterWhisperEngine
    from duplexd.asr.vad import SileroVad
    from duplexd.bench.asr_replay import replay_clips
    from duplexd.streaming.session import SessionConfig

    config = load_config(config_path)
    vad = SileroVad()
    out: dict[str, Any] = {}
    for model in models:
        asr = dataclasses.replace(config.asr, model=model)
        engine = FasterWhisperEngine(asr)
        audio = [read_audio(c.path)[0] for c in clips]
        offline = [engine.transcribe_offline(pcm.astype(np.float32) / 32768.0).words for pcm in audio]
        refs = [c.text or "" for c in clips]
        print(f"replay: {engine.name} over {len(clips)} clips ...", flush=True)
        session = SessionConfig(vad=config.vad, asr=asr, pause_ms=config.turn.pause_ms)
        clips_in = list(zip(audio, refs, offline, strict=True))
        result = replay_clips(clips_in, engine, vad, session)
        result["wer_offline"] = wer(refs, [" ".join(w.text for w in words) for words in offline])
        result["wer_ratio_streaming_over_offline"] = (
            result["wer"] / result["wer_offline"] if result["wer_offline"] else None
        )
        by_lead = {"0": result["wer_offline"]}  # (read above; the other leads decode again)
        by_lead |= offline_by_lead(
            lambda x, e=engine: " ".join(w.text for w in e.transcribe_offline(x).words), audio, refs, OFFLINE_LEADS_S
        )
        lead_mean = sum(by_lead.values()) / len(by_lead)
        result["wer_offline_by_lead"] = by_lead
        result["wer_ratio_over_offline_lead_mean"] = result["wer"] / lead_mean if lead_mean else None
        fits = {False: result["pass_cost"], True: result["preview_pass_cost"] or result["pass_cost"]}
        if clocks:
            by_clock = {
                str(k): replay_clips(
                    clips_in,
                    engine,
                    vad,
                    session,
                    pass_cost=_scaled(fits, k),
                )["wer"]
                for k in clocks
            }
            mean = sum(by_clock.values()) / len(by_clock)
            result["wer_by_clock"] = by_clock
            result["wer_mean_over_clocks"] = mean
            result["wer_ratio_mean_over_clocks"] = mean / result["wer_offline"] if result["wer_offline"] else None
        if n_programs:
            print(f"replay: {engine.name} over {n_programs} programs ...", flush=True)
            result["programs"] = _replay_programs(clips, n_programs, engine, vad, session, fits, clocks or (1.0,))
        out[model or "tiny.en"] = result
    return out


def _replay_programs(
    clips: list[Clip],
    n: int,
    engine: AsrEngine,
    vad: SileroVad,
    session: SessionConfig,
    fits: dict[bool, dict[str, Any]],
    clocks: tuple[float, ...],
) -> dict[str, Any]:
    """The first `n` programs `bench peer` streams at one stream (the clips end to end, 1 s apart, ~40 s
    each), replayed at each clock (the fitted pass costs times the factor) and transcribed offline whole:
    the streaming/offline ratio over the clips as one stream of speech, where nine programs hold 814 words
    against the clips' 241, so one word moves it by about 0.04 instead of 0.2."""
    from duplexd.bench.asr_replay import fixed_clock, replay
    from duplexd.bench.asr_sweep import programs
    from duplexd.bench.data import as_said

    items = programs(clips, n)
    refs = [ref for _, _, ref in items]
    offline = wer(
        refs,
        [
            " ".join(w.text for w in engine.transcribe_offline(pcm.astype(np.float32) / 32768.0).words)
            for _, pcm, _ in items
        ],
    )

    by_clock = {
        str(k): wer(
            refs, [replay(pcm, engine, vad, session, fixed_clock(_scaled(fits, k))).text for _, pcm, _ in items]
        )
        for k in clocks
    }
    mean = sum(by_clock.values()) / len(by_clock)
    return {
        "programs": len(items),
        "words": sum(len(as_said(r)) for r in refs),
        "wer_offline": offline,
        "wer_by_clock": by_clock,
        "wer_mean_over_clocks": mean,
        "wer_ratio_streaming_over_offline": mean / offline if offline else None,
    }


def _scaled(fits: dict[bool, dict[str, Any]], k: float) -> dict[bool, tuple[float, float]]:
    """The fitted pass costs (by kind: False full passes, True previews) times `k`, as `pass_cost`."""
    return {p: (k * c["fixed_s"], k * c["per_window_s"]) for p, c in fits.items()}


def run(
    data: Path | None,
    config_path: Path | None,
    quick: bool,
    streams: tuple[int, ...] = (1, 2, 4),
    per_clip: bool = True,
    replay_models: list[str] | None = None,
    clocks: tuple[float, ...] = (),
    n_programs: int = 0,
) -> dict[str, Any]:
    clips = [c for c in load_clips(data) if c.text]
    if quick:
        clips = clips[:5]
    long_s = 20.0 if quick else 60.0
    print(f"offline transcription of {len(clips)} clips ...", flush=True)
    offline, offline_text, offline_busy = _offline(clips, config_path)
    audio_s = sum(len(read_audio(c.path)[0]) / RATE for c in clips)
    out: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "model": load_config(config_path).asr.model or "tiny.en (bundled)",
        "clips": len(clips),
        "audio_s": round(audio_s, 2),
        "wer_offline": wer([c.text or "" for c in clips], [offline_text[c.path] for c in clips]),
        "offline_rtf": offline_busy / audio_s,
    }
    if replay_models:
        out["replay"] = _replays(clips, config_path, replay_models, clocks, n_programs)
    if not per_clip and not streams:
        return out
    with server_process(config_path) as port:
        url = f"ws://127.0.0.1:{port}/v1/stream"
        if per_clip:
            before = health(port)["asr"]
            print(f"1 stream, {len(clips)} clips one after another at real time ...", flush=True)
            texts, timings, results = [], [], []
            for clip in clips:
                program = _program([clip], offline, 0.0, 0)
                (result,) = asyncio.run(_run_streams(url, [program]))
                texts.append(result.text)
                results.append(result)
                timings += word_timings(result, program.words)
            after = health(port)["asr"]
            out["wer_streaming"] = wer([c.text or "" for c in clips], texts)
            out["per_clip"] = [
                {
                    "clip": c.path.name,
                    "wer_streaming": wer([c.text or ""], [text]),
                    "wer_offline": wer([c.text or ""], [offline_text[c.path]]),
                    "streaming": text,
                    "offline": offline_text[c.path],
                }
                for c, text in zip(clips, texts, strict=True)
            ]
            out["wer_ratio_streaming_over_offline"] = (
                out["wer_streaming"] / out["wer_offline"] if out["wer_offline"] else None
            )
            out.update(_readability(results, [offline[c.path] for c in clips]))
            out.update(_stats(timings))
            out.update(_asr_load(before, after, audio_s + GAP_S * len(clips)))
        out["concurrency"] = {}
        for n in streams:
            print(f"{n} concurrent stream(s) of {long_s:.0f} s ...", flush=True)
            programs = [_program(clips, offline, long_s, rotate=3 * k) for k in range(n)]
            before = health(port)["asr"]
            results = asyncio.run(_run_streams(url, programs))
            after = health(port)["asr"]
            all_timings = []
            growth = []
            for program, result in zip(programs, results, strict=True):
                t = word_timings(result, program.words)
                all_timings += t
                growth.append(_growth(t, program.duration_s))
            out["concurrency"][str(n)] = {
                **_stats(all_timings),
                "frame_lag_p99_ms": _frame_lag_p99(results),
                "wer_streaming": wer([" ".join(p.refs) for p in programs], [r.text for r in results]),
                "partial_latency_growth": max((g for g in growth if g is not None), default=None),
                "stream_s": round(max(p.duration_s for p in programs), 1),
                **_asr_load(before, after, max(p.duration_s for p in programs)),
            }
    return out


def table(r: dict[str, Any]) -> str:
    def f(v: Any, unit: str = "") -> str:
        return "—" if v is None else f"{v:.2f}{unit}" if isinstance(v, float) else f"{v}{unit}"

    lines = []
    for model, x in r.get("replay", {}).items():
        cost = x["pass_cost"]
        lines.append(
            f"replay {model}: WER {f(x['wer'])} vs offline {f(x['wer_offline'])} "
            f"(ratio {f(x['wer_ratio_streaming_over_offline'])}); flicker {f(x['flicker_per_100_words'])}; joins "
            f"{x['split_utterances_rejoined']['rejoined']}/{x['split_utterances_rejoined']['splits']}; word latency "
            f"p50/p90 {f(x['word_latency_p50_s'])}/{f(x['word_latency_p90_s'])} s; pass {f(cost['fixed_s'])} s "
            f"+ {f(cost['per_window_s'])} s per s of window"
            + (
                f" (previews {f(preview['fixed_s'])} s + {f(preview['per_window_s'])} s per s, {preview['passes']} "
                f"of {preview['passes'] + cost['passes']} passes)"
                if (preview := x.get("preview_pass_cost"))
                else ""
            )
        )
        if "wer_offline_by_lead" in x:
            each = ", ".join(f"{k} s {v:.3f}" for k, v in x["wer_offline_by_lead"].items())
            lines.append(
                f"offline {model} with silence before each clip: WER {each} "
                f"(streaming over their mean {f(x['wer_ratio_over_offline_lead_mean'])})"
            )
        if "wer_by_clock" in x:
            each = ", ".join(f"x{k} {f(v)}" for k, v in x["wer_by_clock"].items())
            lines.append(
                f"replay {model} over pass clocks: WER {each}; mean {f(x['wer_mean_over_clocks'])} "
                f"(ratio {f(x['wer_ratio_mean_over_clocks'])})"
            )
        if "programs" in x:
            g = x["programs"]
            each = ", ".join(f"x{k} {f(v)}" for k, v in g["wer_by_clock"].items())
            lines.append(
                f"replay {model} over bench peer's first {g['programs']} programs ({g['words']} words): WER {each}; "
                f"offline {f(g['wer_offline'])} (ratio {f(g['wer_ratio_streaming_over_offline'])})"
            )
    if "wer_streaming" in r:
        lines += [
            f"WER streaming {f(r['wer_streaming'])} vs offline {f(r['wer_offline'])} "
            f"(ratio {f(r['wer_ratio_streaming_over_offline'])}); flicker {f(r['flicker_per_100_words'])} "
            f"withdrawn words per 100; joins read right {r['split_utterances_rejoined']['rejoined']} of "
            f"{r['split_utterances_rejoined']['splits']}; rtf {f(r['rtf'])}; "
            f"passes/audio s {f(r['passes_per_audio_s'])}; 1 stream per clip: partial p50 "
            f"{f(r['partial_latency_p50_s'], ' s')}, commit p50 {f(r['commit_latency_p50_s'], ' s')}"
        ]
    lines += [
        "| streams | partial p50 | partial p90 | commit p50 | commit p90 | frame lag p99 | WER | growth | rtf "
        "| pass | window |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, c in r.get("concurrency", {}).items():
        lines.append(
            f"| {n} | {f(c['partial_latency_p50_s'], ' s')} | {f(c['partial_latency_p90_s'], ' s')} "
            f"| {f(c['commit_latency_p50_s'], ' s')} | {f(c['commit_latency_p90_s'], ' s')} "
            f"| {f(c['frame_lag_p99_ms'], ' ms')} | {f(c['wer_streaming'])} | {f(c['partial_latency_growth'])} "
            f"| {f(c['rtf'])} | {f(c['mean_pass_s'], ' s')} | {f(c['mean_window_s'], ' s')} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    streams = tuple(int(n) for n in args.streams.split(",") if n)
    models = (
        None if args.replay is None else ["" if m in ("", "tiny", "tiny.en") else m for m in args.replay.split(",")]
    )
    clocks = tuple(float(k) for k in (args.clocks or "").split(",") if k)
    result = run(
        args.data,
        args.config,
        args.quick,
        streams,
        per_clip=not args.no_per_clip,
        replay_models=models,
        clocks=clocks,
        n_programs=args.programs,
    )
    write_result(args.out, result, table(result))
    return 0
