"""Conversation scenarios composed from the real recordings of the speech set: a question, a pause in
mid-sentence, talking over the reply, a backchannel during it, the reply's own echo in the microphone.

Composition only: concatenation, inserted silence, a gain, and speech injected at a chosen moment of the
reply (`converse_pcm(inject=...)`); never synthesized voices. Audio is int16 mono at RATE. The basics
(`RATE`, `load`, `silence`, `speech_end_s`) live in `clients.clips` and are re-exported here, so that a
scenario reads in one vocabulary: `sc.load(...)`, `sc.silence(0.5)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duplexd.clients.clips import RATE, load, silence
from duplexd.clients.clips import speech_end_s as speech_end_s
from duplexd.clients.converse import ConversationResult
from duplexd.config import ServerConfig, TtsConfig

# Word boundaries found by Whisper word timestamps on these files (see test_scenarios for the check).
PAUSE_CLIP = "clip16_sb_example1.wav"  # "The birch canoe slid on the | smooth planks."
PAUSE_AT_S = (2.18, 2.36)  # the quietest 10 ms in here is where the pause goes
BACKCHANNEL_CLIP = "clip23_ami_meeting_30s.wav"  # a meeting: someone says "Okay, okay." alone
BACKCHANNEL_SPAN_S = (8.2, 9.4)
BACKCHANNEL_GAIN = 3.0  # a quiet far-field speaker in the meeting; brought to talking level


def quietest_cut(audio: np.ndarray, lo_s: float, hi_s: float, window_s: float = 0.01) -> int:
    """Sample index of the quietest `window_s` stretch between `lo_s` and `hi_s` (a word boundary)."""
    w = round(window_s * RATE)
    lo, hi = round(lo_s * RATE), round(hi_s * RATE)
    energy = [float(np.square(audio[i : i + w].astype(np.float64)).sum()) for i in range(lo, hi - w, w // 2)]
    return lo + int(np.argmin(energy)) * (w // 2) + w // 2


def with_pause(audio: np.ndarray, lo_s: float, hi_s: float, pause_s: float) -> tuple[np.ndarray, float]:
    """`audio` with `pause_s` of silence inserted at its quietest point in [lo_s, hi_s]; returns the audio
    and the time the speech resumes."""
    cut = quietest_cut(audio, lo_s, hi_s)
    out = np.concatenate([audio[:cut], silence(pause_s), audio[cut:]])
    return out, cut / RATE + pause_s


def backchannel(speech_dir: Path) -> np.ndarray:
    a, b = BACKCHANNEL_SPAN_S
    audio = load(speech_dir / BACKCHANNEL_CLIP)[round(a * RATE) : round(b * RATE)].astype(np.float32)
    return np.clip(audio * BACKCHANNEL_GAIN, -32767, 32767).astype(np.int16)


@dataclass(slots=True)
class During:
    """Say `audio` once, `after_s` after the first audio of the reply arrived (an `inject` callback)."""

    audio: np.ndarray
    after_s: float
    said_at: float | None = None  # monotonic time it started

    def __call__(self, result: ConversationResult) -> np.ndarray | None:
        import time

        if self.said_at is not None or not result.audio:
            return None
        if time.monotonic() - result.audio[0].t < self.after_s:
            return None
        self.said_at = time.monotonic()
        return self.audio


Inject = Callable[[ConversationResult], np.ndarray | None]


STORYTELLER_PROMPT = "You are a storyteller. Answer every message with a long story of at least six sentences."


def storyteller(max_reply_tokens: int = 120, speed: float = 0.5) -> ServerConfig:
    """A server configuration whose replies are long and slowly spoken (long enough to talk over, to cut a
    connection in, or to drain): SmolLM2-135M often just repeats a statement back, so ask for stories, and
    let them run past the voice default of two sentences."""
    return ServerConfig(
        dialog=dataclasses.replace(
            ServerConfig().dialog,
            system_prompt=STORYTELLER_PROMPT,
            max_reply_tokens=max_reply_tokens,
            max_reply_sentences=0,
        ),
        tts=TtsConfig(speed=speed),
    )
