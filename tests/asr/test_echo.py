"""Echo cancellation: the real AEC3 on real speech, and the far end the server builds from its output stream."""

from __future__ import annotations

import numpy as np
import pytest

from duplexd.asr.echo import BLOCK_SAMPLES, DELAY_SAMPLES, EchoCanceller, EchoLevels, FarEnd
from duplexd.bench import room
from duplexd.clients.clips import Clip, load

RATE = 16_000


def speech(clip: Clip, seconds: float) -> np.ndarray:
    x = load(clip.path).astype(np.float32) / 32768.0
    return np.tile(x, int(seconds * RATE) // len(x) + 1)[: int(seconds * RATE)]


def energy_db(x: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(x.astype(np.float64) ** 2) + 1e-12))


def run(canceller: EchoCanceller, mic: np.ndarray, far: np.ndarray, chunk: int) -> np.ndarray:
    parts = [canceller.process(mic[i : i + chunk], far[i : i + chunk]) for i in range(0, len(mic), chunk)]
    return np.concatenate(parts)


def test_the_reply_echo_through_a_room_is_cancelled_and_the_user_still_heard(clip_by_name: dict[str, Clip]) -> None:
    far = speech(clip_by_name["clip24_lecture_60s.wav"], 8.0)
    user = speech(clip_by_name["clip16_sb_example1.wav"], 2.0)
    spec = room.RoomSpec(rt60_s=0.3, delay_ms=80, gain=1.0, seed=3, drift_ms=0.0)
    path = room.EchoPath(spec)
    echo = np.concatenate([path(far[i : i + 512]) for i in range(0, len(far), 512)])
    out = run(EchoCanceller(replace_audio=True), echo, far, 512)
    assert len(out) == len(echo)
    tail = slice(3 * RATE, 6 * RATE)  # (converged; before the user speaks)
    assert energy_db(echo[tail]) - energy_db(out[tail]) > 15  # ERLE
    # Echo alone, once converged, is echo only to VAD; the user talking over it (6 dB above it) is not.
    canceller = EchoCanceller()  # (gate: the audio passes as heard; the flags say what was echo only)
    talk = echo.copy()
    level = 2 * 10 ** ((energy_db(echo[5 * RATE : 7 * RATE]) - energy_db(user)) / 20)  # (+6 dB: nearer the mic)
    talk[5 * RATE : 7 * RATE] += level * user
    rows = lambda x: x[: len(x) // 512 * 512].reshape(-1, 512)  # noqa: E731
    flags = []
    for i in range(0, len(talk), 512):
        heard = talk[i : i + 512]
        assert np.array_equal(canceller.process(heard, far[i : i + 512]), canceller.heard)
        flags.append(canceller.echo_only(rows(far[i : i + 512]))[0])
    flags = np.array(flags)
    per_s = RATE // 512
    assert flags[3 * per_s : 5 * per_s].mean() > 0.8
    # (the user's voiced chunks: no more than 6 dB below their mean level)
    chunk_db = [energy_db(user[k * 512 - 5 * RATE :][:512]) - 10 * np.log10(512) for k in range(5 * per_s, 7 * per_s)]
    mean_db = energy_db(user) - 10 * np.log10(len(user))
    voiced = [5 * per_s + i for i, e in enumerate(chunk_db) if e > mean_db - 6]
    assert len(voiced) > 20 and flags[voiced].mean() < 0.25, flags[voiced]
    # Far end silent: the user's speech passes (delayed by one block, high-passed, its level kept).
    quiet = run(EchoCanceller(replace_audio=True), user, np.zeros_like(user), 512)
    assert abs(energy_db(quiet[DELAY_SAMPLES:]) - energy_db(user[: len(user) - DELAY_SAMPLES])) < 2.0


def test_a_span_of_echo_loses_most_of_its_energy_to_the_canceller_and_a_user_over_it_little(
    clip_by_name: dict[str, Clip],
) -> None:
    """The evidence a word heard over the reply is its echo: how much the canceller took out of its span."""
    far = speech(clip_by_name["clip24_lecture_60s.wav"], 8.0)
    user = speech(clip_by_name["clip16_sb_example1.wav"], 2.0)
    path = room.EchoPath(room.RoomSpec(rt60_s=0.4, delay_ms=120, gain=0.5, seed=2, drift_ms=3.0))
    echo = np.concatenate([path(far[i : i + 512]) for i in range(0, len(far), 512)])
    talk = echo.copy()
    talk[5 * RATE : 7 * RATE] += user * 10 ** ((energy_db(echo[5 * RATE : 7 * RATE]) - energy_db(user)) / 20)  # (0 dB)
    canceller, levels = EchoCanceller(), EchoLevels(512 / RATE, max_s=10.0)
    levels.extend(None, 3)  # (chunks before the canceller ran: no record, and the timeline still counts them)
    for i in range(0, len(talk), 512):
        canceller.process(talk[i : i + 512], far[i : i + 512])
        canceller.echo_only(far[i : i + 512].reshape(1, -1))
        levels.extend(canceller.levels, 1)
    t0 = 3 * 512 / RATE
    assert levels.attenuation_db(0.0, t0) is None  # (no canceller there)
    echo_db = levels.attenuation_db(t0 + 3.0, t0 + 4.5)  # (converged, the echo alone)
    user_db = levels.attenuation_db(t0 + 5.0, t0 + 7.0)  # (the user talking over it as loud as it)
    assert echo_db is not None and user_db is not None
    assert echo_db > 15 and user_db < 8, (echo_db, user_db)  # (measured: 38 and 5.4 dB)
    # Bounded: only the last 10 s are kept, a span older than that is not known.
    levels.extend(canceller.levels, int(10 * RATE / 512))
    assert levels.attenuation_db(t0 + 3.0, t0 + 4.5) is None


def test_the_output_does_not_depend_on_how_the_audio_was_chunked(clip_by_name: dict[str, Clip]) -> None:
    far = speech(clip_by_name["clip24_lecture_60s.wav"], 2.0)
    mic = 0.5 * np.roll(far, 800) + speech(clip_by_name["clip16_sb_example1.wav"], 2.0)
    a = run(EchoCanceller(replace_audio=True), mic, far, 512)
    b = run(EchoCanceller(replace_audio=True), mic, far, 333)  # (not a multiple of the 10 ms block)
    assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="far end"):
        EchoCanceller().process(mic[:512], far[:100])
    assert BLOCK_SAMPLES == 160


def test_the_far_end_is_what_was_played_on_one_steady_timeline() -> None:
    far = FarEnd(24_000, max_s=1.0, tolerance_ms=40)
    ramp = np.arange(48_000) / 48_000  # output sample k reads k / 48000: positions can be read back
    pcm = (ramp * 32767).astype("<i2")
    assert not far.take(768, 512).any()  # nothing sent yet: silence
    for i in range(0, 24_000, 480):  # half a second sent, 20 ms frames
        far.sent(pcm[i : i + 480].tobytes())
    # Played in real time, reported with +-20 ms of jitter: one offset throughout, no jumps.
    refs = []
    for k, jitter in enumerate([0, 480, -480, 240, -240, 0, 480]):
        refs.append(far.take((k + 2) * 768 + jitter, 512))
    assert far.anchors == 1
    ref = np.concatenate(refs)[100:-100]
    positions = ref * 48_000 * 2 / 3  # (16 kHz samples)
    fit = np.polyval(np.polyfit(np.arange(len(positions)), positions, 1), np.arange(len(positions)))
    assert np.abs(positions - fit).max() < 3  # one straight timeline (a jittered one jumps by ~320 samples)
    assert abs((positions[-1] - positions[0]) / (len(positions) - 1) - 1) < 0.01  # one sample per sample
    # A stopped reply: the client jumps ahead, further than the tolerance: the offset is set again there.
    far.skip(20_000)
    jumped = far.take(20_000, 512)
    assert far.anchors == 2
    lead = 0.060 * 24_000  # (the reference runs 60 ms ahead of the reported playback: never behind its echo)
    assert abs(jumped[-100] * 48_000 - (20_000 - 100 * 1.5 + lead)) < 30
    # Bounded: a second of sent audio kept at most, however much goes out unplayed.
    for _ in range(200):
        far.sent(pcm[:480].tobytes())
    assert len(far._audio) <= 24_000


def test_the_bench_room_delays_reverberates_and_sets_the_echo_level(clip_by_name: dict[str, Clip]) -> None:
    far = speech(clip_by_name["clip24_lecture_60s.wav"], 4.0)
    spec = room.RoomSpec(rt60_s=0.4, delay_ms=120, gain=0.5, seed=1)
    a, b = room.EchoPath(spec), room.EchoPath(spec)
    echo = np.concatenate([a(far[i : i + 320]) for i in range(0, len(far), 320)])
    assert np.array_equal(echo, np.concatenate([b(far[i : i + 4000]) for i in range(0, len(far), 4000)]))
    assert abs((energy_db(echo) - energy_db(far)) - (-6.0)) < 2.0  # -6 dB, within the clipping's change
    lags = [float(np.dot(echo[4000:-4000], far[4000 - k : len(far) - 4000 - k])) for k in range(0, 4000, 16)]
    lag_ms = 16 * int(np.argmax(lags)) / RATE * 1000
    assert 110 <= lag_ms <= 140  # the playback delay (+ the direct path's few ms; the drift is slow)
    assert not np.any(echo[: int(0.1 * RATE)])  # nothing reaches the microphone before the delay


def test_with_no_echo_the_microphone_passes_as_heard(clip_by_name: dict[str, Clip]) -> None:
    """Headphones, or a client that cancels its own echo: AEC3 would only take the user out while the reply
    plays, so the audio passes untouched; the canceller still says when an echo appears."""
    far = speech(clip_by_name["clip24_lecture_60s.wav"], 8.0)
    user = 3e-4 * np.random.default_rng(0).standard_normal(len(far)).astype(np.float32)  # (a quiet room)
    user[4 * RATE : 6 * RATE] += speech(clip_by_name["clip16_sb_example1.wav"], 2.0)
    canceller = EchoCanceller(replace_audio=True)
    out = run(canceller, user, far, 512)
    assert not canceller.echo_heard
    assert np.array_equal(out[DELAY_SAMPLES:], user[: len(user) - DELAY_SAMPLES])
    path = room.EchoPath(room.RoomSpec(rt60_s=0.3, delay_ms=120, gain=0.5, seed=4))
    echo = np.concatenate([path(far[i : i + 512]) for i in range(0, len(far), 512)])
    heard = EchoCanceller(replace_audio=True)
    assert not np.array_equal(run(heard, echo + user, far, 512)[DELAY_SAMPLES:], (echo + user)[:-DELAY_SAMPLES])
    assert heard.echo_heard
