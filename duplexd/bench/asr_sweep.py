"""The streaming recognizer's words over many pass clocks: where a slow pass falls decides a word now and then.

    python -m duplexd.bench.asr_sweep --clips clip01,clip06 --out sweep.json
    python -m duplexd.bench.asr_sweep --programs 9 --factors 1,2 --shifts 0 --out programs.json

Each clip (those with a reference text whose file name holds one of `--clips`; all of them by default) is
replayed in virtual time (`bench.asr_replay.replay`, the real VAD and model) with every full pass taking
`(0.45 x factor + shift) + 0.055 x factor` seconds per second of window, and every preview
`(0.11 x factor + shift / 3) + 0.055 x factor` (the cost fitted on this 2-core machine is about 0.45 +
0.055 per second; x2-x3 is that machine under load), for each factor and shift. The replay is deterministic
at a fixed clock, so two trees compare run for run: finals, errors, and how often a continuation dropped its
context (decoded alone from then on) or a final carries "!" (a stray one: "Ask not!"). Each clip or program
is also transcribed offline (faster-whisper's whole-file `transcribe`, the baseline of `bench asr`), so the
streaming/offline error ratio is read over the same words.

With `--programs N`, instead of each clip alone, the first N programs `bench peer` streams at one stream
(the clips end to end, 1 s apart, about 40 s each, each starting where the one before ended), scored
against their references joined: what an utterance makes of the unrelated speech before it; and 814
words where the clips alone are 241, so a ratio against offline moves by 0.04 per word instead of 0.2.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from duplexd.bench import write_result
from duplexd.bench.data import as_said, edit_distance

if TYPE_CHECKING:
    from duplexd.clients.clips import Clip

FIXED_S, PER_S, PREVIEW_FIXED_S = 0.45, 0.055, 0.11
FACTORS = (1.5, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5)
SHIFTS = (0.0, 0.03, 0.07, 0.1, 0.15)


def pass_clock(factor: float, shift_s: float) -> Callable[[float, float, bool], float]:
    """How long a pass takes in stream time (`bench.asr_replay.replay`'s `pass_s`) at one sweep clock."""
    from duplexd.bench.asr_replay import fixed_clock

    per_s = PER_S * factor
    return fixed_clock(
        {False: (FIXED_S * factor + shift_s, per_s), True: (PREVIEW_FIXED_S * factor + shift_s / 3, per_s)}
    )


def programs(clips: list[Clip], n: int) -> list[tuple[str, np.ndarray, str]]:
    """(name, int16 PCM, reference) of the first `n` programs `bench peer` streams at one stream."""
    from duplexd.bench.peer import STREAM_S, _rounds

    batches = _rounds(clips, {c.path: [] for c in clips}, 1, n, STREAM_S)
    return [(f"program{k + 1}", p.pcm, " ".join(p.refs)) for k, (p,) in enumerate(batches)]


def run(names: list[str], factors: tuple[float, ...], shifts: tuple[float, ...], n_programs: int = 0) -> dict[str, Any]:
    from duplexd.asr.engine import FasterWhisperEngine
    from duplexd.asr.vad import SileroVad
    from duplexd.bench.asr_replay import replay
    from duplexd.clients.clips import load_clips
    from duplexd.clients.stream import read_audio
    from duplexd.config import load_config
    from duplexd.streaming.session import SessionConfig

    config = load_config(None)
    vad, engine = SileroVad(), FasterWhisperEngine(config.asr)
    session = SessionConfig(vad=config.vad, asr=config.asr, pause_ms=config.turn.pause_ms)
    clips = [c for c in load_clips() if c.text and (not names or any(n in c.path.name for n in names))]
    if n_programs:
        items = programs(clips, n_programs)
    else:
        silence = np.zeros(16_000, np.int16)
        items = [(c.path.name, np.concatenate([read_audio(c.path)[0], silence]), c.text or "") for c in clips]
    runs: list[dict[str, Any]] = []
    totals: Counter[str] = Counter()
    for name, pcm, text in items:
        reference = as_said(text)
        offline = engine.transcribe_offline(pcm.astype(np.float32) / 32768.0).words
        offline_errors = edit_distance(reference, as_said(" ".join(w.text for w in offline)))
        for factor in factors:
            for shift in shifts:
                r = replay(pcm, engine, vad, session, pass_clock(factor, shift))
                finals = [" ".join(w.text for w in f.words) for _, f in r.finals]
                errors = edit_distance(reference, as_said(r.text))
                runs.append(
                    {"clip": name, "factor": factor, "shift_s": shift, "errors": errors, "words": len(reference)}
                    | {"offline_errors": offline_errors}
                    | {"context_drops": r.context_drops, "finals": finals}
                )
                totals["runs"] += 1
                totals["errors"] += errors
                totals["offline_errors"] += offline_errors
                totals["words"] += len(reference)
                totals["context_drops"] += r.context_drops
                totals["finals_with_bang"] += sum("!" in f for f in finals)
                print(f"{name} x{factor} +{shift}: {errors} errors | " + " || ".join(finals), flush=True)
    return {"model": engine.name, "factors": factors, "shifts_s": shifts, "totals": dict(totals), "runs": runs}


def table(r: dict[str, Any]) -> str:
    t = r["totals"]
    ratio = f"{t['errors'] / t['offline_errors']:.2f}" if t["offline_errors"] else "-"
    return "\n".join(
        [
            "| runs | errors (of words) | offline errors | streaming / offline | context drops | finals with '!' |",
            "|---|---|---|---|---|---|",
            f"| {t['runs']} | {t['errors']} ({t['words']}) | {t['offline_errors']} | {ratio} | {t['context_drops']}"
            f" | {t['finals_with_bang']} |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m duplexd.bench.asr_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--clips", default="", help="comma-separated parts of clip file names (default: every clip)")
    p.add_argument("--factors", default=",".join(map(str, FACTORS)), help="pass cost factors")
    p.add_argument("--shifts", default=",".join(map(str, SHIFTS)), help="seconds added to a full pass' cost")
    p.add_argument("--programs", type=int, default=0, help="replay bench peer's first N one-stream programs instead")
    p.add_argument("--out", type=Path, default=Path("bench-asr-sweep.json"))
    args = p.parse_args(argv)
    names = [n for n in args.clips.split(",") if n]
    factors = tuple(float(x) for x in args.factors.split(","))
    shifts = tuple(float(x) for x in args.shifts.split(","))
    result = run(names, factors, shifts, args.programs)
    write_result(args.out, result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
