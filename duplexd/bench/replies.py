"""`duplexd bench replies`: do the dialog engine's replies suit a voice product (issue 17)?

Every shared clip's reference transcript (as if the recognizer got it right) and 20 typed questions are
each one user turn of a fresh conversation with the configured system prompt and reply limits, replied to
by the configured engine (`[dialog]`, `--config` or `DUPLEXD_DIALOG__*`). Conversations run
`BATCH` at a time in one engine (greedy and batch-invariant: the replies are what each gets alone).

Per reply, on its words (`bench.data.normalize`):
- loop: some word 3-gram occurs 3 or more times, or the reply hit the token cap mid-repetition (its last
  3-gram occurred earlier in it);
- parrot: at least 60 % of its words are the user's (each user word counted as often as the user said it);
- words: how many.
Targets (issue 17): `loop_rate` 0, `parrot_rate` <= 0.10, `words_p90` <= 40.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from duplexd.bench import write_result
from duplexd.bench.data import load_clips, normalize
from duplexd.bench.latency import percentile
from duplexd.bench.llm import machine_info
from duplexd.config import load_config
from duplexd.dialog.engine import DialogEngine, EngineConfig

BATCH = 8  # conversations decoded together (KV slots held at once)
PARROT_SHARE = 0.6
LOOP_COUNT = 3  # a word 3-gram this many times is a loop
TARGETS = {"loop_rate": 0.0, "parrot_rate": 0.10, "words_p90": 40}

QUESTIONS = [
    "What is the capital of France?",
    "How are you today?",
    "Can you tell me a joke?",
    "What's the weather like on Mars?",
    "How do I boil an egg?",
    "Who wrote Romeo and Juliet?",
    "What time is it?",
    "Why is the sky blue?",
    "Can you recommend a good book?",
    "What is two plus two?",
    "Tell me something interesting about octopuses.",
    "How far away is the moon?",
    "What should I cook for dinner tonight?",
    "Do you like music?",
    "How do I say thank you in Spanish?",
    "What's the best way to learn to code?",
    "I'm feeling a bit tired today.",
    "Remind me to call my mother tomorrow.",
    "What is photosynthesis?",
    "Thanks, that's all for now.",
]


@dataclass(frozen=True, slots=True)
class Turn:
    source: str  # a clip's file name, or "typed"
    text: str


@dataclass(frozen=True, slots=True)
class Reply:
    source: str
    user: str
    reply: str
    tokens: int
    words: int
    hit_cap: bool
    loop: bool
    parrot_share: float
    parrot: bool


def turns(data: Path | None, quick: bool) -> list[Turn]:
    """Every clip with a reference transcript, then the typed questions (`quick`: four of each)."""
    clips = [Turn(c.path.name, c.text) for c in load_clips(data) if c.text]
    typed = [Turn("typed", q) for q in QUESTIONS]
    return clips[:4] + typed[:4] if quick else clips + typed


def loops(words: Sequence[str], hit_cap: bool) -> bool:
    """A word 3-gram occurs `LOOP_COUNT` times, or the cap cut the reply while it repeated itself."""
    grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    counts = Counter(grams)
    if any(n >= LOOP_COUNT for n in counts.values()):
        return True
    return hit_cap and bool(grams) and counts[grams[-1]] > 1


def parrot_share(user: Sequence[str], reply: Sequence[str]) -> float:
    """The share of the reply's words that are the user's (a user word counts as often as it was said)."""
    if not reply:
        return 0.0
    left = Counter(user)
    shared = 0
    for word in reply:
        if left[word] > 0:
            left[word] -= 1
            shared += 1
    return shared / len(reply)


def score(turn: Turn, reply: str, tokens: int, cap: int) -> Reply:
    words = normalize(reply)
    share = parrot_share(normalize(turn.text), words)
    hit_cap = tokens >= cap
    return Reply(
        source=turn.source,
        user=turn.text,
        reply=reply,
        tokens=tokens,
        words=len(words),
        hit_cap=hit_cap,
        loop=loops(words, hit_cap),
        parrot_share=round(share, 3),
        parrot=share >= PARROT_SHARE,
    )


def reply_all(engine: DialogEngine, batch: Sequence[Turn]) -> list[tuple[str, int]]:
    """One fresh conversation per turn, all decoded together: (reply text, reply tokens) per turn."""
    sids = [engine.open() for _ in batch]
    for sid, turn in zip(sids, batch, strict=True):
        engine.append_user_text(sid, turn.text)
        engine.start_reply(sid)
    while any(engine.replying(sid) for sid in sids):
        engine.step()
    out = []
    for sid in sids:
        tokens = engine.reply_tokens(sid)
        out.append((engine.tokenizer.decode(tokens, skip_special_tokens=True).strip(), len(tokens)))
        engine.close(sid)
    return out


def summary(replies: Sequence[Reply]) -> dict[str, Any]:
    n = max(len(replies), 1)
    words = [float(r.words) for r in replies]
    result: dict[str, Any] = {
        "replies": len(replies),
        "loop_rate": round(sum(r.loop for r in replies) / n, 3),
        "parrot_rate": round(sum(r.parrot for r in replies) / n, 3),
        "words_p50": _round(percentile(words, 50)),
        "words_p90": _round(percentile(words, 90)),
        "cap_rate": round(sum(r.hit_cap for r in replies) / n, 3),
        "empty": sum(r.words == 0 for r in replies),
    }
    result["meets_targets"] = (
        result["loop_rate"] <= TARGETS["loop_rate"]
        and result["parrot_rate"] <= TARGETS["parrot_rate"]
        and result["words_p90"] is not None
        and result["words_p90"] <= TARGETS["words_p90"]
    )
    return result


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def run(data: Path | None, config_path: Path | None, quick: bool) -> dict[str, Any]:
    dialog = load_config(config_path).dialog
    todo = turns(data, quick)
    engine_config = replace(EngineConfig.from_config(dialog), max_sessions=min(BATCH, len(todo)))
    engine = DialogEngine.load(engine_config)
    t0 = time.perf_counter()
    replies: list[Reply] = []
    for at in range(0, len(todo), BATCH):
        batch = todo[at : at + BATCH]
        for turn, (text, tokens) in zip(batch, reply_all(engine, batch), strict=True):
            replies.append(score(turn, text, tokens, engine_config.max_reply_tokens))
    return {
        "machine": machine_info(),
        "config": {k: v for k, v in asdict(engine_config).items() if k not in ("window", "max_sessions")},
        "seconds": round(time.perf_counter() - t0, 1),
        "targets": TARGETS,
        **summary(replies),
        "clips": summary([r for r in replies if r.source != "typed"]),
        "typed": summary([r for r in replies if r.source == "typed"]),
        "runs": [asdict(r) for r in replies],
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| turns | replies | loop_rate | parrot_rate | words p50 | words p90 | at the token cap |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in (("all", result), ("clip transcripts", result["clips"]), ("typed", result["typed"])):
        lines.append(
            f"| {name} | {s['replies']} | {s['loop_rate']} | {s['parrot_rate']} | {s['words_p50']} | "
            f"{s['words_p90']} | {s['cap_rate']} |"
        )
    lines.append(f"targets {result['targets']}: {'met' if result['meets_targets'] else 'NOT met'}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args.data, args.config, args.quick)
    write_result(args.out, result, table(result))
    return 0
