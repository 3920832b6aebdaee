"""Session: frames in, VAD chunks out; VAD results in, events (speech, frame acks) out. Virtual clock."""

from __future__ import annotations

import numpy as np
import pytest

from duplexd.asr.engine import Segment, Transcription
from duplexd.asr.vad import VAD_CHUNK_SAMPLES
from duplexd.config import AsrConfig, ServerConfig
from duplexd.errors import ErrorCode, ProtocolError
from duplexd.events import (
    FrameAcked,
    SpeechStarted,
    SpeechStopped,
    TranscriptUpdated,
    UtteranceFinalized,
    Word,
)
from duplexd.streaming.session import Session, SessionConfig

C = 0.032
S, Q = 0.9, 0.1


def ramp(start: int, n: int) -> np.ndarray:
    """Distinct int16 sample values, so chunk contents can be traced back to frames."""
    return ((np.arange(start, start + n) % 20_000) - 10_000).astype("<i2")


def config(ack_interval_ms: int = 100, min_new_audio_s: float = 0.2) -> SessionConfig:
    return SessionConfig(asr=AsrConfig(min_new_audio_s=min_new_audio_s), ack_interval_ms=ack_interval_ms)


@pytest.mark.parametrize(
    ("frame_sizes", "chunk_counts"),
    [
        ([320] * 8, [0, 1, 0, 1, 1, 0, 1, 1]),
        ([512] * 3, [1, 1, 1]),
        ([100, 400, 12, 1024, 1], [0, 0, 1, 2, 0]),
        ([1600], [3]),
        ([511, 1, 511, 1], [0, 1, 0, 1]),
    ],
)
def test_accept_frame_returns_whole_chunks_and_carries_the_rest(
    frame_sizes: list[int], chunk_counts: list[int]
) -> None:
    session = Session("s", 16_000, SessionConfig())
    sent, chunks = 0, []
    for seq, n in enumerate(frame_sizes):
        out = session.accept_frame(seq, ramp(sent, n).tobytes(), now=0.0)
        sent += n
        assert out.shape == (chunk_counts[seq], VAD_CHUNK_SAMPLES)
        assert out.dtype == np.float32
        chunks.append(out)
    got = np.concatenate(chunks).ravel()
    assert np.array_equal(got, ramp(0, len(got)) / 32768)  # in order, nothing lost or repeated
    assert len(got) == sent // VAD_CHUNK_SAMPLES * VAD_CHUNK_SAMPLES


def test_flush_audio_pads_the_last_chunk_with_silence() -> None:
    session = Session("s", 16_000, SessionConfig())
    session.accept_frame(0, ramp(0, 700).tobytes(), now=0.0)  # one chunk out, 188 samples carried
    last = session.flush_audio()
    assert last.shape == (1, VAD_CHUNK_SAMPLES)
    assert np.array_equal(last[0, :188], ramp(512, 188) / 32768)
    assert not last[0, 188:].any()
    assert session.flush_audio().shape == (0, VAD_CHUNK_SAMPLES)


def test_48k_frames_are_resampled_to_16k_chunks() -> None:
    session = Session("s", 48_000, SessionConfig())
    x = (0.3 * np.sin(2 * np.pi * 300 * np.arange(48_000) / 48_000) * 32767).astype("<i2")
    chunks = [
        session.accept_frame(seq, x[i : i + 960].tobytes(), now=0.0) for seq, i in enumerate(range(0, 48_000, 960))
    ]
    chunks.append(session.flush_audio())
    total = sum(len(c) for c in chunks)
    assert total == 32  # 16000 samples at 16 kHz, the last of 32 chunks padded
    middle = np.concatenate(chunks).ravel()[2000:14000]
    assert np.sqrt(np.mean(middle**2)) == pytest.approx(0.3 / np.sqrt(2), rel=0.01)


@pytest.mark.parametrize(
    ("seqs", "rejected"),
    [
        ([0, 0], [1]),
        ([5, 3], [1]),
        ([5, 7, 6, 8], [2]),  # gaps are fine; going back is not
        ([1000, 1001, 1001, 999, 1002], [2, 3]),
    ],
)
def test_out_of_order_or_duplicate_seq_is_rejected(seqs: list[int], rejected: list[int]) -> None:
    session = Session("s", 16_000, SessionConfig())
    accepted, chunks = [], []
    for i, seq in enumerate(seqs):
        pcm = np.full(320, i + 1, "<i2").tobytes()
        if i in rejected:
            with pytest.raises(ProtocolError) as info:
                session.accept_frame(seq, pcm, now=0.0)
            assert info.value.code == ErrorCode.OUT_OF_ORDER
            assert not info.value.fatal
        else:
            chunks.append(session.accept_frame(seq, pcm, now=0.0))
            accepted.append(i + 1)
    # A rejected frame's audio is dropped: only accepted frames reach the VAD buffer.
    audio = np.concatenate([*chunks, session.flush_audio()]).ravel()
    expected = np.repeat(np.array(accepted, np.float32) / 32768, 320)
    assert np.array_equal(audio[: len(expected)], expected)


def test_apply_vad_needs_one_probability_per_chunk() -> None:
    session = Session("s", 16_000, SessionConfig())
    chunks = session.accept_frame(0, ramp(0, 1024).tobytes(), now=0.0)
    with pytest.raises(ValueError):
        session.apply_vad(chunks, np.array([0.1]), now=0.0)


def drive(
    session: Session, frame_samples: int, probs_per_frame: list[list[float]], lags_ms: list[float], rate: int = 16_000
) -> list[list[object]]:
    """Send frames on a virtual clock (frame k arrives at k * frame duration) and apply each lag_ms later."""
    frame_s = frame_samples / rate
    out = []
    for k, (probs, lag) in enumerate(zip(probs_per_frame, lags_ms, strict=True)):
        arrival = 100.0 + k * frame_s
        chunks = session.accept_frame(k, np.zeros(frame_samples, "<i2").tobytes(), now=arrival)
        out.append(session.apply_vad(chunks, np.array(probs[: len(chunks)]), now=arrival + lag / 1000))
    return out


@pytest.mark.parametrize(
    ("rate", "frame_samples", "ack_interval_ms", "acked_seqs"),
    [
        (16_000, 320, 100, [4, 9, 14, 19]),  # 20 ms frames: every 5th
        (16_000, 320, 30, [1, 3, 5, 7, 9, 11, 13, 15, 17, 19]),  # 40 ms between acks, never less than 30
        (16_000, 512, 100, [3, 7, 11, 15, 19]),  # 32 ms frames: 128 ms between acks
        (48_000, 960, 100, [4, 9, 14, 19]),  # 20 ms at 48 kHz
        (8_000, 800, 100, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]),  # 100 ms frames
    ],
)
def test_frame_acks_report_lag_on_the_virtual_clock(
    rate: int, frame_samples: int, ack_interval_ms: int, acked_seqs: list[int]
) -> None:
    session = Session("s", rate, config(ack_interval_ms=ack_interval_ms))
    lags = [3.0, 7.0, 12.0, 5.0, 9.0, 4.0, 30.0, 2.0, 8.0, 6.0] * 2
    out = drive(session, frame_samples, [[Q] * 4] * 20, lags, rate)
    acks = {k: [e for e in events if isinstance(e, FrameAcked)] for k, events in enumerate(out)}
    assert [k for k, a in acks.items() if a] == acked_seqs
    previous = -1
    for k in acked_seqs:
        (ack,) = acks[k]
        assert ack.seq == k
        assert ack.lag_ms == pytest.approx(lags[k], abs=1e-6)
        assert ack.max_lag_ms == pytest.approx(max(lags[previous + 1 : k + 1]), abs=1e-6)
        previous = k
    assert list(session.lags_ms) == pytest.approx(lags, abs=1e-6)
    assert session.frames == 20


def test_speech_events_and_pass_readiness() -> None:
    session = Session("s", 16_000, config(min_new_audio_s=0.5))
    probs = [Q] * 10 + [S] * 30 + [Q] * 16  # one 512-sample frame = one chunk
    out = drive(session, 512, [[p] for p in probs], [10.0] * len(probs))
    started = [(k, e) for k, events in enumerate(out) for e in events if isinstance(e, SpeechStarted)]
    stopped = [(k, e) for k, events in enumerate(out) for e in events if isinstance(e, SpeechStopped)]
    assert [k for k, _ in started] == [11]
    assert started[0][1].t_s == pytest.approx(10 * C - 0.2)
    assert [k for k, _ in stopped] == [55]
    assert stopped[0][1].t_s == pytest.approx(40 * C + 0.2)
    assert session.stream_s == pytest.approx(len(probs) * C)
    for events in out:
        acks = [e for e in events if isinstance(e, FrameAcked)]
        assert all(a.lag_ms == pytest.approx(10.0) for a in acks)
        if acks:
            assert events[-1] is acks[0]  # the ack comes after what the frame caused


def test_wants_pass_once_enough_speech_is_buffered() -> None:
    session = Session("s", 16_000, config(min_new_audio_s=0.5))
    onset = None
    for k, p in enumerate([Q] * 10 + [S] * 30):
        chunks = session.accept_frame(k, np.zeros(512, "<i2").tobytes(), now=float(k))
        events = session.apply_vad(chunks, np.array([p]), now=float(k))
        for e in events:
            if isinstance(e, SpeechStarted):
                onset = int(e.t_s * 16_000)
        if onset is None:
            assert not session.wants_pass(), f"pass wanted in silence at chunk {k}"
        else:
            buffered = (k + 1) * 512 - onset
            assert session.wants_pass() == (buffered >= 8000), f"chunk {k}: {buffered} samples since onset"
            assert session.pending_since_s() == pytest.approx(onset / 16_000)
    assert onset is not None
    request = session.prepare_pass()
    assert (request.start_sample, request.end_sample) == (onset, 40 * 512)
    assert not request.final
    assert not session.wants_pass()  # one pass at a time


def test_end_of_stream_while_speaking_asks_for_a_final_pass() -> None:
    session = Session("s", 16_000, SessionConfig())
    drive(session, 512, [[S]] * 20, [0.0] * 20)
    session.end_of_stream()
    request = session.prepare_pass()
    assert request.final
    assert request.end_sample == 20 * 512


def test_end_of_stream_in_silence_asks_for_nothing() -> None:
    session = Session("s", 16_000, SessionConfig())
    drive(session, 512, [[Q]] * 20, [0.0] * 20)
    session.end_of_stream()
    assert not session.wants_pass()


def pass_result(*texts_at: tuple[str, float]) -> Transcription:
    words = tuple(Word(t, at, at + 0.2) for t, at in texts_at)
    return Transcription((Segment(0.0, 1.0, words, 0.0, 0.0),))


def test_a_pause_finalizes_the_utterance_up_to_there() -> None:
    session = Session("s", 16_000, config(min_new_audio_s=5.0))  # (no partial passes in the way)
    drive(session, 512, [[Q]] * 10 + [[S]] * 30, [0.0] * 40)
    pause_chunks = -(-ServerConfig().turn.pause_ms // 32)  # 7 chunks of silence: 224 ms
    for k in range(pause_chunks):
        assert not session.wants_pass(), f"a pass in the first {k * 32} ms of silence"
        drive_more(session, [Q])
    assert session.wants_pass()
    request = session.prepare_pass()
    assert request.final and request.end_sample == (40 + pause_chunks) * 512  # all the audio heard so far
    # Whisper also "hears" a word in the silence after the speech (which VAD heard end at 40 * 32 ms): a
    # word that starts only after the end of speech is made up, and dropped.
    offset_s = request.start_sample / 16_000
    made_up = ("screen.", 40 * C - offset_s + 0.01)
    events = session.apply_pass(request, pass_result(("Hello", 0.5), ("there", 0.8), made_up))
    (final,) = [e for e in events if isinstance(e, UtteranceFinalized)]
    assert [w.text for w in final.words] == ["Hello", "there"]
    # VAD's own end of speech comes later and asks for nothing more.
    for _ in range(20):
        drive_more(session, [Q])
        assert not session.wants_pass()


def test_speech_resuming_after_a_pause_is_the_next_utterance() -> None:
    session = Session("s", 16_000, config(min_new_audio_s=0.5))
    drive(session, 512, [[Q]] * 10 + [[S]] * 30 + [[Q]] * 7, [0.0] * 47)
    first = session.prepare_pass()
    assert first.final
    drive_more(session, [S, S])  # the user goes on before VAD's end of speech (and before the pass is back)
    events = session.apply_pass(first, pass_result(("Well,", 0.5)))
    assert [e.utterance for e in events if isinstance(e, UtteranceFinalized)] == [1]
    for _ in range(14):
        drive_more(session, [S])
    # The next utterance is decoded with the audio before it as context (from up to 1.5 s before where the
    # first one ended); words from that context are the first utterance's and are not repeated.
    request = session.prepare_pass()
    assert not request.final and first.end_sample - 24_000 <= request.start_sample < first.end_sample
    resumed_s = (first.end_sample - request.start_sample) / 16_000  # (window-relative)
    result = pass_result(("Well,", resumed_s - 0.9), ("I", resumed_s + 0.1), ("think", resumed_s + 0.4))
    events = session.apply_pass(request, result)
    updates = [e for e in events if isinstance(e, TranscriptUpdated)]
    assert updates and all(e.utterance == 2 and e.words[0].text == "I" for e in updates)


@pytest.mark.parametrize(
    ("silence_chunks", "turn_ended", "continues"), [(20, False, 1), (60, False, None), (20, True, None)]
)
def test_speech_soon_after_the_end_of_speech_continues_the_utterance_before(
    silence_chunks: int, turn_ended: bool, continues: int | None
) -> None:
    # VAD ends speech after 500 ms of silence; a speaker who goes on 0.64 s after the last word (a sentence
    # said with a breath: "Ask not" ... "what your country") still continues it; 1.9 s later is fresh speech.
    session = Session("s", 16_000, SessionConfig(asr=AsrConfig(min_new_audio_s=5.0, continue_gap_s=1.0)))
    drive(session, 512, [[Q]] * 10 + [[S]] * 30 + [[Q]] * 7, [0.0] * 47)
    first = session.prepare_pass()
    assert first.final
    session.apply_pass(first, pass_result(("Ask", 0.5), ("not.", 0.8)))
    if turn_ended:  # (before VAD's end of speech) the turn ended at that pause: speech after it is a new turn,
        session.turn_ended()  # a talk-over over the reply, not the user's breath
    drive_more(session, [Q] * (silence_chunks - 7) + [S] * 20 + [Q] * 7)
    request = session.prepare_pass()
    assert request.final
    what_s = (request.end_sample - request.start_sample) / 16_000 - 0.6  # (window-relative, in the new speech)
    events = session.apply_pass(request, pass_result(("what", what_s)))
    (final,) = [e for e in events if isinstance(e, UtteranceFinalized)]
    assert final.continues == continues
    # A continuation is decoded with the last words before it; fresh speech from its own onset on.
    assert (request.start_sample < first.end_sample) == (continues is not None)


def drive_more(session: Session, probs: list[float]) -> None:
    for p in probs:
        k = session.frames
        chunks = session.accept_frame(10_000 + k, np.zeros(512, "<i2").tobytes(), now=200.0 + k * C)
        session.apply_vad(chunks, np.array([p]), now=200.0 + k * C)


def test_reply_lag_is_the_current_wait_for_owed_audio_and_underrun_sums_the_waits() -> None:
    session = Session("s", 16_000, SessionConfig())
    assert session.reply_lag_s(10.0) == 0.0
    session.note_reply_audio(True, 10.0)
    session.note_reply_audio(True, 10.2)  # still waiting: the wait is counted from when it began
    assert session.reply_lag_s(10.5) == pytest.approx(0.5)
    session.note_reply_audio(False, 10.6)
    assert session.reply_lag_s(11.0) == 0.0 and session.underrun_s == pytest.approx(0.6)
    session.note_reply_audio(True, 12.0)
    session.note_reply_audio(False, 12.25)
    assert session.underrun_s == pytest.approx(0.85)
    # Per control period: the longest wait, ended (0.6 s) or going on (0.3 s so far), then reset.
    session.note_reply_audio(True, 13.0)
    assert session.drain_reply_lag(13.3) == pytest.approx(0.6)
    assert session.drain_reply_lag(13.5) == pytest.approx(0.5)
    session.note_reply_audio(False, 13.6)
    assert session.drain_reply_lag(14.0) == pytest.approx(0.6)
    assert session.drain_reply_lag(15.0) == 0.0


def test_a_pause_hands_over_the_recent_audio_once_for_the_acoustic_end_of_turn_model() -> None:
    session = Session("s", 16_000, SessionConfig(asr=AsrConfig(min_new_audio_s=5.0), keep_audio_s=1.0))
    frames = 60  # 60 frames of 512 samples (1.92 s): more than the 1 s kept
    for k in range(frames):
        chunks = session.accept_frame(k, ramp(512 * k, 512).tobytes(), now=100.0 + k * C)
        session.apply_vad(chunks, np.array([S if 10 <= k < 50 else Q]), now=100.0 + k * C)
        if k < 50 + 6:  # the pause: 200 ms of silence is 7 chunks
            assert session.take_pause_audio() is None, k
    voice_end_s, audio = session.take_pause_audio() or (None, None)
    assert voice_end_s == pytest.approx(50 * C)
    assert len(audio) == 16_000  # the last second, oldest first, through the pause (k = 56)
    expected = ramp(512 * 57 - 16_000, 16_000).astype(np.float32) / 32768.0
    assert np.allclose(audio, expected, atol=1e-4)
    assert session.take_pause_audio() is None  # once per pause
    assert Session("s", 16_000, config()).take_pause_audio() is None  # nothing kept: nothing handed over


def test_voiced_ms_counts_the_run_of_speech_so_far() -> None:
    session = Session("s", 16_000, config())
    drive_more(session, [S, S, S])
    assert session.voiced_ms == pytest.approx(96)
    drive_more(session, [Q])
    assert session.voiced_ms == 0
