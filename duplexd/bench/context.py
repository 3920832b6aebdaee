"""`duplexd bench context`: what a rebuilt LLM context costs (a Realtime client's delete, insert, older
truncate, or a response's own instructions), against the reply it delays, on the embedded dialog model.

One conversation lives through `TURNS` question-and-reply turns. After 1, 2, 4 and 8 turns (the context
growing), each point measures in the same run, on the same engine:

- `next_turn_s`: the next question appended and answered as usual (the KV grows in place): from the turn's
  end to the first reply token;
- `rebuilt_s`: the same, on a second session whose context was rewritten from the turns just before the
  question (`DialogEngine.rewrite`: everything prefilled again), from the rewrite to the first reply token;

and checks that both replies are the same tokens (a rebuilt context is the conversation it describes).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from duplexd.bench.llm import machine_info
from duplexd.dialog.engine import DialogEngine, EngineConfig, Priority

QUESTIONS = [
    "What is the tallest mountain on Earth?",
    "How do bees make honey?",
    "Why do leaves change colour in autumn?",
    "What makes the ocean salty?",
    "How far away is the Moon?",
    "Why do cats purr?",
    "What is a rainbow made of?",
    "How do airplanes stay in the air?",
    "What do whales eat?",
]
POINTS = (1, 2, 4, 8)  # turns lived before the measured one
REPEATS = 3


def _first_token_s(engine: DialogEngine, sid: int) -> float:
    """Step until `sid` has its first reply token (it was started); seconds taken."""
    t0 = time.perf_counter()
    while not engine.reply_tokens(sid):
        engine.step()
    return time.perf_counter() - t0


def _finish(engine: DialogEngine) -> None:
    while engine.busy():
        engine.step()


def measure(engine: DialogEngine) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    lived = engine.open()
    turns: list[tuple[str, str]] = []
    for n, question in enumerate(QUESTIONS[: max(POINTS) + 1]):
        if n in POINTS:
            live_s, rebuilt_s, same = [], [], True
            for _ in range(REPEATS):
                copy = engine.fork(lived, priority=Priority.NORMAL)
                engine.append_user_text(copy, question)
                engine.start_reply(copy)
                live_s.append(_first_token_s(engine, copy))
                other = engine.open()
                _finish(engine)
                t0 = time.perf_counter()
                engine.rewrite(other, None, turns, open_user=question)
                engine.start_reply(other)
                _first_token_s(engine, other)
                rebuilt_s.append(time.perf_counter() - t0)
                _finish(engine)
                same = same and engine.reply_tokens(other) == engine.reply_tokens(copy)
                engine.close(copy)
                engine.close(other)
            rows.append(
                {
                    "turns": n,
                    "context_tokens": engine.tokens_seen(lived),
                    "next_turn_s": round(min(live_s), 4),
                    "rebuilt_s": round(min(rebuilt_s), 4),
                    "ratio": round(min(rebuilt_s) / min(live_s), 2),
                    "same_reply": same,
                }
            )
        engine.append_user_text(lived, question)
        engine.start_reply(lived)
        _finish(engine)
        turns += [("user", question), ("assistant", engine.tokenizer.decode(engine.reply_tokens(lived)))]
    engine.close(lived)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| turns before | context tokens | next turn → 1st token (s) | rebuilt → 1st token (s) | ratio | same reply |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['turns']} | {r['context_tokens']} | {r['next_turn_s']:.3f} | {r['rebuilt_s']:.3f} | "
            f"{r['ratio']:.1f}x | {'yes' if r['same_reply'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    engine = DialogEngine.load(EngineConfig(threads=2))
    rows = measure(engine)
    out = {"machine": machine_info(), "model": engine.config.model, "repeats": REPEATS, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(table(rows))
    return 0
