"""The streaming recognizer's words over many pass clocks: where a slow pass falls decides a word now and then.

    python -m duplexd.bench.asr_sweep --clips clip01,clip06 --out sweep.json

Each clip (those with a reference text whose file name holds one of `--clips`; all of them by default) is
replayed in virtual time (`bench.asr_replay.replay`, the real VAD and model) with every full pass taking
`(0.45 x factor + shift) + 0.055 x factor` seconds per second of window, and every preview
`(0.11 x factor + shift / 3) + 0.055 x factor` (the cost fitted on this 2-core machine is about 0.45 +
0.055 per second; x2-x3 is that machine under load), for each factor and shift. The replay is deterministic
at a fixed clock, so two trees compare run for run: finals, errors, and how often a continuation dropped its
context (decoded alone from then on) or a final carries "!" (a stray one: "Ask not!").
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from duplexd.bench import write_result
from duplexd.bench.data import as_said, edit_distance

FIXED_S, PER_S, PREVIEW_FIXED_S = 0.45, 0.055, 0.11
FACTORS = (1.5, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5)
SHIFTS = (0.0, 0.03, 0.07, 0.1, 0.15)


def pass_clock(factor: float, shift_s: float) -> Callable[[float, float, bool], float]:
    """How long a pass takes in stream time (`bench.asr_replay.replay`'s `pass_s`) at one sweep clock."""
    full, preview = FIXED_S * factor + shift_s, PREVIEW_FIXED_S * factor + shift_s / 3

    def cost(window_s: float, _wall: float, is_preview: bool) -> float:
        return (preview if is_preview else full) + PER_S * factor * window_s

    return cost


def run(names: list[str], factors: tuple[float, ...], shifts: tuple[float, ...]) -> dict[str, Any]:
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
    runs: list[dict[str, Any]] = []
    totals: Counter[str] = Counter()
    for clip in clips:
        pcm = np.concatenate([read_audio(clip.path)[0], np.zeros(16_000, np.int16)])
        reference = as_said(clip.text)
        for factor in factors:
            for shift in shifts:
                r = replay(pcm, engine, vad, session, pass_clock(factor, shift))
                finals = [" ".join(w.text for w in f.words) for _, f in r.finals]
                errors = edit_distance(reference, as_said(r.text))
                runs.append(
                    {"clip": clip.path.name, "factor": factor, "shift_s": shift, "errors": errors}
                    | {"context_drops": r.context_drops, "finals": finals}
                )
                totals["runs"] += 1
                totals["errors"] += errors
                totals["context_drops"] += r.context_drops
                totals["finals_with_bang"] += sum("!" in f for f in finals)
                print(f"{clip.path.name} x{factor} +{shift}: {errors} errors | " + " || ".join(finals), flush=True)
    return {"model": engine.name, "factors": factors, "shifts_s": shifts, "totals": dict(totals), "runs": runs}


def table(r: dict[str, Any]) -> str:
    t = r["totals"]
    return "\n".join(
        [
            "| runs | errors | context drops | finals with '!' |",
            "|---|---|---|---|",
            f"| {t['runs']} | {t['errors']} | {t['context_drops']} | {t['finals_with_bang']} |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m duplexd.bench.asr_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--clips", default="", help="comma-separated parts of clip file names (default: every clip)")
    p.add_argument("--factors", default=",".join(map(str, FACTORS)), help="pass cost factors")
    p.add_argument("--shifts", default=",".join(map(str, SHIFTS)), help="seconds added to a full pass' cost")
    p.add_argument("--out", type=Path, default=Path("bench-asr-sweep.json"))
    args = p.parse_args(argv)
    names = [n for n in args.clips.split(",") if n]
    factors = tuple(float(x) for x in args.factors.split(","))
    shifts = tuple(float(x) for x in args.shifts.split(","))
    result = run(names, factors, shifts)
    write_result(args.out, result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
