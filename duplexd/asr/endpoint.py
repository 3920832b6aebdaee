"""End of the user's turn: VAD silence, weighed by how finished the words are. Pure.

The dialog LLM has already ingested the committed words, so its probability that the next token closes
the user's turn is a free semantic completeness score: a finished question ends the turn after a short
silence, a sentence cut mid-phrase ("I want to go to the") waits long enough for the user to go on.

    endpointer.silence_needed_ms(p_end, text, p_audio)            # how long to wait for this turn
    endpointer.turn_over(silence_ms, text_final, p_end, p_audio)  # decide, given what is known now

`p_audio` is the acoustic side (`asr.turn_audio`): how the speech before the pause sounded. Said
mid-phrase (below `turn.audio_incomplete`), the turn waits `max_silence_ms` whatever the text says; it
takes `turn.audio_complete` to let the text's shorter wait stand (between the two, the audio's wait falls
linearly from `max_silence_ms` to `min_silence_ms`, and the turn waits the longer of the two). Where
no model scores the words (`text_scored` False: a remote LLM, which returns text only, without
`dialog.turn_model`), the audio is the whole turn signal: speech that sounds finished ends the turn after
`min_silence_ms`, as a complete sentence does with the local LLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from duplexd.config import TurnConfig

# A transcript that trails off ("so I went to...", "and then,") is unfinished whatever the LLM says:
# Whisper writes an ellipsis where the speaker paused mid-sentence.
_TRAILING = ("...", "…", ",", "-", "—")


@dataclass(frozen=True, slots=True)
class Endpointer:
    config: TurnConfig

    def silence_needed_ms(
        self, p_end: float | None, text: str = "", p_audio: float | None = None, *, text_scored: bool = True
    ) -> float:
        """Silence after the last speech that ends a turn whose text has P(end of turn) = `p_end`, and whose
        audio sounds finished with probability `p_audio` (None: not known). Each signal asks for a wait
        (short when it finds the turn complete, `max_silence_ms` when it finds it unfinished); the turn
        waits the longer of the two. `text_scored` False: no P(end of turn) will come for the text, the
        audio decides alone."""
        c = self.config
        if text.rstrip().endswith(_TRAILING):
            return float(c.max_silence_ms)
        audio_ms = None if p_audio is None else self._wait_ms(p_audio, c.audio_incomplete, c.audio_complete)
        if p_end is None:  # (with the text unscored, the audio is the evidence there is)
            return float(audio_ms if audio_ms is not None and not text_scored else c.max_silence_ms)
        log_p = math.log(p_end) if p_end > 0 else -math.inf
        text_ms = self._wait_ms(log_p, math.log(c.p_incomplete), math.log(c.p_complete))
        return max(text_ms, audio_ms or 0.0)

    def _wait_ms(self, x: float, unfinished: float, complete: float) -> float:
        """`max_silence_ms` at or below `unfinished`, `min_silence_ms` at or above `complete`, linear between."""
        c = self.config
        if x >= complete:
            return float(c.min_silence_ms)
        if x <= unfinished:
            return float(c.max_silence_ms)
        done = (x - unfinished) / (complete - unfinished)
        return c.max_silence_ms - done * (c.max_silence_ms - c.min_silence_ms)

    def turn_over(
        self,
        *,
        silence_ms: float,
        text_final: bool,
        text: str,
        p_end: float | None,
        p_audio: float | None = None,
        text_scored: bool = True,
    ) -> bool:
        """True once the user has said something, the recognizer has settled it, and the silence since the
        last speech is long enough for how complete it sounds."""
        if not text.strip() or not text_final:
            return False
        return silence_ms >= self.silence_needed_ms(p_end, text, p_audio, text_scored=text_scored)
