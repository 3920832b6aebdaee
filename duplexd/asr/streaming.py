"""Sliding-window streaming ASR (pure): which audio a pass covers, and what its result commits.

The window starts at the current utterance's onset (or at the last trim point) and ends at the newest
audio. A pass runs only while there is speech not yet decoded; its words go through LocalAgreement; the
window is trimmed at the end of a fully committed segment once it is `trim_after_s` long, and never
grows beyond `max_window_s`. When VAD reports the end of speech, one last pass over the audio up to
there commits everything and the utterance is final.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from duplexd.asr.commit import LocalAgreement
from duplexd.asr.engine import ASR_SAMPLE_RATE, Transcription
from duplexd.config import AsrConfig
from duplexd.errors import ErrorCode
from duplexd.events import ErrorRaised, Event, TranscriptUpdated, UtteranceFinalized, Word

_FORCE_KEEP_S = 3.0  # when forced to trim, keep this much of the newest audio uncommitted
_CONTEXT_S = 1.5  # speech that resumes after a pause is decoded with this much of the audio before it
_SENTENCE_ENDS = (".", "?", "!")


@dataclass(frozen=True, slots=True)
class PassRequest:
    """A snapshot for one engine pass: it stays valid while the stream moves on."""

    audio: np.ndarray
    prompt: str
    start_sample: int
    end_sample: int
    final: bool  # covers the utterance up to its end of speech
    generation: int  # which utterance it was taken for


@dataclass(slots=True)
class _Next:
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
        self._ring = AudioRing(int(config.ring_s * ASR_SAMPLE_RATE))
        self._agreement = LocalAgreement(config.agreement_n)
        self._prompt = ""
        # Speech that started after the open utterance's end of speech, before its final pass came back.
        self._next: _Next | None = None
        self._utterance = 0
        self._generation = 0
        self._active = False  # an utterance is open (speaking, or its final pass is still due)
        self._window_start = 0
        self._decoded_until = 0
        self._final_end: int | None = None
        self._voiced_end_s: float | None = None  # where VAD last heard speech in the open utterance
        self._new_from_s: float | None = None  # words before this are context (the previous utterance's)
        self._committed: list[Word] = []  # of the open utterance, including words trimmed out of the window
        self._last_partial: tuple[tuple[Word, ...], int] | None = None
        self._in_flight = False
        self._behind = False  # the ring overflowed and no pass has come back since
        self._prompt_until_s = 0.0

    # -- audio and VAD -------------------------------------------------------------------------------

    def retune(self, config: AsrConfig) -> None:
        """New settings from the next pass on (a Realtime client's `prefix_padding_ms` sets `preroll_s`); the
        audio ring keeps the size it was built with."""
        self._config = replace(config, ring_s=self._config.ring_s)

    @property
    def samples(self) -> int:
        return self._ring.end

    def append(self, samples: np.ndarray) -> list[Event]:
        dropped = self._ring.append(samples)
        if not self._active:
            keep_s = self._config.preroll_s + _CONTEXT_S
            self._ring.drop_before(self._ring.end - int(keep_s * ASR_SAMPLE_RATE))
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
        """Speech from `t_s` on. `continues`: the speech that was finalized at a pause goes on (the next
        utterance is decoded with the audio before it as context, for words cut short of context
        ("smooth planks" alone came out "moth plinks"); its words from before `t_s` are not repeated)."""
        if not self._active:
            # (the ring keeps context while idle; a fresh onset still reaches back only `preroll_s`)
            floor = self._ring.start if continues else self._ring.end - int(self._config.preroll_s * ASR_SAMPLE_RATE)
            self._open(max(int(t_s * ASR_SAMPLE_RATE), self._ring.start, floor), continues=continues)
        elif self._final_end is None:
            pass  # still inside the open utterance (its end of speech was not reported)
        elif self._next is None:
            self._next = _Next(end=None, continues=continues)  # the open utterance keeps its end; this is next
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

    def _open(self, start: int, *, continues: bool = False) -> None:
        self._active = True
        self._utterance += 1
        self._generation += 1
        self._new_from_s = start / ASR_SAMPLE_RATE if continues else None
        if continues:
            start = max(self._ring.start, start - int(_CONTEXT_S * ASR_SAMPLE_RATE))
        self._window_start = self._decoded_until = start
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
        if self._new_from_s is not None:
            words = [w for w in words if w.start_s >= self._new_from_s]
        self._decoded_until = max(self._decoded_until, request.end_sample)
        newly = self._agreement.insert(words)
        # A pass already covering everything up to the end of speech is as good as the final pass (the rest
        # of the audio is silence): end the utterance now instead of running one more ~1 s pass.
        covered = self._final_end is not None and self._next is None and request.end_sample >= self._final_end
        if request.final or covered:
            return self._finalize([*newly, *self._agreement.commit_all()])
        self._committed.extend(newly)
        self._trim(request, result)
        return self._partial()

    def _finalize(self, newly: list[Word]) -> list[Event]:
        if self._voiced_end_s is not None:  # (words already committed are out: only the new ones go)
            newly = [w for w in newly if w.start_s < self._voiced_end_s]
        self._committed.extend(newly)
        words = tuple(self._committed)
        self._remember_prompt(words)
        events: list[Event] = [UtteranceFinalized(self._utterance, words)] if words else []
        end = self._final_end if self._final_end is not None else self._ring.end
        self._active = False
        self._final_end = None
        self._window_start = self._decoded_until = end
        self._committed = []
        self._agreement.reset()
        if self._next is not None:  # speech resumed before this final pass: it is the next utterance
            next_end, next_voiced, continues = self._next.end, self._next.voiced_end_s, self._next.continues
            self._open(end, continues=continues)
            self._final_end = next_end
            self._voiced_end_s = next_voiced
        else:
            self._ring.drop_before(end - int((self._config.preroll_s + _CONTEXT_S) * ASR_SAMPLE_RATE))
        return events

    def _partial(self) -> list[Event]:
        words = (*self._committed, *self._agreement.tentative)
        state = (words, len(self._committed))
        if not words or state == self._last_partial:
            return []
        self._last_partial = state
        return [TranscriptUpdated(self._utterance, words, len(self._committed))]

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
        if cut_s is None and window_s >= self._config.max_window_s - _FORCE_KEEP_S:
            # No committed segment end: force-commit all but the newest audio so the window stays bounded.
            horizon_s = request.end_sample / ASR_SAMPLE_RATE - _FORCE_KEEP_S
            self._committed.extend(self._agreement.commit_until(horizon_s))
            cut_s = max(self._agreement.committed_end_s, self._window_start / ASR_SAMPLE_RATE)
        if cut_s is not None and int(cut_s * ASR_SAMPLE_RATE) > self._window_start:
            self._remember_prompt(tuple(w for w in self._committed if w.end_s <= cut_s + 1e-6))
            self._window_start = int(cut_s * ASR_SAMPLE_RATE)
            self._ring.drop_before(self._window_start)

    def _prompt_text(self) -> str:
        """The last `prompt_chars` characters of committed text, starting at a word boundary."""
        limit = self._config.prompt_chars
        if len(self._prompt) <= limit:
            return self._prompt
        tail = self._prompt[len(self._prompt) - limit :]
        return tail.split(" ", 1)[1] if " " in tail else ""

    def _remember_prompt(self, words: tuple[Word, ...]) -> None:
        """Committed text that has left the window conditions later passes."""
        fresh = [w for w in words if w.end_s > self._prompt_until_s]
        if fresh and self._config.prompt_chars:
            text = " ".join(w.text for w in fresh)
            self._prompt = (self._prompt + " " + text).strip()[-4 * self._config.prompt_chars :]
            self._prompt_until_s = fresh[-1].end_s
