"""Reply audio framing and pacing."""

from __future__ import annotations

import numpy as np
import pytest

from duplexd.config import TransportConfig
from duplexd.streaming.playout import Playout, PlayoutFull


def test_frames_are_paced_by_the_playback_position() -> None:
    p = Playout(frame_samples=960, lead_samples=24_000)
    p.push(1, np.zeros(48_000, np.float32))
    frames, done = p.take(played=0)
    assert len(frames) == 25 and done == []  # 1 s ahead, not more
    assert [seq for seq, _ in frames] == list(range(1, 26))
    assert p.take(played=0) == ([], [])
    frames, _ = p.take(played=9600)
    assert len(frames) == 10


def test_short_last_frame_only_at_the_end_of_a_reply() -> None:
    p = Playout(frame_samples=960, lead_samples=10**9)
    p.push(1, np.zeros(1000, np.float32))
    frames, done = p.take(0)
    assert [len(b) // 2 for _, b in frames] == [960] and done == []
    p.push(1, np.zeros(100, np.float32))
    p.end(1)
    frames, done = p.take(0)
    assert [len(b) // 2 for _, b in frames] == [140] and done == [1]
    assert p.sent == 1100


def test_stop_drops_unsent_audio() -> None:
    p = Playout(frame_samples=960, lead_samples=960)
    p.push(1, np.zeros(96_000, np.float32))
    p.end(1)
    p.take(0)
    p.stop(1)
    assert p.queued == 0 and p.take(10**6) == ([], [])
    assert p.sent == 960


def test_reply_without_audio_is_done_at_once_and_pcm_is_clipped() -> None:
    p = Playout(frame_samples=4, lead_samples=100)
    p.end(3)
    assert p.take(0) == ([], [3])
    p.push(4, np.array([2.0, -2.0, 0.5, 0.0], np.float32))
    ((_, pcm),) = p.take(0)[0]
    assert np.frombuffer(pcm, "<i2").tolist() == [32767, -32767, 16383, 0]


def test_a_full_playout_refuses_a_push_and_has_room_again_as_frames_go_out() -> None:
    p = Playout(frame_samples=960, lead_samples=960, max_samples=2000)
    p.push(1, np.zeros(1500, np.float32))
    assert not p.full
    p.push(1, np.zeros(1000, np.float32))  # taken: there was room (a push may end over the bound)
    assert p.full and p.queued == 2500
    with pytest.raises(PlayoutFull):
        p.push(1, np.zeros(10, np.float32))
    assert p.queued == 2500  # nothing added, nothing dropped
    p.push(1, np.zeros(0, np.float32))  # (no audio: nothing to refuse)
    frames, _ = p.take(played=0)
    assert len(frames) == 1 and p.queued == 1540 and not p.full
    p.push(1, np.zeros(500, np.float32))
    p.end(1)
    frames, done = p.take(played=10**6)
    assert sum(len(b) // 2 for _, b in frames) == 2040 and done == [1] and p.sent == 3000


def test_the_bound_defaults_to_the_transport_setting() -> None:
    assert Playout(960, 960).max_samples == TransportConfig().max_queued_audio_s * 24_000 == 720_000


def test_a_paused_playout_sends_nothing_and_keeps_everything() -> None:
    p = Playout(frame_samples=960, lead_samples=24_000)
    p.push(1, np.zeros(48_000, np.float32))
    p.paused = True
    assert p.take(played=0) == ([], []) and p.queued == 48_000
    p.paused = False
    frames, _ = p.take(played=0)
    assert len(frames) == 25 and frames[0][0] == 1
