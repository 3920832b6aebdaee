"""Replay a recording through one session's streaming recognizer in virtual time, in this process.

The real VAD and the real ASR engine run; only the clock is simulated: audio arrives in 20 ms frames at
real-time pace, and a pass's result comes back `pass_s(window)` later in stream time (by default the pass's
own measured wall time, as on a server serving one stream). What the session sees, and when, is then what a
real-time client gets from `duplexd serve`, but repeatable and without sockets, so each knob of the
recognizer can be measured on its own (`duplexd bench asr` reports these next to the served figures).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplexd.asr.commit import norm
from duplexd.asr.engine import AsrEngine, Transcription
from duplexd.asr.streaming import PassRequest
from duplexd.asr.vad import SileroVad
from duplexd.bench.data import wer
from duplexd.bench.latency import rejoined, withdrawn_words
from duplexd.clients.stats import percentile
from duplexd.clients.stream import Final, joined
from duplexd.events import TranscriptUpdated, UtteranceFinalized, Word
from duplexd.streaming.session import Session, SessionConfig

RATE = 16_000
FRAME_S = 0.02


@dataclass(slots=True)
class Replayed:
    """What the client would have received, each with its stream time."""

    partials: list[tuple[float, TranscriptUpdated]] = field(default_factory=list)
    finals: list[tuple[float, UtteranceFinalized]] = field(default_factory=list)
    passes: int = 0
    busy_s: float = 0.0
    context_drops: int = 0  # continuations the recognizer went on to decode alone
    costs: list[tuple[float, float, bool]] = field(default_factory=list)  # (window s, wall s, preview) per pass

    @property
    def text(self) -> str:
        return joined(self.as_read())

    def as_read(self) -> list[Final]:
        def text(words: tuple[Word, ...] | None) -> str | None:
            return None if words is None else " ".join(w.text for w in words)

        return [Final(f.utterance, f.text, f.continues, text(f.previous)) for _, f in self.finals]

    def flicker(self) -> tuple[int, int]:
        """(words shown then withdrawn, words finalized): see `withdrawn_words`."""
        partials = [(p.utterance, [w.text for w in p.shown]) for _, p in self.partials]
        finals = {f.utterance: [w.text for w in f.words] for _, f in self.finals}
        return withdrawn_words(partials, finals), sum(len(words) for words in finals.values())


def replay(
    pcm: np.ndarray,
    engine: AsrEngine,
    vad: SileroVad,
    config: SessionConfig,
    pass_s: Callable[[float, float, bool], float] | None = None,
) -> Replayed:
    """Stream int16 16 kHz `pcm` through a fresh session. `pass_s(window_s, wall_s, preview)`: how long a
    pass takes in stream time (default: its wall time here)."""
    session = Session("replay", RATE, config)
    out = Replayed()
    due: list[tuple[float, int, PassRequest, Transcription]] = []  # results in flight, by arrival time
    step = int(FRAME_S * RATE)
    seq = 0

    def record(t: float, events: list) -> None:
        for ev in events:
            if isinstance(ev, TranscriptUpdated):
                out.partials.append((t, ev))
            elif isinstance(ev, UtteranceFinalized):
                out.finals.append((t, ev))

    def run_until(t: float) -> None:
        while True:
            while due and due[0][0] <= t:
                at, _, request, result = heapq.heappop(due)
                record(at, session.apply_pass(request, result))
            if not session.wants_pass():
                return
            request = session.prepare_pass()
            t0 = time.perf_counter()
            result = engine.transcribe(request.audio, request.prompt, request.preview)
            wall = time.perf_counter() - t0
            out.passes += 1
            out.busy_s += wall
            window_s = len(request.audio) / RATE
            out.costs.append((window_s, wall, request.preview))
            cost = wall if pass_s is None else pass_s(window_s, wall, request.preview)
            heapq.heappush(due, (t + cost, out.passes, request, result))
            if not due or due[0][0] > t:
                return

    def feed(chunks: np.ndarray, t: float) -> None:
        if len(chunks):
            (probs,) = vad.probabilities([session.vad_stream], [chunks])
            record(t, session.apply_vad(chunks, probs, t))
        run_until(t)

    for start in range(0, len(pcm), step):
        t = (start + step) / RATE
        run_until(t)
        feed(session.accept_frame(seq, pcm[start : start + step].astype("<i2").tobytes(), t), t)
        seq += 1
    t = len(pcm) / RATE
    feed(session.flush_audio(), t)
    session.end_of_stream()
    while session.transcriber.active:
        run_until(t)
        if due:
            t = max(t, due[0][0])
        elif not session.wants_pass():
            record(t, session.finish_without_pass())
    out.context_drops = session.transcriber.context_drops
    return out


def fit_pass_cost(costs: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares `fixed + per_s x window` (seconds) over measured (window, wall) passes."""
    if len(costs) < 2:
        return (costs[0][1], 0.0) if costs else (0.0, 0.0)
    x = np.array(costs, dtype=np.float64)
    design = np.stack([np.ones(len(x)), x[:, 0]], axis=1)
    (fixed, per_s), *_ = np.linalg.lstsq(design, x[:, 1], rcond=None)
    return float(fixed), float(per_s)


def fixed_clock(
    pass_cost: tuple[float, float] | dict[bool, tuple[float, float]],
) -> Callable[[float, float, bool], float]:
    """`replay`'s `pass_s` where a pass takes `pass_cost` ((fixed, per second of window), for every pass or
    by kind: False full passes, True previews), whatever its wall time."""

    def cost(window_s: float, _wall: float, preview: bool) -> float:
        fixed, per_s = pass_cost[preview] if isinstance(pass_cost, dict) else pass_cost
        return fixed + per_s * window_s

    return cost


def replay_clips(
    clips: list[tuple[np.ndarray, str, list[Word]]],
    engine: AsrEngine,
    vad: SileroVad,
    config: SessionConfig,
    pass_cost: tuple[float, float] | dict[bool, tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """Each (pcm, reference, offline words) replayed alone (plus 1 s of silence): WER, flicker, the joins
    of split utterances, and word latency (first shown in its final form, minus the word's end). With
    `pass_cost` ((fixed, per second of window), for every pass or by kind: False full passes, True
    previews) a pass takes that long, so two configurations meet the same clock; else its own wall time.
    Also the pass costs fitted from the measured passes (`pass_cost`: full passes; `preview_pass_cost`,
    where there were any)."""

    clock = None if pass_cost is None else fixed_clock(pass_cost)
    texts: list[str] = []
    withdrawn = final_words = splits = rejoins = 0
    latencies: list[float] = []
    costs: list[tuple[float, float, bool]] = []
    for pcm, _ref, offline in clips:
        r = replay(np.concatenate([pcm, np.zeros(RATE, np.int16)]), engine, vad, config, clock)
        texts.append(r.text)
        n, total = r.flicker()
        withdrawn, final_words = withdrawn + n, final_words + total
        n, ok = rejoined(r.as_read(), offline)
        splits, rejoins = splits + n, rejoins + ok
        costs += r.costs
        shown = [(t, p.utterance, p.shown) for t, p in r.partials] + [(t, f.utterance, f.words) for t, f in r.finals]
        for _, final in r.finals:
            for i, word in enumerate(final.words):
                first = next(
                    t for t, u, words in shown if u == final.utterance and len(words) > i and _same(words[i], word)
                )
                latencies.append(first - word.end_s)
    fits = {kind: fit_pass_cost([(w, s) for w, s, p in costs if p == kind]) for kind in (False, True)}
    previews = [s for _, s, p in costs if p]
    return {
        "wer": wer([ref for _, ref, _ in clips], texts),
        "flicker_per_100_words": 100 * withdrawn / max(final_words, 1),
        "split_utterances_rejoined": {"splits": splits, "rejoined": rejoins},
        "word_latency_p50_s": percentile(latencies, 50),
        "word_latency_p90_s": percentile(latencies, 90),
        "passes": len(costs),
        "pass_cost": _cost(fits[False], [s for _, s, p in costs if not p]),
        "preview_pass_cost": _cost(fits[True], previews) if previews else None,
        "texts": texts,
    }


def _cost(fit: tuple[float, float], walls: list[float]) -> dict[str, float]:
    return {
        "fixed_s": fit[0],
        "per_window_s": fit[1],
        "mean_s": float(np.mean(walls)) if walls else 0.0,
        "passes": len(walls),
    }


def _same(a: Word, b: Word) -> bool:
    return norm(a.text) == norm(b.text)
