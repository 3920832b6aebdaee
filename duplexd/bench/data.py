"""The speech evaluation set (outside the repository) and the text metrics used on it."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

DATA_ENV = "DUPLEXD_TEST_DATA"

_PUNCT = re.compile(r"[^\w\s']")
_SPACES = re.compile(r"\s+")


def data_dir() -> Path:
    """The shared data folder: $DUPLEXD_TEST_DATA, else ../shared/data beside the checkout."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env)
    beside_checkout = Path(__file__).resolve().parents[3] / "shared" / "data"
    return beside_checkout if beside_checkout.is_dir() else Path.cwd().parent / "shared" / "data"


@dataclass(frozen=True, slots=True)
class Clip:
    path: Path
    duration_s: float
    text: str | None
    speakers: int | None


def load_clips(root: Path | None = None) -> list[Clip]:
    """Clips listed in speech/manifest.jsonl; raises FileNotFoundError when the set is absent."""
    speech = (root or data_dir()) / "speech"
    manifest = speech / "manifest.jsonl"
    clips = []
    with open(manifest, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                spk = row.get("speakers")
                clips.append(
                    Clip(
                        speech / row["file"],
                        float(row["duration_s"]),
                        row.get("text"),
                        spk if isinstance(spk, int) else None,
                    )
                )
    return clips


def normalize(text: str) -> list[str]:
    """Lowercase words without punctuation (hyphens split words): 'Mr. Quilter's' -> ['mr', "quilter's"]."""
    text = _PUNCT.sub(" ", text.lower().replace("-", " "))
    return [w.strip("'") for w in _SPACES.split(text) if w.strip("'")]


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    """Word-level Levenshtein distance (substitutions + deletions + insertions)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i]
        for j, h in enumerate(hyp, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h)))
        prev = cur
    return prev[-1]


def wer(refs: list[str], hyps: list[str]) -> float:
    """Corpus WER: total edits over total reference words, after `normalize`."""
    errors = words = 0
    for ref, hyp in zip(refs, hyps, strict=True):
        r = normalize(ref)
        errors += edit_distance(r, normalize(hyp))
        words += len(r)
    return errors / max(words, 1)
