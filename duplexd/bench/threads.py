"""`duplexd bench threads`: what the LLM and the recognizer cost each other on these cores, per OpenMP setup.

The server runs the dialog engine (torch) and the recognizer (CTranslate2) on threads of one process, each
with an OpenMP team. How those teams wait decides how fast each runs alone and beside the other. Each setup
runs in a child process of its own (the environment and the load order are read once, when the runtimes
load), laid out as the server is: the model loaded on a thread that then exits, engine steps on one worker
thread, recognizer passes on another. Measured in each:

- decode tok/s of 4 concurrent replies alone, and while recognizer passes run back to back;
- one recognizer pass (a real 4–8 s clip) alone, and while the engine decodes.

Setups: `shared_passive` is duplexd before this benchmark (torch loaded first, so CTranslate2 binds to
torch's OpenMP runtime; `OMP_WAIT_POLICY=PASSIVE`); `separate_spin` is the default (`cli.openmp_setup`:
CTranslate2 first, `GOMP_SPINCOUNT=10000`), and with `_take_turns` as the server runs it by default
(`dialog.take_turns_with_asr`: engine steps and passes under one lock, a pass's time then includes its
wait); the others vary one thing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from duplexd.bench import write_result

# name: (CTranslate2 first, environment, LLM threads (0: one per core), steps and passes take turns)
SETUPS: dict[str, tuple[bool, dict[str, str], int, bool]] = {
    "shared_passive": (False, {"OMP_WAIT_POLICY": "PASSIVE"}, 0, False),
    "shared_default": (False, {}, 0, False),
    "separate_passive": (True, {"OMP_WAIT_POLICY": "PASSIVE"}, 0, False),
    "separate_spin": (True, {"GOMP_SPINCOUNT": "10000"}, 0, False),
    "separate_spin_llm_1_thread": (True, {"GOMP_SPINCOUNT": "10000"}, 1, False),
    "separate_spin_take_turns": (True, {"GOMP_SPINCOUNT": "10000"}, 0, True),
}
SESSIONS = 4
REPEATS = 3


def _child(ct2_first: bool, llm_threads: int, take_turns: bool, data: str | None) -> dict[str, Any]:
    """One setup, measured in this process (started fresh for it)."""
    if ct2_first:
        import ctranslate2  # noqa: F401
    import numpy as np

    from duplexd.asr.engine import FasterWhisperEngine
    from duplexd.bench.llm import _aggregate
    from duplexd.clients.clips import load, load_clips
    from duplexd.config import AsrConfig
    from duplexd.dialog.engine import DialogEngine, EngineConfig

    with ThreadPoolExecutor(1) as loader:  # (as the server: loaded on a thread that is gone after)
        engine = loader.submit(DialogEngine.load, EngineConfig(max_sessions=SESSIONS, threads=llm_threads)).result()
        asr = loader.submit(FasterWhisperEngine, AsrConfig()).result()
    clip = next(c for c in load_clips(Path(data) if data else None) if 4.0 <= c.duration_s <= 8.0)
    audio = load(clip.path).astype(np.float32) / 32768.0  # (int16 -> [-1, 1])
    llm_thread, asr_thread = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    cores = threading.Lock() if take_turns else contextlib.nullcontext()  # (as `dialog.take_turns_with_asr`)
    step = engine.step

    def locked_step() -> dict[int, list[int]]:
        with cores:
            return step()

    engine.step = locked_step  # type: ignore[method-assign]

    def decode() -> float:
        return float(llm_thread.submit(_aggregate, engine, SESSIONS, 24).result()["tok_s"])

    def recognize() -> float:
        def one() -> float:
            t0 = time.perf_counter()  # (a pass's latency: with the wait for the cores)
            with cores:
                asr.transcribe(audio, "")
            return time.perf_counter() - t0

        return asr_thread.submit(one).result()

    def beside(measure: Any, other: Any) -> float:
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                other()

        runner = threading.Thread(target=loop)
        runner.start()
        time.sleep(0.3)
        try:
            return statistics.median(measure() for _ in range(REPEATS))
        finally:
            stop.set()
            runner.join()

    decode(), recognize()  # warm-up
    out = {
        "llm_tok_s_alone": statistics.median(decode() for _ in range(REPEATS)),
        "asr_pass_s_alone": statistics.median(recognize() for _ in range(REPEATS)),
    }
    out["llm_tok_s_beside_asr"] = beside(decode, recognize)
    out["asr_pass_s_beside_llm"] = beside(recognize, decode)
    out["clip"] = clip.path.name
    return out


def run(data: Path | None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, (ct2_first, env, llm_threads, take_turns) in SETUPS.items():
        print(f"{name} ...", flush=True)
        child_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        cmd = [
            sys.executable,
            "-m",
            "duplexd.bench.threads",
            "--child",
            "--ct2-first" if ct2_first else "--torch-first",
            "--llm-threads",
            str(llm_threads),
            *(["--take-turns"] if take_turns else []),
        ]
        if data is not None:
            cmd += ["--data", str(data)]
        done = subprocess.run(cmd, env=child_env | env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"setup {name} failed: {done.stderr.strip().splitlines()[-1:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        r["llm_slowdown_beside_asr"] = r["llm_tok_s_alone"] / r["llm_tok_s_beside_asr"]
        r["asr_slowdown_beside_llm"] = r["asr_pass_s_beside_llm"] / r["asr_pass_s_alone"]
        results[name] = {
            "ct2_first": ct2_first,
            "env": env,
            "llm_threads": llm_threads or os.cpu_count(),
            "take_turns": take_turns,
            **r,
        }
        print(f"  {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})}", flush=True)
    return {
        "benchmark": "threads",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "sessions": SESSIONS,
        "setups": results,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"| setup | decode tok/s ({result['sessions']} replies) alone | beside ASR passes | ASR pass alone | "
        "beside decoding |",
        "|---|---|---|---|---|",
    ]
    for name, r in result["setups"].items():
        lines.append(
            f"| {name} | {r['llm_tok_s_alone']:.1f} | {r['llm_tok_s_beside_asr']:.1f} "
            f"(/{r['llm_slowdown_beside_asr']:.2f}) | {r['asr_pass_s_alone']:.3f} s | "
            f"{r['asr_pass_s_beside_llm']:.3f} s (x{r['asr_slowdown_beside_llm']:.2f}) |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args.data)
    write_result(args.out, result, table(result))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one setup of `duplexd bench threads` (a child process)")
    parser.add_argument("--child", action="store_true", required=True)
    parser.add_argument("--ct2-first", dest="ct2_first", action="store_true")
    parser.add_argument("--torch-first", dest="ct2_first", action="store_false")
    parser.add_argument("--llm-threads", type=int, default=0)
    parser.add_argument("--take-turns", action="store_true")
    parser.add_argument("--data", default=None)
    a = parser.parse_args()
    print(json.dumps(_child(a.ct2_first, a.llm_threads, a.take_turns, a.data)))
