"""Sliding-window streaming ASR (pure): which audio a pass covers, and what its result commits.

The window starts at the current utterance's onset (or at the last trim point) and ends at the newest
audio. A pass runs only while there is speech not yet decoded; its words go through LocalAgreement; the
window is trimmed at the end of a fully committed segment once it is `trim_after_s` long, and never
grows beyond `max_window_s`. When VAD reports the end of speech, one last pass over the audio up to
there commits everything and the utterance is final; where that pass heard the utterance whole, its words
are the final's, also those committed before (`asr.final_redecode`).
"""

from __future__ import annotations

import difflib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from duplexd.asr.commit import LocalAgreement, norm
from duplexd.asr.engine import ASR_SAMPLE_RATE, Transcription
from duplexd.config import AsrConfig
from duplexd.errors import ErrorCode
from duplexd.events import ErrorRaised, Event, TranscriptUpdated, UtteranceFinalized, Word

_FORCE_KEEP_S = 3.0  # when forced to trim, keep this much of the newest audio uncommitted
_CONTEXT_S = 1.5  # speech that resumes after a pause is decoded with (at least) this much of the speech before it
_CONTEXT_MIN_WORDS = 2  # ... and at least this many of its words, so the join is found by text, not by time
_CONTINUE_WITHIN_S = 6.0  # a pause's context is kept this long (speech resumes within VAD's hangover)
_ALIGN_SLACK = 3  # words beyond the context's length searched for it at a continuation's head
_TIME_TOLERANCE_S = 0.1
_ONSET_SLACK_S = 0.5  # a continuation's context word found again starts at most this long after its onset
_STALL_S = 1.0  # a continuation whose passes read nothing past its context this long after its onset drops it
_STALL_PASSES = 2  # ... once this many such passes did (one alone stops at a word its window's end cuts: "ask no-")
_PROMPT_FRAGMENT_WORDS = 1  # a continuation's prompt leaves out its sentence's start this short (`_without_fragment`)
_SAID_WORDS = 128  # committed words kept for the decoder prompt (it uses at most `prompt_chars` of them)
_SENTENCE_ENDS = (".", "?", "!")
_LOOP_MAX_WORDS = 4  # the longest phrase a partial pass's trailing repetition loop is looked for in


@dataclass(frozen=True, slots=True)
class PassRequest:
    """A snapshot for one engine pass: it stays valid while the stream moves on."""

    audio: np.ndarray
    prompt: str
    start_sample: int
    end_sample: int
    final: bool  # covers the utterance up to its end of speech
    generation: int  # which utterance it was taken for
    preview: bool = False  # its words are only shown: the final pass decides them all again


@dataclass(frozen=True, slots=True)
class _Resumable:
    """A final that speech resuming at a pause continues: its words, and where a continuation's window
    starts (a word boundary) with which of its words (`context`), found again by text."""

    utterance: int
    words: tuple[Word, ...]
    start: int
    context: tuple[Word, ...]


@dataclass(slots=True)
class _Next:
    onset_s: float  # where its speech began (its window starts where the open utterance ends, before it)
    end: int | None
    voiced_end_s: float | None = None
    continues: bool = False  # the same speech resumed after a pause (decode it with the audio before)


class AudioRing:
    """A bounded buffer of the newest 16 kHz samples, addressed by absolute stream sample index."""

    def __init__(self, capacity_samples: int) -> None:
        self._buf = np.zeros(capacity_samples, np.float32)
        self._start = 0  # absolute index of the oldest sample held
        self._len = 0

    @property
    def start(self) -> int:
        return self._start

    @property
    def end(self) -> int:
        return self._start + self._len

    def append(self, samples: np.ndarray) -> int:
        """Append; returns how many of the oldest samples were dropped to stay within capacity."""
        cap = len(self._buf)
        skipped = max(0, len(samples) - cap)  # leading samples that cannot fit still advance the index
        samples = samples[skipped:]
        overflow = max(0, self._len + len(samples) - cap)
        if overflow:
            self.drop_before(self._start + overflow)
        self._start += skipped
        self._buf[self._len : self._len + len(samples)] = samples
        self._len += len(samples)
        return overflow + skipped

    def drop_before(self, index: int) -> None:
        n = min(max(0, index - self._start), self._len)
        if n:
            self._buf[: self._len - n] = self._buf[n : self._len]
            self._len -= n
            self._start += n

    def read(self, start: int, end: int) -> np.ndarray:
        start, end = max(start, self._start), min(end, self.end)
        return self._buf[start - self._start : end - self._start].copy()


class StreamingTranscriber:
    def __init__(self, config: AsrConfig) -> None:
        self._config = config
        self._edge = int(config.partial_edge_s * ASR_SAMPLE_RATE)
        self._edge_probability = 1.0  # the decoder's probability of the latest hypothesis' last word
        self._ring = AudioRing(int(config.ring_s * ASR_SAMPLE_RATE))
        self._agreement = LocalAgreement(config.agreement_n)
        self._said: deque[Word] = deque(maxlen=_SAID_WORDS)  # finalized words, newest last (the prompt's source)
        # Speech that started after the open utterance's end of speech, before its final pass came back.
        self._next: _Next | None = None
        self._utterance = 0
        self._generation = 0
        self._active = False  # an utterance is open (speaking, or its final pass is still due)
        self._window_start = 0
        self._decoded_until = 0
        self._opened_at = 0  # where the open utterance's window began (its final pass may decide all its words)
        self._stretch_start = 0  # where the utterances the open one continues began (the prompt's reach)
        self._final_end: int | None = None
        self._voiced_end_s: float | None = None  # where VAD last heard speech in the open utterance
        self._resumable: _Resumable | None = None  # the last final, while speech may continue it
        self._continues: _Resumable | None = None  # the final the open utterance continues
        self._join: Word | None = None  # a continuation's pass found the last context word: as it read there
        self._read_new = False  # a pass of this continuation has read words past its context
        self._stalled = 0  # its partial passes that heard `_STALL_S` of its speech and read only the context
        self._onset_s = 0.0  # where the open utterance's own speech began (a continuation's window starts before)
        self._committed: list[Word] = []  # of the open utterance, including words trimmed out of the window
        self._last_partial: tuple[tuple[Word, ...], int, int] | None = None
        self._in_flight = False
        self._behind = False  # the ring overflowed and no pass has come back since
        self.context_drops = 0  # continuations decoded alone from their stall on (`_drop_context`)

    # -- audio and VAD -------------------------------------------------------------------------------

    def retune(self, config: AsrConfig) -> None:
        """New settings from the next pass on (a Realtime client's `prefix_padding_ms` sets `preroll_s`); the
        audio ring keeps the size it was built with."""
        self._config = replace(config, ring_s=self._config.ring_s)
        self._edge = int(config.partial_edge_s * ASR_SAMPLE_RATE)

    @property
    def samples(self) -> int:
        return self._ring.end

    def append(self, samples: np.ndarray) -> list[Event]:
        dropped = self._ring.append(samples)
        if not self._active:
            self._ring.drop_before(self._idle_floor())
            return []
        if dropped and self._ring.start > self._window_start:
            # Passes fell so far behind that the bounded ring overflowed: say so (once until the recognizer
            # catches up), never silently.
            lost_s = (self._ring.start - self._window_start) / ASR_SAMPLE_RATE
            self._window_start = self._ring.start
            self._decoded_until = max(self._decoded_until, self._window_start)
            self._agreement.reset()
            if not self._behind:
                self._behind = True
                return [ErrorRaised(ErrorCode.ASR_BEHIND, f"recognizer fell behind; {lost_s:.2f}s of audio skipped")]
        return []

    def speech_started(self, t_s: float, *, continues: bool = False) -> None:
        """Speech from `t_s` on. `continues`: the speech that was finalized at a pause goes on. The next
        utterance is then decoded with the end of the finalized one before it (its last words, at least
        `_CONTEXT_S` of them), for words cut short of context ("smooth planks" alone came out "moth
        plinks") and so the join reads as one sentence; those words are found again by text and not
        repeated, and how they read joined ("best." -> "best") comes with the final."""
        if not self._active:
            # (the ring keeps context while idle; a fresh onset still reaches back only `preroll_s`)
            floor = self._ring.start if continues else self._ring.end - int(self._config.preroll_s * ASR_SAMPLE_RATE)
            self._open(max(int(t_s * ASR_SAMPLE_RATE), self._ring.start, floor), continues=continues)
        elif self._final_end is None:
            pass  # still inside the open utterance (its end of speech was not reported)
        elif self._next is None:
            self._next = _Next(t_s, end=None, continues=continues)  # the open utterance keeps its end; this is next
        else:
            # The recognizer is more than one utterance behind: the newest speech extends the queued one, so
            # a session never waits on more than two final passes however fast its pauses come.
            self._next.end = None

    def speech_stopped(self, t_s: float, voiced_end_s: float | None = None) -> None:
        """End of speech at `t_s` (with VAD's pad); `voiced_end_s`: the end of the last audio VAD called
        speech. A final word that only starts after it was made up from silence (Whisper completes a cut-off
        phrase: "slid on the" + silence -> "slid on the screen.") and is dropped."""
        if not self._active:
            return
        end = min(max(int(t_s * ASR_SAMPLE_RATE), self._window_start), self._ring.end)
        if self._next is not None:
            self._next.end = end
            self._next.voiced_end_s = voiced_end_s
        else:
            self._final_end = end
            self._voiced_end_s = voiced_end_s

    def _open(self, start: int, *, continues: bool = False, onset_s: float | None = None) -> None:
        self._active = True
        self._utterance += 1
        self._generation += 1
        self._continues = self._resumable if continues else None
        self._join = None
        self._read_new = False
        self._stalled = 0
        self._onset_s = start / ASR_SAMPLE_RATE if onset_s is None else max(onset_s, start / ASR_SAMPLE_RATE)
        if self._continues is not None:
            start = max(self._ring.start, min(start, self._continues.start))
            self._agreement = LocalAgreement(self._config.agreement_n)  # (new words are told apart by text)
        elif continues:
            start = max(self._ring.start, start - int(_CONTEXT_S * ASR_SAMPLE_RATE))
        else:
            self._resumable = None
        self._window_start = self._decoded_until = self._opened_at = start
        if not continues:
            self._stretch_start = start
        self._final_end = None
        self._voiced_end_s = None
        self._next = None
        self._committed = []
        self._last_partial = None
        self._agreement.reset()

    # -- passes --------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """An utterance is open (its speech is being, or still has to be, transcribed)."""
        return self._active

    def pending_since_s(self) -> float:
        """Stream time of the oldest audio not yet covered by a pass (for fair scheduling)."""
        return self._decoded_until / ASR_SAMPLE_RATE

    @property
    def final_due(self) -> bool:
        """The open utterance's end of speech is known: its next pass is (or covers) the final one."""
        return self._final_end is not None

    def wants_pass(self) -> bool:
        if not self._active or self._in_flight:
            return False
        if self._final_end is not None:
            return True
        return self._ring.end - self._decoded_until >= self._config.min_new_audio_s * ASR_SAMPLE_RATE

    def _next_end(self) -> tuple[int, bool]:
        """Where the next pass would end, and whether it would be the utterance's final one."""
        end = self._ring.end if self._final_end is None else self._final_end
        limit = self._window_start + int(self._config.max_window_s * ASR_SAMPLE_RATE)
        return min(end, limit), self._final_end is not None and end <= limit

    def next_window_s(self) -> float:
        """Seconds of audio the next pass would transcribe (its cost, for the ASR scheduler)."""
        return max(0, self._next_end()[0] - self._window_start) / ASR_SAMPLE_RATE

    def next_preview(self) -> bool:
        """Whether the next pass would be a preview (its own cost, for the ASR scheduler)."""
        return self._previews(*self._next_end())

    def prepare_pass(self) -> PassRequest:
        if not self.wants_pass():
            raise RuntimeError("prepare_pass() called with no pass due")
        end, final = self._next_end()
        self._in_flight = True
        return PassRequest(
            audio=self._ring.read(self._window_start, end),
            prompt=self._prompt_text(),
            start_sample=self._window_start,
            end_sample=end,
            final=final,
            generation=self._generation,
            preview=self._previews(end, final),
        )

    def _previews(self, end: int, final: bool) -> bool:
        """Whether a pass ending at `end` is a preview: the final pass will hear the whole utterance and
        decide its words again (`_final_words`), and no trim can keep any of them before that."""
        cfg = self._config
        return (
            cfg.final_redecode
            and cfg.preview_encoder_s < 30.0
            and not final
            and self._final_end is None
            and self._window_start == self._opened_at
            and end - self._window_start < cfg.trim_after_s * ASR_SAMPLE_RATE
        )

    @property
    def pass_in_flight(self) -> bool:
        return self._in_flight

    def abort_pass(self, request: PassRequest) -> list[Event]:
        """The engine failed on `request`: skip its audio (said aloud, not silently) so nothing spins."""
        self._in_flight = False
        if request.generation != self._generation or not self._active:
            return []
        self._decoded_until = max(self._decoded_until, request.end_sample)
        events: list[Event] = [ErrorRaised(ErrorCode.INTERNAL, "speech recognition failed for part of the audio")]
        if request.final:
            events.extend(self.finish_final_without_pass())
        return events

    def finish_final_without_pass(self) -> list[Event]:
        """End the open utterance with what is decoded so far (used when the stream itself ends)."""
        if not self._active:
            return []
        return self._finalize(self._agreement.commit_all())

    def apply_pass(self, request: PassRequest, result: Transcription) -> list[Event]:
        self._in_flight = False
        self._behind = False
        if request.generation != self._generation or not self._active:
            return []
        offset_s = request.start_sample / ASR_SAMPLE_RATE
        words = [Word(w.text, w.start_s + offset_s, w.end_s + offset_s) for w in result.words]
        if self._continues is not None:
            # (its window holds the context's words, which were said: a pass that reads nothing at all failed.
            # A final that fails is run again without the context: clip06's "review." | "of activities
            # they're under" read nothing four passes running, and the final too, and the words were lost.
            # A partial pass that fails is a glitch of that one window, and the context is kept: clip06 in
            # the voice loop read "of active." over 2.1 s, nothing over 2.7 s, "of activities they're
            # under." over 3.5 s; dropping the context at the empty pass started the window at the end of
            # "review.", mid-way into the short "of", and the final read "activities they're under.")
            failed = not words
            words = self._after_context(words)
            # (A final that reads the context and stops there is run again alone too where its new speech had
            # words: a pass read some, or stopped at the context with a second of speech in its window. Else
            # the new speech was a breath or a cough, and the final has no words.)
            lost = self._ends_utterance(request) and not words and (self._read_new or self._stalled > 0)
            self._read_new = self._read_new or bool(words)
            late = request.end_sample / ASR_SAMPLE_RATE - self._onset_s >= _STALL_S
            self._stalled += not self._read_new and not request.final and late
            if (failed and request.final) or lost or self._stalled >= _STALL_PASSES:
                self._drop_context()
                return []
            if failed:
                self._decoded_until = max(self._decoded_until, request.end_sample)
                return []
        self._decoded_until = max(self._decoded_until, request.end_sample)
        newly = self._agreement.insert(words)
        last = result.segments[-1] if result.segments else None
        # (an engine that reports no probabilities is taken at its word)
        self._edge_probability = last.probabilities[-1] if last is not None and last.probabilities else 1.0
        if self._ends_utterance(request):
            return self._finalize(self._final_words(request, words, [*newly, *self._agreement.commit_all()]))
        self._committed.extend(newly)
        self._trim(request, result)
        return self._partial()

    def _ends_utterance(self, request: PassRequest) -> bool:
        """The final pass, or one already covering everything up to the end of speech: as good as the final
        (the rest of the audio is silence), so the utterance ends now instead of after one more ~1 s pass.
        (Not a preview: its words are the ones the final decides again.)"""
        return request.final or (
            self._final_end is not None
            and self._next is None
            and request.end_sample >= self._final_end
            and not request.preview
        )

    def _final_words(self, request: PassRequest, heard: list[Word], agreed: list[Word]) -> list[Word]:
        """The words the final pass adds (`agreed`: those LocalAgreement left open), or, with
        `final_redecode`, the utterance's words as that pass `heard` them all, where its window is the whole
        utterance (never trimmed) and it read as far as the words committed before (a pass that stopped
        short of them, or read nothing, is not taken over them)."""
        if not self._config.final_redecode or request.start_sample != self._opened_at or not heard:
            return agreed
        before = [*self._committed, *agreed]
        if before and heard[-1].end_s < before[-1].start_s:
            return agreed
        self._committed = []
        return heard

    def _finalize(self, newly: list[Word]) -> list[Event]:
        if self._voiced_end_s is not None:  # (words already committed are out: only the new ones go)
            newly = [w for w in newly if w.start_s < self._voiced_end_s]
        self._committed.extend(newly)
        continued, previous = self._joined()
        words = tuple(self._committed)
        if self._continues is not None and self._join is None:  # (read without its context: see _sentence_cased)
            words = _sentence_cased(words, self._continues.words[-1])
        if previous is not None and self._continues and self._said and self._said[-1] == self._continues.words[-1]:
            self._said[-1] = previous[-1]  # (later prompts read the join as it reads now: "best" | "part of")
        self._said.extend(words)
        events: list[Event] = []
        if words or self._last_partial is not None:  # (an utterance shown is always closed, if with no words)
            events.append(UtteranceFinalized(self._utterance, words, continued, previous))
        # (a continuation's context reaches back into the utterance it continued where its own words are few,
        # as they read joined)
        before = previous or (self._continues.words if self._continues is not None else ())
        self._resumable = _resumable(self._utterance, words, (*before, *words), self._window_start) if words else None
        end = self._final_end if self._final_end is not None else self._ring.end
        self._active = False
        self._final_end = None
        self._window_start = self._decoded_until = end
        self._committed = []
        self._agreement.reset()
        if self._next is not None:  # speech resumed before this final pass: it is the next utterance
            queued = self._next
            self._open(end, continues=queued.continues, onset_s=queued.onset_s)
            self._final_end, self._voiced_end_s = queued.end, queued.voiced_end_s
        else:
            self._ring.drop_before(self._idle_floor())
        return events

    # -- continuing an utterance finalized at a pause -------------------------------------------------

    def _idle_floor(self) -> int:
        """The oldest sample to keep while no utterance is open: the preroll and context of a fresh onset,
        or the start of a continuation's window while speech could still resume (it does within VAD's
        silence hangover, so a context older than `_CONTINUE_WITHIN_S` is let go)."""
        floor = self._ring.end - int((self._config.preroll_s + _CONTEXT_S) * ASR_SAMPLE_RATE)
        resumable = self._resumable
        if resumable is not None and self._ring.end - resumable.start <= _CONTINUE_WITHIN_S * ASR_SAMPLE_RATE:
            floor = min(floor, resumable.start)
        return floor

    def _drop_context(self) -> None:
        """The continuation's passes read the context and stop there, its new speech unread: Whisper ended
        the sentence at the context's last word ("... his gospel." and nothing of a talk-over that followed,
        a new speaker), so nothing was shown until the final pass; or a pass read nothing at all. From now
        on it is an utterance of its own, decoded from the end of the context's last word (or of its own
        committed words, or its onset less the preroll, whichever is latest). A final pass is run again."""
        assert self._continues is not None
        self.context_drops += 1
        onset = int(self._onset_s * ASR_SAMPLE_RATE) - int(self._config.preroll_s * ASR_SAMPLE_RATE)
        context_end = int(self._continues.context[-1].end_s * ASR_SAMPLE_RATE)
        committed_end = int(self._committed[-1].end_s * ASR_SAMPLE_RATE) if self._committed else 0
        self._continues = None
        self._join = None
        start = max(self._ring.start, onset, context_end, committed_end)
        if self._final_end is not None:
            start = min(start, self._final_end)
        self._window_start = self._decoded_until = self._stretch_start = start
        self._agreement.reset()

    def _after_context(self, words: list[Word]) -> list[Word]:
        """A continuation's hypothesis without the context words it decoded again, found by text (their
        times jitter across the pause by more than any tolerance). The last of them, as it reads now, is
        the join. When the hypothesis does not hold them, words that start after the context are new."""
        assert self._continues is not None
        context = [norm(w.text) for w in self._continues.context]
        head = [norm(w.text) for w in words[: len(context) + _ALIGN_SLACK]]
        matcher = difflib.SequenceMatcher(a=context, b=head, autojunk=False)
        blocks = [b for b in matcher.get_matching_blocks() if b.size]
        if blocks:
            last = blocks[-1]
            matched, cut = last.a + last.size, last.b + last.size  # (context words found, hypothesis words)
            # The context's last words heard again but spelled another way ("your seatbelts." | "your seat
            # belts. We are": the same audio twice in the transcript): the words that spell them are theirs.
            respelled = _respelled("".join(context[matched:]), head[cut:])
            cut += respelled
            # (found again where their audio is: before the new speech began, not in it: JFK's "... can do
            # for you" | "ask what you can do for your country" matched "can do for" in the new words, six
            # dropped)
            found = matched >= len(context) - 1 or respelled > 0
            if found and words[cut - 1].start_s <= self._onset_s + _ONSET_SLACK_S:
                if matched < len(context) and not respelled and cut < len(words) and words[cut].end_s <= self._onset_s:
                    # The context's last word read again another way: its audio ended before the new speech
                    # began ("1813, eight." | "1813, 8 the press yard": "8" is "eight", not a new word).
                    matched, cut = matched + 1, cut + 1
                if matched == len(context):
                    self._join = words[cut - 1]
                return words[cut:]
        end_s = self._continues.context[-1].end_s
        return [w for w in words if w.start_s >= end_s - _TIME_TOLERANCE_S]

    def _joined(self) -> tuple[int | None, tuple[Word, ...] | None]:
        """For a continuation's final: the utterance it continues, and that one's words as they read joined
        with it (its last word as the continuation's pass decoded it with what followed), if they changed."""
        if self._continues is None:
            return None, None
        number, words = self._continues.utterance, self._continues.words
        if self._join is None or words[-1].text == self._join.text:
            return number, None
        return number, (*words[:-1], Word(self._join.text, words[-1].start_s, words[-1].end_s))

    def _partial(self) -> list[Event]:
        tentative = self._agreement.tentative
        at_edge = tentative and tentative[-1].end_s * ASR_SAMPLE_RATE >= self._decoded_until - self._edge
        # The last word runs to the end of the audio: it may be a word cut off mid-way, which the decoder
        # completes as it likes ("She..." -> "Shit."). Shown once a pass has heard past it.
        unsure = int(bool(at_edge) and self._edge_probability < self._config.partial_edge_probability)
        words = (*self._committed, *tentative)
        # Where the audio stops mid-word the decoder can loop ("which led me to lead me to lead", "in this
        # regard. in this regard."), a preview the more: the repeats are held back too. Drafts and barge-in
        # still read them (a user saying "stop stop stop" over a reply), and the final pass decides them.
        unsure = max(unsure, min(len(tentative), _trailing_loop(words)))
        state = (words, len(self._committed), unsure)
        if not words or state == self._last_partial:
            return []
        self._last_partial = state
        return [TranscriptUpdated(self._utterance, words, len(self._committed), unsure)]

    def _trim(self, request: PassRequest, result: Transcription) -> None:
        """Keep windows short: every pass decodes its whole window again, so its cost grows with it."""
        window_s = (request.end_sample - self._window_start) / ASR_SAMPLE_RATE
        if window_s < self._config.trim_after_s:
            return
        offset_s = request.start_sample / ASR_SAMPLE_RATE
        committed_end_s = self._agreement.committed_end_s
        cut_s: float | None = None
        for seg in result.segments[:-1]:  # a segment followed by another one has really ended
            if seg.end_s + offset_s <= committed_end_s + 1e-6:
                cut_s = seg.end_s + offset_s
        for word in self._committed:  # so has a committed sentence
            if word.text.endswith(_SENTENCE_ENDS) and word.end_s * ASR_SAMPLE_RATE > self._window_start:
                cut_s = max(cut_s or 0.0, word.end_s)
        forced = window_s >= self._config.max_window_s - _FORCE_KEEP_S
        if cut_s is not None and not forced and not self._heard_alike(result, offset_s, cut_s):
            return  # (a full pass reads the words a trim would keep otherwise: wait, the final may decide them)
        if cut_s is None and forced:
            # No committed segment end: force-commit all but the newest audio so the window stays bounded.
            horizon_s = request.end_sample / ASR_SAMPLE_RATE - _FORCE_KEEP_S
            self._committed.extend(self._agreement.commit_until(horizon_s))
            cut_s = max(self._agreement.committed_end_s, self._window_start / ASR_SAMPLE_RATE)
        if cut_s is not None and int(cut_s * ASR_SAMPLE_RATE) > self._window_start:
            self._window_start = int(cut_s * ASR_SAMPLE_RATE)
            self._ring.drop_before(self._window_start)

    def _heard_alike(self, result: Transcription, offset_s: float, cut_s: float) -> bool:
        """Whether this pass read the committed words a trim at `cut_s` would keep as they were committed.
        Previews commit words too, from a shorter encoder input; a trim makes them the utterance's for good
        (its final no longer hears them), so it waits for a full pass that reads them alike. On the
        meeting and lecture clips, trims at preview-committed words read 12-17 % more words unlike offline."""
        start_s = self._window_start / ASR_SAMPLE_RATE - _TIME_TOLERANCE_S
        kept = [norm(w.text) for w in self._committed if w.start_s >= start_s and w.end_s <= cut_s + 1e-6]
        read = [norm(w.text) for w in result.words if w.start_s + offset_s < cut_s + _TIME_TOLERANCE_S]
        matcher = difflib.SequenceMatcher(a=kept, b=read, autojunk=False)
        return sum(b.size for b in matcher.get_matching_blocks()) == len(kept)

    def _prompt_text(self) -> str:
        """The last `prompt_chars` characters of the committed text that precedes the window (text whose
        audio is in the window would make the decoder skip that audio), from a word boundary, in the same
        stretch of speech: the open utterance's own words trimmed out of its window, and where it continues
        the utterance before (speech that resumed within `continue_gap_s`), the words of the utterances it
        continues. An utterance of its own is decoded without a prompt: after a longer silence the text
        before is as often another topic or another voice, and tiny.en read the new speech in its light
        (after other clips, clip21's "seat belts" came out "seatbelts", which the clip alone reads right;
        docs/benchmarks.md, "An utterance of its own has no prompt")."""
        before_s = self._window_start / ASR_SAMPLE_RATE + 1e-6
        since_s = self._stretch_start / ASR_SAMPLE_RATE - 1e-6
        said = [w for w in self._said if w.start_s >= since_s]
        words = [w.text for w in (*said, *self._committed) if w.end_s <= before_s]
        if self._continues is not None:
            words = _without_fragment(words)
        text = ""
        for word in reversed(words):
            if len(text) + len(word) + 1 > self._config.prompt_chars:
                break
            text = f"{word} {text}" if text else word
        return text


def _without_fragment(words: list[str]) -> list[str]:
    """A continuation's prompt `words` without the start of the sentence its window goes on with, where
    that start is `_PROMPT_FRAGMENT_WORDS` words or fewer: prompted with "The" before "child almost hurt |
    the small dog", tiny.en read the window as a title ("Child Almost Hurt The Small Dog."). Longer starts
    stay ("I will" | "say nothing of my antecedents, nor of": without them, "Say nothing ... antecedents.
    Nor of")."""
    k = len(words)
    while k > 0 and not words[k - 1].endswith(_SENTENCE_ENDS):
        k -= 1
    return words[:k] if 0 < len(words) - k <= _PROMPT_FRAGMENT_WORDS else words


def _sentence_cased(words: tuple[Word, ...], before: Word) -> tuple[Word, ...]:
    """A continuation's `words`, decoded without its context, with a capital first letter where the words
    it continues end a sentence (`before`): a window that starts inside the sentence before is decoded
    mid-sentence, and the words kept by time read as the middle of one ("I'm Abigail Klafflin." | "you can
    call me Abby."). A pass that read the context and the new words together decides their case itself."""
    if not words or not before.text.endswith(_SENTENCE_ENDS) or not words[0].text[:1].islower():
        return words
    first = words[0]
    return (replace(first, text=first.text[0].upper() + first.text[1:]), *words[1:])


def _trailing_loop(words: Sequence[Word]) -> int:
    """How many words at the end of `words` repeat the phrase (up to `_LOOP_MAX_WORDS` words) before them,
    as often as they do: 3 for "... which led me to lead me to lead", 3 for "what what what what"."""
    keys = [norm(w.text) for w in words]
    end = len(keys)
    while n := next((n for n in range(1, _LOOP_MAX_WORDS + 1) if end >= 2 * n and _repeats(keys, end, n)), 0):
        end -= n
    return len(keys) - end


def _repeats(keys: list[str], end: int, n: int) -> bool:
    return keys[end - n : end] == keys[end - 2 * n : end - n]


def _respelled(text: str, head: Sequence[str]) -> int:
    """How many of the first words of `head` (normalized) spell `text` together, without spaces (at most
    three: "seat", "belts" for "seatbelts"); 0 if none do, or `text` is empty."""
    if not text:
        return 0
    spelled = ""
    for k, word in enumerate(head[:3], 1):
        spelled += word
        if not text.startswith(spelled):
            return 0
        if spelled == text:
            return k
    return 0


def _resumable(utterance: int, words: tuple[Word, ...], heard: tuple[Word, ...], window_start: int) -> _Resumable:
    """What a continuation of this final decodes again: of the words `heard` in its window (its own, after
    those of the utterance it continued), those that start within `_CONTEXT_S` of its end (at least
    `_CONTEXT_MIN_WORDS`), from the end of the word before them (a word boundary, so no word is cut in
    half), else from its window's start."""
    k = len(heard) - 1
    while k > 0 and (len(heard) - k < _CONTEXT_MIN_WORDS or heard[k - 1].start_s >= heard[-1].end_s - _CONTEXT_S):
        k -= 1
    start_s = heard[k - 1].end_s if k > 0 else window_start / ASR_SAMPLE_RATE
    return _Resumable(utterance, words, max(window_start, int(start_s * ASR_SAMPLE_RATE)), heard[k:])
