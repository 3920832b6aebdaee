"""Conversation scenarios composed from the real recordings of the speech set: a question, a pause in
mid-sentence, talking over the reply, a backchannel during it, the reply's own echo in the microphone.

Composition only: concatenation, inserted silence, a gain, and speech injected at a chosen moment of the
reply (`converse_pcm(inject=...)`); never synthesized voices. The synthesized sounds are `noises()`: a
cough-like burst, a clatter, a throat clearing, no words in them (the set has no recording of them).
Audio is int16 mono at RATE. The basics
(`RATE`, `load`, `silence`, `speech_end_s`) live in `clients.clips` and are re-exported here, so that a
scenario reads in one vocabulary: `sc.load(...)`, `sc.silence(0.5)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duplexd.asr.vad import VAD_CHUNK_S
from duplexd.clients.clips import RATE, load, silence, silence_around
from duplexd.clients.clips import speech_end_s as speech_end_s
from duplexd.clients.clips import speech_start_s as speech_start_s
from duplexd.clients.converse import ConversationResult
from duplexd.config import ServerConfig, TtsConfig

# Word boundaries found by Whisper word timestamps on these files (see test_scenarios for the check).
PAUSE_CLIP = "clip16_sb_example1.wav"  # "The birch canoe slid on the | smooth planks."
PAUSE_AT_S = (2.18, 2.36)  # the quietest 10 ms in here is where the pause goes
RESUMES_S = 0.3  # a mid-sentence point has at least this much speech after it
BACKCHANNEL_CLIP = "clip23_ami_meeting_30s.wav"  # a meeting: someone says "Okay, okay." alone
BACKCHANNEL_SPAN_S = (8.2, 9.4)
BACKCHANNEL_GAIN = 3.0  # a quiet far-field speaker in the meeting; brought to talking level


def quietest_cut(audio: np.ndarray, lo_s: float, hi_s: float, window_s: float = 0.01) -> int:
    """Sample index of the quietest `window_s` stretch between `lo_s` and `hi_s` (a word boundary)."""
    w = round(window_s * RATE)
    lo, hi = round(lo_s * RATE), round(hi_s * RATE)
    energy = [float(np.square(audio[i : i + w].astype(np.float64)).sum()) for i in range(lo, hi - w, w // 2)]
    return lo + int(np.argmin(energy)) * (w // 2) + w // 2


def mid_speech_cut(audio: np.ndarray, lo_s: float, hi_s: float) -> int | None:
    """`quietest_cut` in [lo_s, hi_s] where the speech goes on after it (at least `RESUMES_S` of it): a
    point mid-sentence. None where the speech is over by then (a clip with its silence in that span)."""
    cut = quietest_cut(audio, lo_s, hi_s)
    return cut if speech_end_s(audio) - cut / RATE >= RESUMES_S else None


def with_pause(
    audio: np.ndarray, lo_s: float, hi_s: float, pause_s: float, lead_s: float = 0.0
) -> tuple[np.ndarray, float]:
    """`audio` with a pause of `pause_s` at its quietest point in [lo_s, hi_s], as Silero VAD hears it from
    the last word to the next: the silence inserted there is `pause_s` less the gap VAD already hears
    around that point (0.1-0.25 s at some of the question clips' word boundaries), and less the time VAD
    then takes to hear a soft onset after it ("... a new | home": up to 0.2 s, by where its 32 ms chunks
    fall: `lead_s`, the silence that will be sent before `audio`, places them). Returns the audio and the
    time VAD hears the speech resume."""
    cut = quietest_cut(audio, lo_s, hi_s)
    lead = silence(lead_s)

    def heard(out: np.ndarray, at: int) -> tuple[float, float]:
        """The silence VAD hears around `at` in `out` sent after the lead: its length, and where it ends."""
        before, after = silence_around(np.concatenate([lead, out]), len(lead) + at)
        return before + after, at / RATE + after

    inserted = max(0.0, pause_s - heard(audio, cut)[0])
    tried: list[tuple[float, np.ndarray, float]] = []  # (|heard - pause_s|, audio, resumes)
    for _ in range(5):  # (the onset's delay varies with the silence before it: a few corrections, the closest)
        gap = silence(inserted)
        out = np.concatenate([audio[:cut], gap, audio[cut:]])
        length, resume_s = heard(out, cut + len(gap) // 2)
        tried.append((abs(length - pause_s), out, resume_s))
        if abs(length - pause_s) <= VAD_CHUNK_S or (inserted == 0 and length > pause_s):
            break
        inserted = max(0.0, inserted + pause_s - length)
    _, out, resume_s = min(tried, key=lambda t: t[0])
    return out, resume_s


def backchannel(speech_dir: Path) -> np.ndarray:
    a, b = BACKCHANNEL_SPAN_S
    audio = load(speech_dir / BACKCHANNEL_CLIP)[round(a * RATE) : round(b * RATE)].astype(np.float32)
    return np.clip(audio * BACKCHANNEL_GAIN, -32767, 32767).astype(np.int16)


def noises(seed: int = 7) -> dict[str, np.ndarray]:
    """Sounds that are not words, at talking level: `cough` (two bursts of band-limited noise, a sharp
    attack and a ~150 ms decay, 0.2 s apart), `clatter` (five knocks: decaying resonances at random
    pitches over 0.6 s) and `throat` (a throat clearing: 0.35 s of a voiced buzz, pitch falling 180 to
    110 Hz, through two vowel-like resonances, under breath noise). Deterministic for a seed."""
    rng = np.random.default_rng(seed)

    def burst(seconds: float, decay_s: float) -> np.ndarray:
        n = round(seconds * RATE)
        t = np.arange(n) / RATE
        noise = rng.standard_normal(n)
        spectrum = np.fft.rfft(noise)
        f = np.fft.rfftfreq(n, 1 / RATE)
        spectrum[(f < 300) | (f > 4000)] *= 0.1  # a cough's energy is mostly 0.3-4 kHz
        shaped = np.fft.irfft(spectrum, n)
        envelope = np.minimum(t / 0.015, 1.0) * np.exp(-t / decay_s)
        return shaped / np.abs(shaped).max() * envelope

    cough = np.concatenate([burst(0.3, 0.12), np.zeros(round(0.2 * RATE)), 0.7 * burst(0.25, 0.1)])
    clatter = np.zeros(round(0.6 * RATE))
    for start in sorted(rng.uniform(0.0, 0.5, 5)):
        t = np.arange(round(0.08 * RATE)) / RATE
        knock = np.sin(2 * np.pi * rng.uniform(400, 2500) * t) * np.exp(-t / 0.015)
        i = round(start * RATE)
        clatter[i : i + len(knock)] += knock[: len(clatter) - i]
    n = round(0.35 * RATE)
    t = np.arange(n) / RATE
    phase = 2 * np.pi * np.cumsum(np.linspace(180, 110, n)) / RATE
    buzz = sum(np.sin(k * phase) / k for k in range(1, 30))  # a sawtooth: a glottal source's harmonics
    spectrum, f = np.fft.rfft(buzz), np.fft.rfftfreq(n, 1 / RATE)
    resonance = sum(1 / (1 + ((f - fc) / bw) ** 2) for fc, bw in ((550, 90), (1400, 120)))
    voiced = np.fft.irfft(spectrum * resonance, n)
    throat = voiced / np.abs(voiced).max() + 0.15 * rng.standard_normal(n)
    throat *= np.minimum(t / 0.03, 1.0) * np.minimum((t[-1] - t) / 0.08, 1.0)
    level = 10 ** (-12 / 20)  # peaks at -12 dBFS: about as loud as the clips' speech
    return {
        name: (np.clip(x / np.abs(x).max() * level, -1, 1) * 32767).astype(np.int16)
        for name, x in (("cough", cough), ("clatter", clatter), ("throat", throat))
    }


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
