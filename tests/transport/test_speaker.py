"""The WebRTC call's loudspeaker track (`webrtc.Speaker`): it plays the reply audio it is given in 20 ms
frames, silence when it has none, and reports what it played as a native client's `playback` does."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("aiortc")

from duplexd.transport.webrtc import Speaker


class Reports:
    def __init__(self) -> None:
        self.played: list[int] = []
        self.buffer: list[tuple[str, str | None]] = []

    def speaker(self) -> Speaker:
        return Speaker(lambda n, now: self.played.append(n), lambda k, r: self.buffer.append((k, r)), capacity=24_000)


def pcm(n: int, start: int = 1) -> bytes:
    return (np.arange(start, start + n) % 30000).astype("<i2").tobytes()


def samples(frame) -> np.ndarray:
    return frame.to_ndarray().reshape(-1)


async def test_it_plays_what_it_is_given_then_silence_and_reports_each_frame() -> None:
    r = Reports()
    s = r.speaker()
    s.push(pcm(720), "resp_1")
    first, second, third = [await s.recv() for _ in range(3)]
    assert first.sample_rate == 24_000 and first.samples == 480 and (first.pts, second.pts) == (0, 480)
    assert np.array_equal(samples(first), np.arange(1, 481))
    assert np.array_equal(samples(second)[:240], np.arange(481, 721)) and not samples(second)[240:].any()
    assert not samples(third).any()
    assert r.played == [480, 720]  # (a silent frame is not reply audio played)
    assert r.buffer == [("started", "resp_1")]
    s.finish("resp_1")
    await s.recv()
    assert r.buffer == [("started", "resp_1"), ("stopped", "resp_1")]


async def test_a_paused_reply_holds_its_place() -> None:
    r = Reports()
    s = r.speaker()
    s.push(pcm(960), "resp_1")
    await s.recv()
    s.paused = True
    assert not samples(await s.recv()).any() and r.played == [480]
    s.paused = False
    assert np.array_equal(samples(await s.recv()), np.arange(481, 961))
    assert r.played == [480, 960]


async def test_a_cut_reply_skips_to_the_end_of_what_was_received() -> None:
    r = Reports()
    s = r.speaker()
    s.push(pcm(2400), "resp_1")
    await s.recv()
    assert s.cut() == "resp_1"
    assert (s.played, s.received) == (2400, 2400)
    assert not samples(await s.recv()).any()
    s.push(pcm(480, 7), "resp_2")  # the next reply plays from the stream's new end
    assert np.array_equal(samples(await s.recv()), np.arange(7, 487))
    assert r.played[-1] == 2880 and ("started", "resp_2") in r.buffer
    assert s.cut() == "resp_2"  # (it was playing, not finished)
    assert s.cut() is None  # (nothing queued, nothing playing: nothing to clear)


async def test_it_never_holds_more_than_its_capacity() -> None:
    r = Reports()
    s = r.speaker()
    for i in range(4):
        s.push(pcm(12_000, i), f"resp_{i}")
    assert s.dropped == 24_000 and s.received == 48_000 and s.played == 24_000
