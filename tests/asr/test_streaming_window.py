"""StreamingTranscriber and AudioRing, driven with literal transcriptions (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from duplexd.asr.engine import Segment, Transcription
from duplexd.asr.streaming import AudioRing, PassRequest, StreamingTranscriber
from duplexd.config import AsrConfig
from duplexd.errors import ErrorCode
from duplexd.events import ErrorRaised, Event, TranscriptUpdated, UtteranceFinalized, Word

SR = 16_000
CHUNK = 512


def result(*segments: list[tuple[str, float, float]]) -> Transcription:
    """A pass result; word times are relative to the window start, as an engine reports them."""
    return Transcription(
        tuple(
            Segment(seg[0][1], seg[-1][2], tuple(Word(*w) for w in seg), no_speech_prob=0.0, avg_logprob=-0.1)
            for seg in segments
        )
    )


def at_stream_times(request: PassRequest, words: list[tuple[str, float, float]]) -> Transcription:
    """A pass result for `words` given at stream times, relative to the window as an engine reports them."""
    offset_s = request.start_sample / SR
    return result([(w, a - offset_s, b - offset_s) for w, a, b in words])


def feed(t: StreamingTranscriber, seconds: float, chunk: int = CHUNK) -> list[Event]:
    """Append `seconds` of audio whose sample values are their absolute indices / 1e6."""
    events: list[Event] = []
    stop = t.samples + round(seconds * SR)
    while t.samples < stop:
        start = t.samples
        events += t.append(np.arange(start, min(start + chunk, stop), dtype=np.float32) / 1e6)
    return events


def texts(words: tuple[Word, ...]) -> list[str]:
    return [w.text for w in words]


HELLO = [("hello", 0.1, 0.4), ("world", 0.5, 0.9)]
HELLO_AGAIN = [*HELLO, ("again", 1.0, 1.3)]


def test_no_pass_while_there_is_only_silence() -> None:
    t = StreamingTranscriber(AsrConfig())
    assert feed(t, 5.0) == []
    assert t.samples == 5 * SR
    assert not t.wants_pass()
    with pytest.raises(RuntimeError):
        t.prepare_pass()
    # Only the preroll (0.5 s) is kept before an onset: an onset in the past is clamped to it.
    t.speech_started(0.0)
    request = t.prepare_pass()
    assert request.start_sample == 5 * SR - SR // 2


@pytest.mark.parametrize(
    ("onset_s", "start_sample"),
    [(1.0, SR), (0.8, int(0.8 * SR)), (0.5, SR // 2), (0.2, SR // 2)],  # preroll 0.5 s: ring starts at 0.5 s
)
def test_pass_snapshots_audio_from_the_onset_to_now(onset_s: float, start_sample: int) -> None:
    t = StreamingTranscriber(AsrConfig())
    feed(t, 1.0)
    t.speech_started(onset_s)
    feed(t, 0.256)
    request = t.prepare_pass()
    end = SR + int(0.256 * SR)
    assert (request.start_sample, request.end_sample) == (start_sample, end)
    assert np.array_equal(request.audio, np.arange(start_sample, end, dtype=np.float32) / 1e6)
    assert request.prompt == ""
    assert not request.final
    assert request.generation == 1
    feed(t, 1.0)
    assert len(request.audio) == end - start_sample  # a snapshot: later audio does not change it


def test_pass_wanted_once_min_new_audio_has_arrived() -> None:
    t = StreamingTranscriber(AsrConfig(min_new_audio_s=0.2))
    feed(t, 1.0)
    t.speech_started(1.0)
    assert not t.wants_pass()
    t.append(np.zeros(3199, np.float32))
    assert not t.wants_pass()
    t.append(np.zeros(1, np.float32))
    assert t.wants_pass()
    assert t.pending_since_s() == pytest.approx(1.0)


def test_one_pass_at_a_time() -> None:
    t = StreamingTranscriber(AsrConfig())
    t.speech_started(0.0)
    feed(t, 1.0)
    request = t.prepare_pass()
    assert t.pass_in_flight
    feed(t, 2.0)
    assert not t.wants_pass()
    with pytest.raises(RuntimeError):
        t.prepare_pass()
    t.apply_pass(request, result(HELLO))
    assert not t.pass_in_flight
    assert t.wants_pass()  # 2 s arrived meanwhile
    assert t.pending_since_s() == pytest.approx(request.end_sample / SR)


def _open_at_1s() -> StreamingTranscriber:
    t = StreamingTranscriber(AsrConfig())
    feed(t, 1.0)
    t.speech_started(1.0)
    feed(t, 0.256)
    return t


def test_agreeing_hypotheses_commit_in_the_partial() -> None:
    t = StreamingTranscriber(AsrConfig(agreement_n=2))
    feed(t, 1.0)
    t.speech_started(1.0)
    feed(t, 0.256)
    r1 = t.prepare_pass()
    (e1,) = t.apply_pass(r1, result(HELLO))
    assert isinstance(e1, TranscriptUpdated)
    assert (e1.utterance, texts(e1.words), e1.committed) == (1, ["hello", "world"], 0)
    assert [t for w in e1.words for t in (w.start_s, w.end_s)] == pytest.approx([1.1, 1.4, 1.5, 1.9])  # stream time
    assert e1.text == "hello world"

    feed(t, 0.256)
    r2 = t.prepare_pass()
    assert r2.start_sample == SR  # same window start, more audio
    (e2,) = t.apply_pass(r2, result(HELLO_AGAIN))
    assert (texts(e2.words), e2.committed) == (["hello", "world", "again"], 2)

    feed(t, 0.256)
    (e3,) = t.apply_pass(t.prepare_pass(), result(HELLO_AGAIN))
    assert (texts(e3.words), e3.committed) == (["hello", "world", "again"], 3)

    feed(t, 0.256)
    assert t.apply_pass(t.prepare_pass(), result(HELLO_AGAIN)) == []  # nothing changed: no event


def test_three_passes_must_agree_by_default() -> None:
    t = _open_at_1s()
    t.apply_pass(t.prepare_pass(), result(HELLO))
    feed(t, 0.256)
    (e,) = t.apply_pass(t.prepare_pass(), result(HELLO_AGAIN))
    assert (texts(e.words), e.committed) == (["hello", "world", "again"], 0)
    feed(t, 0.256)
    (e,) = t.apply_pass(t.prepare_pass(), result(HELLO_AGAIN))
    assert (texts(e.words), e.committed) == (["hello", "world", "again"], 2)


def test_disagreeing_hypotheses_commit_nothing() -> None:
    t = _open_at_1s()
    t.apply_pass(t.prepare_pass(), result(HELLO))
    feed(t, 0.256)
    (e,) = t.apply_pass(t.prepare_pass(), result([("yellow", 0.1, 0.4), ("world", 0.5, 0.9)]))
    assert (texts(e.words), e.committed) == (["yellow", "world"], 0)


def test_speech_stopped_then_final_pass_finalizes_everything() -> None:
    t = _open_at_1s()
    t.apply_pass(t.prepare_pass(), result(HELLO))
    feed(t, 0.256)
    t.apply_pass(t.prepare_pass(), result(HELLO_AGAIN))  # hello world committed, again tentative
    feed(t, 1.0)
    t.speech_stopped(2.5)
    assert t.wants_pass()  # the final pass is due whatever the new audio
    final = t.prepare_pass()
    assert final.final
    assert (final.start_sample, final.end_sample) == (SR, int(2.5 * SR))
    events = t.apply_pass(final, result([*HELLO_AGAIN, ("friend", 1.1, 1.4)]))
    assert len(events) == 1
    (done,) = events
    assert isinstance(done, UtteranceFinalized)
    assert done.utterance == 1
    assert texts(done.words) == ["hello", "world", "again", "friend"]
    assert done.text == "hello world again friend"
    # No new utterance is open: audio alone asks for no pass.
    assert feed(t, 3.0) == []
    assert not t.wants_pass()
    # The next utterance, 3 s later, is numbered 2 and is one of its own: it is decoded without a prompt
    # (behaviour changed on purpose: prompted with what was said before a silence, tiny.en read unrelated
    # speech in its light; a continuation is still prompted, below: "I said").
    t.speech_started(t.samples / SR)
    feed(t, 0.256)
    request = t.prepare_pass()
    assert request.generation == 2
    assert request.prompt == ""
    (e,) = t.apply_pass(request, result([("next", 0.0, 0.2)]))
    assert (e.utterance, texts(e.words)) == (2, ["next"])


MEN = [("men", 0.1, 0.35), ("the", 0.4, 0.5), ("coat", 0.55, 0.9)]
MEND = [("mend", 0.1, 0.42), ("the", 0.45, 0.55), ("coat", 0.6, 0.9), ("before", 1.0, 1.3)]


def _committed_men(config: AsrConfig) -> StreamingTranscriber:
    """Three passes agree on "men the": committed, before the speaker has said much more."""
    t = StreamingTranscriber(config)
    feed(t, 1.0)
    t.speech_started(1.0)
    for _ in range(3):
        feed(t, 0.256)
        t.apply_pass(t.prepare_pass(), result(MEN))
    return t


@pytest.mark.parametrize(
    ("redecode", "expected"), [(True, ["mend", "the", "coat", "before"]), (False, ["men", "the", "coat", "before"])]
)
def test_a_final_pass_that_heard_the_utterance_whole_decides_its_committed_words_too(
    redecode: bool, expected: list[str]
) -> None:
    t = _committed_men(AsrConfig(final_redecode=redecode))
    feed(t, 1.0)
    t.speech_stopped(2.5)
    final = t.prepare_pass()
    assert final.final and final.start_sample == SR  # the window is the whole utterance
    (done,) = t.apply_pass(final, result(MEND))
    assert isinstance(done, UtteranceFinalized)
    assert texts(done.words) == expected
    assert done.words[0].start_s == pytest.approx(1.1)  # (stream time)


def test_a_final_pass_that_stops_short_of_the_committed_words_does_not_replace_them() -> None:
    t = _committed_men(AsrConfig())
    feed(t, 1.0)
    t.speech_stopped(2.5)
    # (a decoder that stopped early: its last word ends before the last committed word began)
    (done,) = t.apply_pass(t.prepare_pass(), result([("mend", 0.1, 0.38)]))
    assert texts(done.words) == ["men", "the", "coat"]


def test_a_trimmed_utterance_keeps_the_words_it_committed() -> None:
    """Once the window was trimmed, the final pass hears only the utterance's end: the words committed
    before the cut stand."""
    t = StreamingTranscriber(AsrConfig(trim_after_s=1.0))
    feed(t, 1.0)
    t.speech_started(1.0)
    sentence = [("Stop.", 0.1, 0.4), ("Go", 0.6, 0.8), ("on", 0.9, 1.1)]
    for _ in range(3):
        feed(t, 0.4)
        t.apply_pass(t.prepare_pass(), result(sentence[:1], sentence[1:]))
    feed(t, 0.5)
    t.speech_stopped(t.samples / SR)
    final = t.prepare_pass()
    assert final.start_sample > SR  # trimmed at the committed sentence's end
    (done,) = t.apply_pass(final, at_stream_times(final, [("go", 1.6, 1.8), ("on", 1.9, 2.1), ("now", 2.2, 2.4)]))
    assert texts(done.words)[0] == "Stop."


def test_passes_whose_words_the_final_decides_again_are_previews() -> None:
    """A preview (a cheaper pass: Whisper encodes a shorter input) only where nothing it says can stay: the
    window was never trimmed and is shorter than `trim_after_s`, and the final pass hears it whole."""
    t = StreamingTranscriber(AsrConfig(trim_after_s=1.2))
    feed(t, 1.0)
    t.speech_started(1.0)
    sentence = [("Stop.", 0.1, 0.4), ("Go", 0.6, 0.8), ("on", 0.9, 1.1)]
    kinds = []
    for _ in range(3):
        feed(t, 0.4)
        assert t.next_preview() == (t.next_window_s() < 1.2)
        request = t.prepare_pass()
        kinds.append(request.preview)
        t.apply_pass(request, result(sentence[:1], sentence[1:]))
    assert kinds == [True, True, False]  # (windows 0.4, 0.8, 1.2 s: the third may trim, and did)
    feed(t, 0.2)
    after_trim = t.prepare_pass()
    assert after_trim.start_sample > SR and after_trim.end_sample - after_trim.start_sample < 1.2 * SR
    assert not after_trim.preview  # short again, but what it commits stays: the final will not hear it


def test_a_trim_waits_for_a_full_pass_that_reads_the_previews_committed_words_alike() -> None:
    """What previews committed stays once trimmed away: a full pass that reads it otherwise keeps the
    window whole, so the final pass, hearing the utterance whole, decides those words."""
    t = StreamingTranscriber(AsrConfig(trim_after_s=1.2, agreement_n=2))
    feed(t, 1.0)
    t.speech_started(1.0)
    for words in ([("Men.", 0.1, 0.35)], [("Men.", 0.1, 0.35), ("go", 0.5, 0.7)]):
        feed(t, 0.4)
        request = t.prepare_pass()
        assert request.preview
        t.apply_pass(request, result(words))
    feed(t, 0.4)
    full = t.prepare_pass()
    assert not full.preview
    (partial,) = t.apply_pass(full, result([("Mend.", 0.1, 0.38)], [("go", 0.5, 0.7), ("on", 0.8, 1.0)]))
    assert isinstance(partial, TranscriptUpdated) and texts(partial.words)[: partial.committed] == ["Men.", "go"]
    feed(t, 0.4)
    t.speech_stopped(t.samples / SR)
    final = t.prepare_pass()
    assert final.final and final.start_sample == SR  # not trimmed at "Men."
    heard = [("Mend.", 0.1, 0.38), ("go", 0.5, 0.7), ("on", 0.8, 1.0), ("now", 1.2, 1.4)]
    (done,) = t.apply_pass(final, result(heard[:1], heard[1:]))
    assert texts(done.words) == ["Mend.", "go", "on", "now"]


@pytest.mark.parametrize("config", [AsrConfig(final_redecode=False), AsrConfig(preview_encoder_s=30.0)])
def test_no_previews_where_the_final_does_not_decide_every_word_or_they_are_turned_off(config: AsrConfig) -> None:
    t = StreamingTranscriber(config)
    feed(t, 1.0)
    t.speech_started(1.0)
    feed(t, 0.4)
    assert not t.next_preview()
    assert not t.prepare_pass().preview


def test_a_preview_that_covers_the_end_of_speech_does_not_end_the_utterance() -> None:
    """A partial pass that already covers the end of speech stands in for the final pass, unless it was a
    preview: the final, a full pass, decides the words."""
    t = _open_at_1s()
    preview = t.prepare_pass()
    assert preview.preview
    t.speech_stopped(preview.end_sample / SR)  # (VAD's end of speech arrives while the pass runs)
    assert all(isinstance(e, TranscriptUpdated) for e in t.apply_pass(preview, result(MEN)))
    final = t.prepare_pass()
    assert final.final and not final.preview
    (done,) = t.apply_pass(final, result(MEND[:1]))
    assert isinstance(done, UtteranceFinalized) and texts(done.words) == ["mend"]


def test_speech_stop_beyond_the_audio_is_clamped() -> None:
    t = _open_at_1s()
    t.speech_stopped(99.0)
    assert t.prepare_pass().end_sample == t.samples


def test_final_pass_without_words_finalizes_silently() -> None:
    t = _open_at_1s()
    t.speech_stopped(1.2)
    assert t.apply_pass(t.prepare_pass(), result()) == []
    assert not t.wants_pass()
    feed(t, 1.0)
    assert not t.wants_pass()


def test_speech_resumed_before_the_final_result_opens_a_new_utterance() -> None:
    t = _open_at_1s()
    t.speech_stopped(1.2)
    final = t.prepare_pass()
    t.speech_started(1.25)
    feed(t, 0.5)
    (done,) = t.apply_pass(final, result(HELLO))
    assert isinstance(done, UtteranceFinalized)
    request = t.prepare_pass()
    assert request.generation == 2
    assert request.start_sample == int(1.2 * SR)  # the new utterance starts where the old one ended


def test_result_for_an_old_generation_is_ignored() -> None:
    t = _open_at_1s()
    stale = t.prepare_pass()
    assert t.finish_final_without_pass() == []  # the stream ended under the pass; nothing was decoded
    t.speech_started(t.samples / SR)
    feed(t, 0.256)
    assert t.apply_pass(stale, result(HELLO)) == []
    assert not t.pass_in_flight
    (e,) = t.apply_pass(t.prepare_pass(), result([("fresh", 0.0, 0.2)]))
    assert (e.utterance, texts(e.words), e.committed) == (2, ["fresh"], 0)


def test_a_request_replayed_after_finalization_is_ignored() -> None:
    t = _open_at_1s()
    request = t.prepare_pass()
    t.apply_pass(request, result(HELLO))
    t.speech_stopped(1.3)
    t.apply_pass(t.prepare_pass(), result(HELLO))
    assert t.apply_pass(request, result(HELLO)) == []


# -- the window stays bounded ---------------------------------------------------------------------------

STEP = 0.5  # a word every 0.5 s of stream time, 0.3 s long: "w<k>" at k*STEP


def spread_words(request: PassRequest, segment_s: float) -> Transcription:
    """Every word that lies wholly inside the window, grouped into segments of `segment_s` (0: one segment)."""
    offset = request.start_sample / SR
    end = request.end_sample / SR
    groups: dict[int, list[tuple[str, float, float]]] = {}
    k = int(np.ceil(offset / STEP - 1e-9))
    while k * STEP + 0.3 <= end + 1e-9:
        key = int(k * STEP // segment_s) if segment_s else 0
        groups.setdefault(key, []).append((f"w{k}", k * STEP - offset, k * STEP + 0.3 - offset))
        k += 1
    return result(*groups.values())


@pytest.mark.parametrize(
    ("segment_s", "pass_every_s"),
    [
        (3.0, 0.32),  # frequent passes, segment ends to trim at
        (0.0, 0.32),  # one endless segment: trimming is forced
        (3.0, 8.0),  # passes far apart: the window reaches its limit
        (0.0, 12.8),
    ],
)
def test_window_never_exceeds_max_window_and_nothing_is_lost(segment_s: float, pass_every_s: float) -> None:
    cfg = AsrConfig()
    t = StreamingTranscriber(cfg)
    t.speech_started(0.0)
    events: list[Event] = []
    requests: list[PassRequest] = []

    def run_pass() -> None:
        request = t.prepare_pass()
        requests.append(request)
        events.extend(t.apply_pass(request, spread_words(request, segment_s)))

    every = round(pass_every_s * SR / CHUNK)
    for i in range(round(40 * SR / CHUNK)):
        events.extend(feed(t, CHUNK / SR))
        if i % every == every - 1 and t.wants_pass():
            run_pass()
    t.speech_stopped(t.samples / SR)
    while t.wants_pass():
        run_pass()

    for r in requests:
        assert r.end_sample - r.start_sample <= cfg.max_window_s * SR
        assert len(r.audio) == r.end_sample - r.start_sample
        assert len(r.prompt) <= cfg.prompt_chars
        if r.prompt:  # the prompt is the committed text just before the window
            last = int(r.prompt.split()[-1][1:])
            assert r.start_sample / SR - STEP <= last * STEP + 0.3 <= r.start_sample / SR + 1e-3
    assert any(r.start_sample > 0 for r in requests)  # the window did slide
    assert all(r.prompt for r in requests if r.start_sample >= SR)  # (with the utterance's own words before it)
    assert requests[-1].final
    assert not [e for e in events if isinstance(e, ErrorRaised)]
    (final,) = [e for e in events if isinstance(e, UtteranceFinalized)]
    assert texts(final.words) == [f"w{k}" for k in range(80)]
    partials = [e for e in events if isinstance(e, TranscriptUpdated)]
    for before, after in zip(partials, partials[1:], strict=False):  # committed words never change
        assert after.words[: before.committed] == before.words[: before.committed]
        assert after.committed >= before.committed


# -- AudioRing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("appends", "dropped", "start", "end"),
    [
        ([6], [0], 0, 6),
        ([10], [0], 0, 10),
        ([6, 6], [0, 2], 2, 12),
        ([10, 1], [0, 1], 1, 11),
        ([3, 3, 3, 3, 3], [0, 0, 0, 2, 3], 5, 15),
        ([0, 4], [0, 0], 0, 4),
        ([12], [2], 2, 12),  # longer than the ring: the oldest new samples are dropped too
        ([4, 25], [0, 19], 19, 29),
    ],
)
def test_audio_ring_keeps_the_newest_samples(appends: list[int], dropped: list[int], start: int, end: int) -> None:
    ring = AudioRing(10)
    got = []
    for n in appends:
        got.append(ring.append(np.arange(ring.end, ring.end + n, dtype=np.float32)))
    assert got == dropped
    assert (ring.start, ring.end) == (start, end)
    assert ring.read(0, 10**6).tolist() == list(range(start, end))  # sample value == absolute index


@pytest.mark.parametrize(
    ("read", "expected"),
    [((12, 15), [12, 13, 14]), ((0, 13), [10, 11, 12]), ((18, 40), [18, 19]), ((15, 15), []), ((25, 30), [])],
)
def test_audio_ring_read_is_clamped_to_what_it_holds(read: tuple[int, int], expected: list[int]) -> None:
    ring = AudioRing(10)
    ring.append(np.arange(20, dtype=np.float32))
    assert ring.read(*read).tolist() == expected


def test_audio_ring_drop_before() -> None:
    ring = AudioRing(10)
    ring.append(np.arange(8, dtype=np.float32))
    ring.drop_before(3)
    assert (ring.start, ring.end) == (3, 8)
    ring.drop_before(1)  # already gone: no-op
    assert (ring.start, ring.end) == (3, 8)
    assert ring.append(np.arange(8, 13, dtype=np.float32)) == 0  # room was made
    assert ring.read(0, 100).tolist() == list(range(3, 13))
    ring.drop_before(100)
    assert (ring.start, ring.end) == (13, 13)


def test_ring_overflow_in_an_open_utterance_is_reported() -> None:
    cfg = AsrConfig(ring_s=4.0, max_window_s=2.0, trim_after_s=2.0)
    t = StreamingTranscriber(cfg)
    t.speech_started(0.0)
    per_append = [feed(t, 0.5, chunk=SR // 2) for _ in range(10)]  # 5 s, no pass ever runs
    assert per_append[:8] == [[]] * 8  # 4 s fit
    (error,) = per_append[8]
    assert isinstance(error, ErrorRaised)
    assert error.code == ErrorCode.ASR_BEHIND
    assert "0.50s" in error.message
    assert per_append[9] == []  # said once, not once per frame, until a pass comes back
    # The window moved past the lost audio; the next pass starts at the oldest sample still held.
    assert t.pending_since_s() == pytest.approx(1.0)
    request = t.prepare_pass()
    assert (request.start_sample, request.end_sample) == (SR, SR + 2 * SR)  # capped at max_window_s


def test_ring_overflow_without_an_utterance_is_not_an_error() -> None:
    t = StreamingTranscriber(AsrConfig(ring_s=4.0, max_window_s=2.0, trim_after_s=2.0))
    assert feed(t, 10.0, chunk=SR // 2) == []


# -- failed passes --------------------------------------------------------------------------------------


def test_abort_of_a_final_pass_finalizes_with_what_was_decoded() -> None:
    t = _open_at_1s()
    t.apply_pass(t.prepare_pass(), result(HELLO))  # tentative only
    t.speech_stopped(1.5)
    events = t.abort_pass(t.prepare_pass())
    assert [type(e) for e in events] == [ErrorRaised, UtteranceFinalized]
    assert events[0].code == ErrorCode.INTERNAL
    assert texts(events[1].words) == ["hello", "world"]
    assert not t.wants_pass()
    assert not t.pass_in_flight


def test_abort_of_a_partial_pass_skips_its_audio() -> None:
    t = _open_at_1s()
    request = t.prepare_pass()
    (error,) = t.abort_pass(request)
    assert error.code == ErrorCode.INTERNAL
    assert not t.pass_in_flight
    assert t.pending_since_s() == pytest.approx(request.end_sample / SR)
    assert not t.wants_pass()  # its audio counts as covered
    feed(t, 0.256)
    assert t.wants_pass()


def test_abort_for_an_old_generation_is_silent() -> None:
    t = _open_at_1s()
    stale = t.prepare_pass()
    t.finish_final_without_pass()
    assert t.abort_pass(stale) == []


def test_speech_queued_behind_a_final_pass_merges_only_beyond_one_utterance() -> None:
    """While utterance 1 waits for its final pass, the next speech is queued as utterance 2; any further
    speech before then extends utterance 2 (at most two final passes owed per session)."""
    t = StreamingTranscriber(AsrConfig())
    t.speech_started(0.0)
    feed(t, 1.0)
    t.speech_stopped(1.0)
    for start_s in (1.5, 2.5):  # two more bursts of speech before any pass ran
        feed(t, start_s - t.samples / SR)
        t.speech_started(start_s)
        feed(t, 0.5)
        t.speech_stopped(start_s + 0.5)
    request = t.prepare_pass()
    assert request.final and (request.start_sample, request.end_sample) == (0, SR)
    (final,) = t.apply_pass(request, result(HELLO))
    assert isinstance(final, UtteranceFinalized) and final.utterance == 1
    request = t.prepare_pass()
    assert request.final and (request.start_sample, request.end_sample) == (SR, 3 * SR)
    (final,) = t.apply_pass(request, result([("again", 0.6, 0.9), ("friend", 1.6, 1.9)]))
    assert isinstance(final, UtteranceFinalized) and final.utterance == 2
    assert texts(final.words) == ["again", "friend"]
    assert not t.wants_pass()


def test_speech_during_a_final_pass_opens_the_next_utterance() -> None:
    t = StreamingTranscriber(AsrConfig())
    t.speech_started(0.0)
    feed(t, 1.0)
    t.speech_stopped(1.0)
    final_request = t.prepare_pass()
    assert final_request.final
    feed(t, 0.5)
    t.speech_started(1.5)  # too late to extend utterance 1
    feed(t, 1.0)
    t.speech_stopped(2.5)
    (final,) = t.apply_pass(final_request, result(HELLO))
    assert isinstance(final, UtteranceFinalized) and final.utterance == 1
    # Utterance 2 starts where utterance 1 ended and already knows its own end of speech.
    request = t.prepare_pass()
    assert request.final and (request.start_sample, request.end_sample) == (SR, int(2.5 * SR))
    (final,) = t.apply_pass(request, result([("again", 0.6, 1.2)]))
    assert isinstance(final, UtteranceFinalized) and final.utterance == 2
    assert texts(final.words) == ["again"] and final.words[0].start_s == pytest.approx(1.6)
    assert not t.wants_pass()


# -- an utterance finalized at a pause, continued -------------------------------------------------------

SUNDAY = [("I", 0.1, 0.2), ("said", 0.3, 0.6), ("Sunday", 0.7, 1.1), ("is", 1.2, 1.3), ("the", 1.4, 1.5)]
SUNDAY += [("best.", 1.6, 2.0)]
CONTEXT = [(w, a + 1.0, b + 1.0) for w, a, b in SUNDAY[2:]]  # "Sunday is the best." at stream times


def _sunday_said(t: StreamingTranscriber | None = None, at_s: float = 1.0) -> StreamingTranscriber:
    """ "I said Sunday is the best." said from 1.1 s to 3.0 s, its end of speech at the pause at 3.2 s (all
    `at_s - 1.0` later, after what `t` heard)."""
    t = t or StreamingTranscriber(AsrConfig())
    feed(t, at_s - t.samples / SR)
    t.speech_started(at_s)
    feed(t, 2.2)
    t.speech_stopped(at_s + 2.2, voiced_end_s=at_s + 2.05)
    return t


def _finalized_at_a_pause() -> tuple[StreamingTranscriber, UtteranceFinalized]:
    """ "I said Sunday is the best." said from 1.1 s to 3.0 s, finalized at the pause at 3.2 s; the speaker
    goes on at 3.3 s."""
    t = _sunday_said()
    (done,) = t.apply_pass(t.prepare_pass(), result(SUNDAY))
    assert isinstance(done, UtteranceFinalized) and done.continues is None
    feed(t, 0.1)
    t.speech_started(3.2, continues=True)
    feed(t, 1.0)
    return t, done


def test_a_continuation_is_decoded_from_the_last_words_before_the_pause_at_a_word_boundary() -> None:
    t, done = _finalized_at_a_pause()
    request = t.prepare_pass()
    # Its words starting in its last 1.5 s ("Sunday is the best."), from where the word before them ended.
    assert request.start_sample == int(1.6 * SR)
    np.testing.assert_allclose(request.audio[:3], np.arange(1.6 * SR, 1.6 * SR + 3) / 1e6)  # the ring kept it
    assert request.prompt == "I said"  # only text whose audio is not in the window (else it is skipped)


def test_a_continuations_prompt_reaches_back_only_to_where_its_stretch_of_speech_began() -> None:
    # "Far away." then 2.8 s of silence: "I said Sunday is the best." is an utterance of its own, and the
    # speaker goes on with it. The continuation is prompted with what its window does not hold of that
    # stretch ("I said"), not with the sentence before the silence (another topic, or another voice).
    t = StreamingTranscriber(AsrConfig())
    feed(t, 0.2)
    t.speech_started(0.2)
    feed(t, 1.0)
    t.speech_stopped(1.2, voiced_end_s=1.0)
    request = t.prepare_pass()
    (far,) = t.apply_pass(request, at_stream_times(request, [("Far", 0.3, 0.6), ("away.", 0.7, 1.0)]))
    assert isinstance(far, UtteranceFinalized)
    _sunday_said(t, at_s=4.0)
    request = t.prepare_pass()
    assert request.prompt == ""  # (an utterance of its own)
    (sunday,) = t.apply_pass(request, result(SUNDAY))  # (its window from 4.0 s)
    assert isinstance(sunday, UtteranceFinalized)
    feed(t, 0.1)
    t.speech_started(6.3, continues=True)
    feed(t, 1.0)
    request = t.prepare_pass()
    assert request.start_sample == int(4.6 * SR)  # (its window from the end of "said": "Sunday is the best.")
    assert request.prompt == "I said"


def test_a_continuation_tells_its_words_from_the_context_by_text_not_by_time() -> None:
    t, _ = _finalized_at_a_pause()
    request = t.prepare_pass()
    # Across the pause the aligner places words anywhere: "part" starts before the old end of speech.
    said = [("Sunday", 0.1, 0.5), ("is", 0.6, 0.7), ("the", 0.8, 0.9), ("best", 1.0, 1.2)]
    (e,) = t.apply_pass(request, result([*said, ("part", 1.3, 1.6)]))
    assert isinstance(e, TranscriptUpdated) and (e.utterance, texts(e.words)) == (2, ["part"])
    feed(t, 0.5)
    hypothesis = [*said, ("part", 1.3, 1.6), ("of", 1.8, 1.9)]
    t.apply_pass(t.prepare_pass(), result(hypothesis))
    t.speech_stopped(4.6)
    (final,) = t.apply_pass(t.prepare_pass(), result([*hypothesis, ("it.", 2.0, 2.3)]))
    assert isinstance(final, UtteranceFinalized)
    assert texts(final.words) == ["part", "of", "it."]  # the context's words are not repeated
    # ... and the join reads as one sentence: "Sunday is the best part of it."
    assert final.continues == 1
    assert final.previous is not None and texts(final.previous) == ["I", "said", "Sunday", "is", "the", "best"]


def test_a_join_that_keeps_its_sentence_end_changes_nothing_before() -> None:
    t, _ = _finalized_at_a_pause()
    t.speech_stopped(4.2)
    words = [("Sunday", 0.1, 0.5), ("is", 0.6, 0.7), ("the", 0.8, 0.9), ("best.", 1.0, 1.4), ("Really.", 1.8, 2.1)]
    (final,) = t.apply_pass(t.prepare_pass(), result(words))
    assert isinstance(final, UtteranceFinalized)
    assert (texts(final.words), final.continues, final.previous) == (["Really."], 1, None)


def test_a_continuation_without_its_context_keeps_the_words_after_it() -> None:
    t, _ = _finalized_at_a_pause()
    t.speech_stopped(4.2)
    request = t.prepare_pass()
    offset_s = request.start_sample / SR
    # The decoder skipped the context: words are kept from the end of the finalized speech on (by time).
    words = [("um", 2.6 - offset_s, 2.8 - offset_s), ("part", 3.3 - offset_s, 3.6 - offset_s)]
    (final,) = t.apply_pass(request, result(words))
    assert isinstance(final, UtteranceFinalized)
    # (after "best.", kept: a sentence of its own, which starts with a capital; see below)
    assert (texts(final.words), final.continues, final.previous) == (["Part"], 1, None)


def test_a_continuation_after_a_sentence_end_the_join_keeps_starts_with_a_capital() -> None:
    # clip20: "I'm Abigail Klafflin." | "You can call me Abby.": the continuation's window began inside
    # "Abigail", its context was not found, and the words kept by time were decoded mid-sentence ("you can
    # call me Abby."). Where the join takes the sentence end away, the continuation's case is left as read.
    def continued(heard: list[tuple[str, float, float]]) -> UtteranceFinalized:
        t, _ = _finalized_at_a_pause()
        t.speech_stopped(4.4)
        request = t.prepare_pass()
        (final,) = t.apply_pass(request, at_stream_times(request, heard))
        assert isinstance(final, UtteranceFinalized) and final.continues == 1
        return final

    final = continued([("you", 3.3, 3.5), ("can", 3.6, 3.8), ("go.", 3.9, 4.2)])
    assert final.previous is None and texts(final.words) == ["You", "can", "go."]
    said = [("Sunday", 1.7, 2.1), ("is", 2.2, 2.3), ("the", 2.4, 2.5), ("best", 2.6, 3.0)]
    final = continued([*said, ("part", 3.3, 3.6), ("of", 3.7, 3.8)])
    assert final.previous is not None and (texts(final.previous)[-1], texts(final.words)) == ("best", ["part", "of"])
    assert texts(continued([("I", 3.3, 3.4), ("mean", 3.5, 3.9)]).words) == ["I", "mean"]


def test_new_words_that_repeat_the_context_are_not_taken_for_it() -> None:
    # JFK: "... what your country can do for you" | "ask what you can do for your country". The decoder
    # skipped the context's audio; the new words say its words again, after the new speech began: they
    # are new (found by text alone, "can do for" was taken for the context and six words were dropped).
    t, _ = _finalized_at_a_pause()
    t.speech_stopped(5.0)
    request = t.prepare_pass()
    heard = [("Sunday", 3.4, 3.7), ("is", 3.8, 3.9), ("the", 4.0, 4.1), ("best", 4.2, 4.5), ("day.", 4.6, 4.9)]
    (final,) = t.apply_pass(request, at_stream_times(request, heard))
    assert isinstance(final, UtteranceFinalized)
    assert texts(final.words) == ["Sunday", "is", "the", "best", "day."]


def _continued_after(said: list[tuple[str, float, float]]) -> StreamingTranscriber:
    """`said` (window times from 1.0 s) finalized at the pause after it; the speaker goes on 0.2 s later."""
    t = StreamingTranscriber(AsrConfig())
    feed(t, 1.0)
    t.speech_started(1.0)
    end_s = 1.0 + said[-1][2]
    feed(t, end_s + 0.2 - t.samples / SR)
    t.speech_stopped(end_s + 0.2, voiced_end_s=end_s)
    (done,) = t.apply_pass(t.prepare_pass(), result(said))
    assert isinstance(done, UtteranceFinalized)
    feed(t, 0.1)
    t.speech_started(end_s + 0.3, continues=True)
    feed(t, 1.5)
    t.speech_stopped(end_s + 1.8)
    return t


@pytest.mark.parametrize(
    ("before", "again"),
    [
        ("seatbelts.", [("seat", 1.4, 1.6), ("belts.", 1.6, 1.9)]),  # one word then, two now
        ("seat belts.", [("seatbelts.", 1.4, 1.9)]),  # two words then, one now
    ],
)
def test_context_words_heard_again_but_spelled_another_way_are_not_said_twice(
    before: str, again: list[tuple[str, float, float]]
) -> None:
    # clip21 after other clips (bench peer, 4 of 4 runs): "please fasten your seatbelts." | "seat belts. We
    # are expecting some turbulence.": the continuation heard the context's last word again, spelled apart.
    said = [("please", 0.1, 0.4), ("fasten", 0.5, 0.8), ("your", 0.9, 1.0)]
    said += [(w, 1.1 + 0.3 * k, 1.3 + 0.3 * k) for k, w in enumerate(before.split())]
    t = _continued_after(said)
    request = t.prepare_pass()
    offset_s = request.start_sample / SR
    heard = [("fasten", 1.5 - offset_s, 1.8 - offset_s), ("your", 1.9 - offset_s, 2.0 - offset_s)]
    heard += [(w, a + 1.0 - offset_s, b + 1.0 - offset_s) for w, a, b in again]
    heard += [("We", 3.2 - offset_s, 3.4 - offset_s), ("are", 3.5 - offset_s, 3.7 - offset_s)]
    (final,) = t.apply_pass(request, result(heard))
    assert isinstance(final, UtteranceFinalized)
    assert texts(final.words) == ["We", "are"]


@pytest.mark.parametrize(
    ("again", "new"),
    [
        ([("8", 1.6, 2.0)], "the"),  # the context's last word read again another way, before the new speech
        ([], "The"),  # not read again: new words after the context (a sentence after "eight.", see above)
    ],
)
def test_the_contexts_last_word_read_again_another_way_is_not_a_new_word(
    again: list[tuple[str, float, float]], new: str
) -> None:
    # clip07 then clip08 (bench peer): "in 1813, eight." | "the press yard": the continuation's pass read
    # "1813, 8 the press yard", and "8" was taken for a new word: "eight. 8 the press yard".
    said = [("in", 0.1, 0.3), ("1813,", 0.5, 1.5), ("eight.", 1.6, 1.9)]
    t = _continued_after(said)  # (the new speech from 3.2 s)
    request = t.prepare_pass()
    offset_s = request.start_sample / SR
    heard = [("1813,", 1.5, 2.5), *((w, a + 1.0, b + 1.0) for w, a, b in again)]
    heard += [("the", 3.3, 3.4), ("press", 3.4, 3.7), ("yard.", 3.7, 4.1)]
    (final,) = t.apply_pass(request, result([(w, a - offset_s, b - offset_s) for w, a, b in heard]))
    assert isinstance(final, UtteranceFinalized)
    assert texts(final.words) == [new, "press", "yard."]
    assert texts(final.previous or ()) == (["in", "1813,", "8"] if again else [])  # (as it reads joined)


def test_a_new_word_that_only_begins_like_the_context_is_new() -> None:
    said = [("the", 0.1, 0.3), ("seat", 0.4, 0.8)]
    t = _continued_after(said)
    request = t.prepare_pass()
    offset_s = request.start_sample / SR
    heard = [("the", 1.1 - offset_s, 1.3 - offset_s), ("seat", 1.4 - offset_s, 1.8 - offset_s)]
    heard += [("seat", 2.1 - offset_s, 2.3 - offset_s), ("belts", 2.4 - offset_s, 2.8 - offset_s)]
    (final,) = t.apply_pass(request, result(heard))
    assert isinstance(final, UtteranceFinalized)
    assert texts(final.words) == ["seat", "belts"]  # ("seat" + "belts" is not the context's "seat")


def test_a_continuation_of_a_short_continuation_reaches_back_into_the_utterance_before_it() -> None:
    # "I said Sunday is the best." | "part of" | "it." : the second utterance's two words are less than the
    # context a continuation decodes again, so the third one's context reaches back into the first
    # utterance's words (their audio is still in the window): none of them is said twice.
    t, _ = _finalized_at_a_pause()
    t.speech_stopped(4.1)
    request = t.prepare_pass()
    said = [("Sunday", 1.7, 2.1), ("is", 2.2, 2.3), ("the", 2.4, 2.5), ("best", 2.6, 3.0)]
    part_of = [("part", 3.3, 3.6), ("of", 3.7, 3.9)]
    (second,) = t.apply_pass(request, at_stream_times(request, said + part_of))
    assert isinstance(second, UtteranceFinalized) and texts(second.words) == ["part", "of"]
    feed(t, 0.5)
    t.speech_started(4.6, continues=True)
    feed(t, 0.6)
    t.speech_stopped(5.2)
    request = t.prepare_pass()
    # From the end of "is": "the best part of" are the last 1.5 s of what was said (two utterances).
    assert request.start_sample == int(2.3 * SR)
    heard = [*said[2:], *part_of, ("it.", 4.7, 5.0)]
    (final,) = t.apply_pass(request, at_stream_times(request, heard))
    assert isinstance(final, UtteranceFinalized)
    assert (texts(final.words), final.continues, final.previous) == (["it."], 2, None)


def test_a_continuations_prompt_leaves_out_the_lone_first_word_of_its_sentence() -> None:
    # "The child almost hurt | the small dog.": the window holds "child almost hurt"; prompted with "The"
    # alone, tiny.en read the rest as a title ("The child almost Hurt The Small Dog."). The sentences
    # before stay in the prompt, and so do two first words (above: "I said").
    said = [("Well.", 0.1, 0.3), ("The", 0.4, 0.5), ("child", 0.6, 1.0), ("almost", 1.1, 1.4), ("hurt.", 1.5, 2.0)]
    request = _continued_after(said).prepare_pass()
    assert request.start_sample == int(1.5 * SR)  # (from the end of "The": the words of the last 1.5 s)
    assert request.prompt == "Well."


def test_a_later_prompt_reads_a_join_as_it_reads_now() -> None:
    # "I said Sunday is the best." | "part of the week and the whole" | "month.": the third utterance's
    # prompt reads "the best part of", as the first join does, not "best. part of" (a sentence end the
    # speaker did not say, where a prompt that ended it read the next words as a sentence of their own).
    t, _ = _finalized_at_a_pause()
    feed(t, 1.2)
    t.speech_stopped(5.5)
    request = t.prepare_pass()
    said = [("Sunday", 1.7, 2.1), ("is", 2.2, 2.3), ("the", 2.4, 2.5), ("best", 2.6, 3.0)]
    new = [("part", 3.3, 3.6), ("of", 3.7, 3.8), ("the", 3.9, 4.0), ("week", 4.1, 4.4), ("and", 4.5, 4.6)]
    new += [("the", 4.7, 4.8), ("whole", 4.9, 5.3)]
    (second,) = t.apply_pass(request, at_stream_times(request, said + new))
    assert isinstance(second, UtteranceFinalized) and second.previous is not None
    assert texts(second.previous)[-1] == "best"
    feed(t, 0.2)
    t.speech_started(5.7, continues=True)
    feed(t, 0.6)
    t.speech_stopped(6.3)
    request = t.prepare_pass()
    assert request.start_sample == int(3.8 * SR)  # (from the end of "of")
    assert request.prompt == "I said Sunday is the best part of"


def test_a_continuation_whose_passes_stop_at_the_context_is_decoded_from_its_onset() -> None:
    # Whisper ends the sentence at the context's last word and reads nothing of the new speech (a talk-over
    # in another voice after "... best."): once two passes past a second of new speech did, the utterance is
    # decoded alone. (A continuation that has read new words keeps its context through a pass that reads
    # none: clip06's "review." | "of activities" lost its "of" when one pass read only "the".)
    t, _ = _finalized_at_a_pause()
    request = t.prepare_pass()  # (its new speech from 3.2 s, 1.1 s of it fed)
    assert request.start_sample < int(3.2 * SR)  # (the continuation's window: from "Sunday")
    assert t.apply_pass(request, at_stream_times(request, CONTEXT)) == []
    feed(t, 0.3)
    request = t.prepare_pass()  # (one such pass is no stall: below)
    assert request.start_sample < int(3.2 * SR)
    assert t.apply_pass(request, at_stream_times(request, CONTEXT)) == []
    request = t.prepare_pass()  # at once: the new speech from the end of "best." (3.0 s), no context
    assert request.start_sample == int(3.0 * SR) and not request.final
    assert t.context_drops == 1  # (counted: `bench.asr_sweep` reports how often)
    events = t.apply_pass(request, result([("Stop", 0.6, 0.9), ("please.", 1.0, 1.4)]))
    (update,) = events
    assert isinstance(update, TranscriptUpdated) and texts(update.words) == ["Stop", "please."]
    t.speech_stopped(t.samples / SR)
    (final,) = t.apply_pass(t.prepare_pass(), result([("Stop", 0.6, 0.9), ("please.", 1.0, 1.4)]))
    assert isinstance(final, UtteranceFinalized) and final.continues is None  # (no join with the words before)


def test_one_pass_that_stops_at_the_context_keeps_it_for_the_final() -> None:
    # Measured (JFK replayed at a slow pass clock, as under load): "my fellow Americans." | "ask not": the
    # continuation's first pass came 1.0 s after its onset and read "my fellow Americans", "ask no-" cut by
    # the window's end; dropping the context then, the final read "Ask not!" alone. With it, "ask not...".
    t, first = _finalized_at_a_pause()
    request = t.prepare_pass()
    assert t.apply_pass(request, at_stream_times(request, CONTEXT)) == []
    t.speech_stopped(t.samples / SR)
    final = t.prepare_pass()
    assert final.final and final.start_sample == request.start_sample  # (still with its context)
    assert t.context_drops == 0
    (done,) = t.apply_pass(final, at_stream_times(final, [*CONTEXT[:-1], ("best", 2.6, 3.0), ("part", 3.3, 3.6)]))
    assert isinstance(done, UtteranceFinalized) and done.continues == first.utterance
    assert texts(done.words) == ["part"] and done.previous is not None and texts(done.previous)[-1] == "best"


def test_a_continuation_queued_behind_a_final_pass_is_late_from_its_own_onset() -> None:
    # Speech that resumes while the final pass of the words before is out is opened when that pass comes
    # back, at their end (3.2 s); its passes are late (`_STALL_S`) from where its speech began (3.8 s).
    t = _sunday_said()
    final = t.prepare_pass()
    feed(t, 0.6)
    t.speech_started(3.8, continues=True)
    feed(t, 0.7)
    (done,) = t.apply_pass(final, result(SUNDAY))
    assert isinstance(done, UtteranceFinalized)
    starts = []
    for _ in range(2):  # (ending 0.7 s, then 1.0 s, after its onset: the second one only is late)
        request = t.prepare_pass()
        starts.append(request.start_sample)
        assert t.apply_pass(request, at_stream_times(request, CONTEXT)) == []
        feed(t, 0.3)
    assert t.prepare_pass().start_sample == starts[0] == int(1.6 * SR)  # (with its context still)


def test_a_continuation_that_read_new_words_keeps_its_context_through_a_pass_that_reads_none() -> None:
    t, _ = _finalized_at_a_pause()
    request = t.prepare_pass()
    heard = [*CONTEXT, ("part", 3.3, 3.6)]
    assert t.apply_pass(request, at_stream_times(request, heard))
    feed(t, 0.3)
    request = t.prepare_pass()
    t.apply_pass(request, at_stream_times(request, CONTEXT))  # (a glitch)
    feed(t, 0.3)
    assert t.prepare_pass().start_sample == request.start_sample  # (still decoded with its context)


def test_a_continuation_keeps_its_context_through_a_partial_pass_that_reads_nothing_at_all() -> None:
    # Measured (the voice loop, clip06): "review." | "of activities they're under": a pass read "of active.",
    # the next one, over a longer window, nothing at all, the final all of it. Dropping the context at the
    # empty pass started the window at the end of "review.", mid-way into the short "of", and the final
    # read "activities they're under.": "of" was lost.
    t, first = _finalized_at_a_pause()
    request = t.prepare_pass()
    (shown,) = t.apply_pass(request, at_stream_times(request, [*CONTEXT, ("part", 3.3, 3.6)]))
    assert isinstance(shown, TranscriptUpdated) and texts(shown.words) == ["part"]
    feed(t, 0.3)
    glitch = t.prepare_pass()
    assert t.apply_pass(glitch, Transcription(())) == []
    assert t.pending_since_s() == pytest.approx(glitch.end_sample / SR)  # (its audio was decoded)
    t.speech_stopped(t.samples / SR)
    final = t.prepare_pass()
    assert final.final and final.start_sample == request.start_sample  # (still with its context)
    heard = [*CONTEXT, ("part", 3.3, 3.6), ("of", 3.7, 3.9), ("it.", 4.0, 4.3)]
    (done,) = t.apply_pass(final, at_stream_times(final, heard))
    assert isinstance(done, UtteranceFinalized)
    assert (texts(done.words), done.continues) == (["part", "of", "it."], first.utterance)


def test_a_continuation_pass_that_reads_nothing_at_all_failed_and_the_final_is_decoded_again_alone() -> None:
    # Measured (bench voice, clip06): "review." | "of activities they're under": a pass read "of activities.",
    # then the passes over the window (which holds the context's words) read nothing, the final pass too,
    # and the utterance was lost; its partial had been shown, so the turn waited for its final for ever.
    t, _ = _finalized_at_a_pause()
    request = t.prepare_pass()
    heard = [*CONTEXT, ("part", 3.3, 3.6)]
    (shown,) = t.apply_pass(request, at_stream_times(request, heard))
    assert isinstance(shown, TranscriptUpdated) and texts(shown.words) == ["part"]
    t.speech_stopped(t.samples / SR)
    final = t.prepare_pass()
    assert final.final and t.apply_pass(final, Transcription(())) == []  # (failed: run again, alone)
    again = t.prepare_pass()
    assert again.final and again.start_sample == int(3.0 * SR)  # (from the end of "best.")
    (done,) = t.apply_pass(again, result([("part", 0.3, 0.6), ("of", 0.7, 0.8), ("it.", 0.9, 1.1)]))
    assert isinstance(done, UtteranceFinalized) and texts(done.words) == ["part", "of", "it."]


def test_a_continuation_final_that_stops_at_the_context_after_new_words_were_read_is_decoded_again_alone() -> None:
    # A pass read "part" past "... best."; the final pass read "Sunday is the best." and stopped there (as
    # Whisper ends a sentence it takes for whole): taken as it read, "part of it" would be in no final.
    t, _ = _finalized_at_a_pause()
    request = t.prepare_pass()
    (shown,) = t.apply_pass(request, at_stream_times(request, [*CONTEXT, ("part", 3.3, 3.6)]))
    assert isinstance(shown, TranscriptUpdated) and texts(shown.words) == ["part"]
    t.speech_stopped(t.samples / SR)
    final = t.prepare_pass()
    assert final.final and t.apply_pass(final, at_stream_times(final, CONTEXT)) == []
    again = t.prepare_pass()
    assert again.final and again.start_sample == int(3.0 * SR)  # (from the end of "best.")
    (done,) = t.apply_pass(again, result([("part", 0.3, 0.6), ("of", 0.7, 0.8), ("it.", 0.9, 1.1)]))
    assert isinstance(done, UtteranceFinalized) and texts(done.words) == ["part", "of", "it."]


def test_a_continuation_final_that_reads_only_the_context_of_a_breath_has_no_words() -> None:
    # Speech resumed for 0.3 s (a breath, a cough) and no pass read a word of it: the final reads the context
    # alone, and that is the answer (decoded alone, Whisper would make words up from a cough).
    t = _sunday_said()
    (done,) = t.apply_pass(t.prepare_pass(), result(SUNDAY))
    feed(t, 0.1)
    t.speech_started(3.3, continues=True)
    feed(t, 0.3)
    t.speech_stopped(3.6)
    final = t.prepare_pass()
    assert final.final and t.apply_pass(final, at_stream_times(final, CONTEXT)) == []
    assert not t.active and not t.wants_pass()


def test_an_utterance_shown_in_a_partial_is_always_closed_by_a_final_if_with_no_words() -> None:
    t = _open_at_1s()
    (shown,) = t.apply_pass(t.prepare_pass(), result([("um", 0.1, 0.3)]))
    assert isinstance(shown, TranscriptUpdated)
    t.speech_stopped(t.samples / SR, voiced_end_s=1.05)  # ("um" starts after the last voiced audio: made up)
    (done,) = t.apply_pass(t.prepare_pass(), result([("um", 0.1, 0.3)]))
    assert isinstance(done, UtteranceFinalized) and done.utterance == shown.utterance and done.words == ()


def test_fresh_speech_after_a_final_is_no_continuation() -> None:
    t, _ = _finalized_at_a_pause()
    t.speech_stopped(4.2)
    t.apply_pass(t.prepare_pass(), result([("part.", 1.8, 2.2)]))
    feed(t, 2.0)
    onset = t.samples
    t.speech_started(onset / SR)
    feed(t, 0.5)
    t.speech_stopped(t.samples / SR)
    request = t.prepare_pass()
    assert request.start_sample == onset  # from its own onset: no context before it
    (final,) = t.apply_pass(request, result([("Next.", 0.6, 0.9)]))
    assert isinstance(final, UtteranceFinalized) and final.continues is None


@pytest.mark.parametrize(("probability", "shown"), [(0.2, ["hello"]), (0.9, ["hello", "world"])])
def test_an_unsure_last_word_at_the_end_of_the_audio_waits_for_the_next_pass(
    probability: float, shown: list[str]
) -> None:
    t = _open_at_1s()
    request = t.prepare_pass()
    end_s = len(request.audio) / SR  # "world" runs to the end of the audio: it may be cut off mid-word
    words = (Word("hello", 0.0, 0.1), Word("world", 0.12, end_s))
    cut = Transcription((Segment(0.0, end_s, words, 0.0, -0.1, (0.9, probability)),))
    (e,) = t.apply_pass(request, cut)
    assert isinstance(e, TranscriptUpdated) and texts(e.shown) == shown and e.text == " ".join(shown)
    assert texts(e.words) == ["hello", "world"]  # (drafts and barge-in still read the whole hypothesis)
    feed(t, 0.5)
    request = t.prepare_pass()
    heard_past = (Word("hello", 0.0, 0.1), Word("world", 0.12, end_s), Word("again", end_s + 0.1, end_s + 0.3))
    done = Transcription((Segment(0.0, end_s + 0.3, heard_past, 0.0, -0.1, (0.9, probability, 0.9)),))
    (e,) = t.apply_pass(request, done)  # a pass heard past it: shown, whatever its probability
    assert isinstance(e, TranscriptUpdated) and texts(e.words) == ["hello", "world", "again"]


@pytest.mark.parametrize(
    ("heard", "shown"),
    [
        ("which led me to lead me to lead", "which led me to lead"),
        ("in this regard. In this regard.", "in this regard."),
        ("what what what what", "what"),
        ("ask what, ask what", "ask what,"),
        ("ask what you can do", "ask what you can do"),  # (no loop: every word shown)
        ("that that", "that"),
    ],
)
def test_a_partial_pass_looping_at_the_end_of_its_audio_shows_the_phrase_once(heard: str, shown: str) -> None:
    t = _open_at_1s()
    words = [(w, 0.05 + 0.02 * i, 0.06 + 0.02 * i) for i, w in enumerate(heard.split())]
    (e,) = t.apply_pass(t.prepare_pass(), result(words))
    assert isinstance(e, TranscriptUpdated) and e.text == shown
    assert texts(e.words) == heard.split()  # (drafts and barge-in read every word: "stop stop stop")


def test_a_loop_is_held_back_only_where_its_words_are_not_committed() -> None:
    t = StreamingTranscriber(AsrConfig(agreement_n=2))
    feed(t, 1.0)
    t.speech_started(1.0)
    feed(t, 0.256)
    no_no = [("no", 0.05, 0.1), ("no", 0.12, 0.2)]
    (e,) = t.apply_pass(t.prepare_pass(), result(no_no))
    assert e.text == "no"
    feed(t, 0.256)
    (e,) = t.apply_pass(t.prepare_pass(), result(no_no))  # two passes agree: both committed, both shown
    assert isinstance(e, TranscriptUpdated) and (e.committed, e.text) == (2, "no no")


def test_the_final_pass_keeps_a_phrase_said_twice() -> None:
    t = _open_at_1s()
    t.apply_pass(t.prepare_pass(), result([("no", 0.05, 0.1), ("no", 0.12, 0.2)]))
    t.speech_stopped(1.25)
    request = t.prepare_pass()
    assert request.final
    (e,) = t.apply_pass(request, result([("no", 0.05, 0.1), ("no", 0.12, 0.2)]))
    assert isinstance(e, UtteranceFinalized) and texts(e.words) == ["no", "no"]
