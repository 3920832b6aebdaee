"""PCM16 conversion and frame-by-frame resampling to 16 kHz."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from duplexd.streaming.audio import TARGET_RATE, StreamResampler, float_to_pcm16, pcm16_to_float

LSB = 1 / 32768


@pytest.mark.parametrize(
    ("pcm", "expected"),
    [
        (b"", []),
        (b"\x00\x00", [0.0]),
        (b"\x01\x00", [LSB]),  # little-endian
        (b"\x00\x01", [256 * LSB]),
        (b"\xff\xff", [-LSB]),
        (b"\xff\x7f", [32767 * LSB]),
        (b"\x00\x80", [-1.0]),
        (b"\x00\x40\x00\xc0", [0.5, -0.5]),
    ],
)
def test_pcm16_to_float(pcm: bytes, expected: list[float]) -> None:
    out = pcm16_to_float(pcm)
    assert out.dtype == np.float32
    assert out.tolist() == expected


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([0.0], [0]),
        ([1.0], [32767]),
        ([-1.0], [-32768]),
        ([0.5, -0.5], [16384, -16384]),  # exact inverse of pcm16_to_float
        ([2.0, -3.0], [32767, -32768]),  # clipped, never wrapped
    ],
)
def test_float_to_pcm16(samples: list[float], expected: list[int]) -> None:
    pcm = float_to_pcm16(np.array(samples, np.float32))
    assert len(pcm) == 2 * len(samples)
    assert np.frombuffer(pcm, "<i2").tolist() == expected


def test_pcm16_round_trip_is_exact() -> None:
    every = np.arange(-32768, 32768, dtype="<i2")
    back = np.frombuffer(float_to_pcm16(pcm16_to_float(every.tobytes())), "<i2")
    assert np.array_equal(back, every)


def test_float_round_trip_within_half_an_lsb() -> None:
    x = np.linspace(-1.0, 32767 / 32768, 10_001, dtype=np.float32)
    back = pcm16_to_float(float_to_pcm16(x))
    assert np.abs(back - x).max() <= LSB / 2 + 1e-9


def _sine(rate: int, seconds: float, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)).astype(np.float32)


def _stream(rate: int, x: np.ndarray, frame_ms: int = 20) -> np.ndarray:
    rs = StreamResampler(rate)
    frame = rate * frame_ms // 1000
    parts = [rs.push(x[i : i + frame]) for i in range(0, len(x), frame)]
    return np.concatenate([*parts, rs.flush()])


def _peak_hz(y: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    k = int(spectrum.argmax())
    a, b, c = np.log(spectrum[k - 1 : k + 2])
    return (k + 0.5 * (a - c) / (a - 2 * b + c)) * rate / len(y)  # parabolic interpolation


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_stream_resampler_keeps_length_frequency_and_amplitude(rate: int) -> None:
    x = _sine(rate, 2.0)
    out = _stream(rate, x)
    assert out.dtype == np.float32
    assert abs(len(out) - len(x) * TARGET_RATE / rate) <= 4
    middle = out[800:-800]  # away from the filter's start and end transients
    assert _peak_hz(middle, TARGET_RATE) == pytest.approx(440.0, abs=0.5)
    assert np.sqrt(np.mean(middle**2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.01)
    assert np.abs(middle).max() == pytest.approx(0.5, rel=0.01)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_stream_resampler_has_no_seams_or_delay(rate: int) -> None:
    """Frame by frame equals resampling the whole signal at once, and stays in phase with the source."""
    x = _sine(rate, 1.0)
    out = _stream(rate, x)
    whole = soxr.resample(x, rate, TARGET_RATE)
    assert len(out) == len(whole)
    assert np.abs(out - whole).max() < 1e-5
    ideal = 0.5 * np.sin(2 * np.pi * 440 * np.arange(len(out)) / TARGET_RATE)
    assert np.abs(out - ideal)[400:-400].max() < 1e-3


@pytest.mark.parametrize("frame_ms", [10, 20, 60])
def test_stream_resampler_frame_size_does_not_matter(frame_ms: int) -> None:
    x = _sine(44100, 1.0)
    np.testing.assert_allclose(_stream(44100, x, frame_ms), _stream(44100, x, 20), atol=1e-5)


def test_16k_is_passed_through_unchanged() -> None:
    rs = StreamResampler(16_000)
    x = _sine(16_000, 0.02)
    out = rs.push(x)
    assert np.array_equal(out, x)
    assert out.dtype == np.float32
    assert len(rs.flush()) == 0
