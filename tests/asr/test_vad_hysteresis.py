"""VadHysteresis: per-chunk speech probabilities -> speech start/stop events (32 ms chunks)."""

from __future__ import annotations

import pytest

from duplexd.asr.vad import VAD_CHUNK_S, VadHysteresis
from duplexd.config import VadConfig
from duplexd.events import SpeechStarted, SpeechStopped

C = 0.032  # chunk length in seconds; chunk i covers [i*C, (i+1)*C)
S = 0.9  # speech
Q = 0.1  # quiet (below neg_threshold 0.35)
M = 0.4  # between neg_threshold and threshold


def run(probs: list[float], **config: float) -> list[tuple[int, str, float]]:
    """(chunk index, 'start'|'stop', reported time) for every event the probabilities cause."""
    vad = VadHysteresis(VadConfig(**config))
    out = []
    for i, p in enumerate(probs):
        event = vad.push(p, i * VAD_CHUNK_S)
        if isinstance(event, SpeechStarted):
            out.append((i, "start", event.t_s))
        elif isinstance(event, SpeechStopped):
            out.append((i, "stop", event.t_s))
        else:
            assert event is None
    return out


def test_chunk_is_32_ms() -> None:
    assert VAD_CHUNK_S == C


# Defaults: threshold 0.5, neg_threshold 0.35, min_speech_ms 64 (2 chunks), min_silence_ms 500 (16 chunks),
# speech_pad_ms 200.
CASES = [
    pytest.param([Q] * 40, {}, [], id="silence-only"),
    pytest.param([Q] * 5 + [S] + [Q] * 20, {}, [], id="one-chunk-blip-rejected"),
    pytest.param([Q] * 10 + [S, S], {}, [(11, "start", 10 * C - 0.2)], id="two-chunks-start-padded-back"),
    pytest.param([Q] * 10 + [0.5, 0.5], {}, [(11, "start", 10 * C - 0.2)], id="threshold-itself-is-speech"),
    pytest.param([Q] * 10 + [0.49] * 20, {}, [], id="just-below-threshold-never-starts"),
    pytest.param(
        [Q] * 10 + [S, Q, S, S],
        {},
        [(13, "start", 12 * C - 0.2)],
        id="interrupted-blip-restarts-the-run",
    ),
    pytest.param([S, M, S, M, S, M], {}, [], id="between-thresholds-breaks-a-speech-run"),
    pytest.param([S, S], {}, [(1, "start", 0.0)], id="pad-not-below-zero"),
    pytest.param([Q] * 3 + [S, S], {}, [(4, "start", 0.0)], id="pad-clipped-at-zero"),
    pytest.param(
        [Q] * 20 + [S, S] + [Q] + [S] * 3,
        {"min_speech_ms": 96},
        [(25, "start", 23 * C - 0.2)],
        id="min-speech-96ms-needs-three-chunks",
    ),
    pytest.param([Q, S], {"min_speech_ms": 0}, [(1, "start", 0.0)], id="min-speech-zero-starts-at-once"),
    pytest.param(
        [Q] * 10 + [S] * 10 + [Q] * 15,
        {},
        [(11, "start", 10 * C - 0.2)],
        id="15-quiet-chunks-are-not-enough",
    ),
    pytest.param(
        [Q] * 10 + [S] * 10 + [Q] * 16,
        {},
        [(11, "start", 10 * C - 0.2), (35, "stop", 20 * C + 0.2)],
        id="16-quiet-chunks-stop-padded-forward",
    ),
    pytest.param(
        [S] * 10 + [M] * 40,
        {},
        [(1, "start", 0.0)],
        id="between-thresholds-never-starts-a-silence",
    ),
    pytest.param(
        [S] * 10 + [M] * 30 + [Q] * 16,
        {},
        [(1, "start", 0.0), (55, "stop", 40 * C + 0.2)],
        id="silence-counts-from-the-first-quiet-chunk",
    ),
    pytest.param(
        [S] * 10 + [Q] * 8 + [M] * 4 + [Q] * 4,
        {},
        [(1, "start", 0.0), (25, "stop", 10 * C + 0.2)],
        id="between-thresholds-does-not-end-a-silence",
    ),
    pytest.param(
        [S] * 10 + [Q] * 8 + [M] * 8,
        {},
        [(1, "start", 0.0)],
        id="silence-needs-a-quiet-chunk-to-end-speech",
    ),
    pytest.param(
        [S] * 10 + [Q] * 8 + [S] + [Q] * 15,
        {},
        [(1, "start", 0.0)],
        id="speech-chunk-resets-the-silence",
    ),
    pytest.param(
        [S] * 10 + [Q] * 8 + [S] + [Q] * 16,
        {},
        [(1, "start", 0.0), (34, "stop", 19 * C + 0.2)],
        id="silence-after-reset-counts-again",
    ),
    pytest.param(
        [S] * 10 + [Q] * 16,
        {"speech_pad_ms": 600},
        [(1, "start", 0.0), (25, "stop", 26 * C)],
        id="stop-pad-capped-at-chunk-end",
    ),
    pytest.param(
        [S] * 5 + [Q] * 16 + [S, S],
        {"speech_pad_ms": 400},
        [(1, "start", 0.0), (20, "stop", 5 * C + 0.4), (22, "start", 5 * C + 0.4)],
        id="start-not-before-last-stop",
    ),
    pytest.param(
        [S] * 5 + [Q] * 16 + [Q] * 20 + [S, S],
        {"speech_pad_ms": 400},
        [(1, "start", 0.0), (20, "stop", 5 * C + 0.4), (42, "start", 41 * C - 0.4)],
        id="second-start-padded-normally-after-long-silence",
    ),
    pytest.param(
        [S, S, Q],
        {"min_silence_ms": 32},
        [(1, "start", 0.0), (2, "stop", 3 * C)],
        id="min-silence-one-chunk",
    ),
    pytest.param(
        [0.7] * 5 + [S] * 3 + [0.79] * 16,
        {"threshold": 0.8, "neg_threshold": 0.8},
        [(6, "start", 0.0), (23, "stop", 8 * C + 0.2)],
        id="equal-thresholds",
    ),
    pytest.param(
        [Q] * 10 + [S] * 10 + [Q] * 20 + [S] * 10 + [Q] * 16,
        {"speech_pad_ms": 0},
        [(11, "start", 10 * C), (35, "stop", 20 * C), (41, "start", 40 * C), (65, "stop", 50 * C)],
        id="two-utterances-unpadded",
    ),
]


@pytest.mark.parametrize(("probs", "config", "expected"), CASES)
def test_hysteresis(probs: list[float], config: dict[str, float], expected: list[tuple[int, str, float]]) -> None:
    got = run(probs, **config)
    assert [(i, kind) for i, kind, _ in got] == [(i, kind) for i, kind, _ in expected]
    for (_, _, t), (_, _, want) in zip(got, expected, strict=True):
        assert t == pytest.approx(want, abs=1e-9)


def test_speaking_follows_the_events() -> None:
    vad = VadHysteresis(VadConfig())
    states = []
    for i, p in enumerate([Q, S, S, S] + [Q] * 16 + [S]):
        vad.push(p, i * C)
        states.append(vad.speaking)
    assert states == [False, False] + [True] * 17 + [False, False]
