"""One session's conversation: turns, replies, barge-in. Pure: the shell feeds it what the recognizer, the
dialog engine, TTS and the client report, and carries out the commands it returns.

    transcript events -> observe()      -> AppendUserText (committed words stream into the LLM)
    every tick        -> tick()         -> TurnEnded + StartReply, once the endpointer says the turn is over;
                                           DraftReply while the user pauses (speculative listening)
    reply text        -> reply_text()   -> ReplyDelta + Synthesize (pieces cut by the TextChunker)
    TTS audio         -> audio_ready()  -> PlayAudio (in order), EndAudio once the whole reply is voiced
    audio sent        -> audio_sent()   -> ReplyDone
    speech over reply -> tick()         -> PauseAudio + ReplyPaused (VAD alone, before any word)
                      -> tick()         -> ResumeAudio + ReplyResumed (no word that interrupts came of it)
    user talks over   -> observe()      -> InterruptReply + StopAudio + ReplyInterrupted (context = what was heard)

Times: `stream_s` is seconds of input audio (the client's timeline); output audio is counted in samples
of the 24 kHz output stream, the timeline of the client's `playback.played_ms`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from enum import Enum
from typing import TypeVar

from duplexd.asr.endpoint import Endpointer
from duplexd.commands import (
    AppendUserText,
    Command,
    DraftReply,
    EndAudio,
    InterruptReply,
    PauseAudio,
    PlayAudio,
    PrefetchSpeech,
    ReplaceContext,
    ResumeAudio,
    RetractUserText,
    StartReply,
    StopAudio,
    Synthesize,
)
from duplexd.config import TtsConfig, TurnConfig
from duplexd.events import (
    Event,
    ReplyDelta,
    ReplyDone,
    ReplyInterrupted,
    ReplyPaused,
    ReplyResumed,
    ReplyStarted,
    TranscriptUpdated,
    TurnContinued,
    TurnEnded,
    UtteranceFinalized,
    Word,
)
from duplexd.streaming.numbers import spoken
from duplexd.tts.chunker import TextChunker
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

Output = Event | Command

# A pause whose sound ended within this long of it stopped when the reply's playback did: the reply's own
# echo does that (or a cough). After one, VAD alone no longer pauses that reply; after this many in a
# session, no reply of it (words still interrupt them): the microphone hears the loudspeaker, and each pause
# only cut the echo into fragments the text check no longer recognizes (measured: the e2e echo test, a
# loudspeaker at -6 dB without echo cancellation, paused five times and was then interrupted by "Stay.";
# the echo of the resumed reply paused it again within 0.2 s).
ECHO_LIKE_PAUSE_MS = 400
ECHO_LIKE_PAUSES = 2
# A reply's echo outlasts its playback by the loudspeaker's delay and the room's reverberation: speech that
# begins this soon after a reply has played out (or began during it and goes on) is judged as speech over
# that reply, its words held until they count as the user talking (bench voice's echo through a room, rt60
# 0.6 s and 190 ms: "Not just about | your dog", the last words' echo, became a turn of its own and the
# assistant answered it).
ECHO_TAIL_MS = 500

_LOOP_WORDS = 8
# Whisper's word times come from aligning its tokens to the audio; words the audio does not hold (written
# from the decoder's context: the prompt, the text before) get no time of their own and pile up at one
# instant. Bench voice's echo through a room: the reply's echo, before the canceller had converged, was
# transcribed as the user's own question ("and we are glad to welcome you.", seven words at 8.472 s, each
# 0 ms long) and interrupted the reply. In the clips' own speech, 3 of 511 finalized words (crosstalk in a
# meeting) and 32 of 4406 hypothesis words (most at the window's edge) are so stacked.
_STACKED_S = 0.02  # (Whisper's time step)
_ECHO_SCORES = 64  # remembered per reply (then forgotten at once: bounded)
_NEAR_WORD = 0.8  # a heard word this similar to a reply word (character ratio) is that word, misheard
# Speech over a reply that matches the question it answers this well, and better than any stretch of the reply
# by `_REPEAT_MARGIN`, is the user saying the question again, not the reply's echo (a reply that quotes the
# question matched what the user said again as well as its echo would: bench voice's `repeat` scenario).
# Three words at least: Whisper, prompted with the question, heard the echo of "In 2013: 1913" as the
# question's own "In 1813" (bench voice, echo through a room).
_REPEAT_MATCH = 0.8
_REPEAT_MARGIN = 0.05
_REPEAT_MIN_WORDS = 3
T = TypeVar("T")
_NORMALIZE = re.compile(r"[^\w'\-]+")


def _norm(word: str) -> str:
    return _NORMALIZE.sub("", word.lower()).strip("-'")


def normalized(text: str) -> str:
    """`text`'s words as the echo checks compare them (`_norm` each, the empty ones dropped)."""
    return " ".join(n for w in text.split() if (n := _norm(w)))


def _whole_characters(text: str) -> str:
    """Decoded reply text without a trailing half UTF-8 character (its next token completes it)."""
    return text[: len(text) - 1] if text.endswith("\ufffd") else text


def placed(words: Sequence[Word]) -> list[Word]:
    """`words` without those Whisper stacked at one instant: two or more in a row, each without length,
    starting together (see `_STACKED_S`). A lone word without length (the last of a hypothesis, cut by the
    window's end) stays."""

    def flat(w: Word) -> bool:
        return w.end_s - w.start_s < _STACKED_S

    def stacked(a: Word, b: Word) -> bool:
        return flat(a) and flat(b) and abs(b.start_s - a.start_s) < _STACKED_S

    return [
        w
        for i, w in enumerate(words)
        if not ((i > 0 and stacked(words[i - 1], w)) or (i + 1 < len(words) and stacked(w, words[i + 1])))
    ]


def without_loops(items: list[T], key: Callable[[T], str] = str) -> list[T]:
    """`items` (words) with every phrase of two or more words said again at once said only once: Whisper
    loops on a cut sound ("In 1813, In 1813, In 1813" for the echo of "In 2013: 1913"), and the loop is no
    more speech than its first turn. A word said again alone ("stop stop stop", "no no") stays. Phrases of
    up to `_LOOP_WORDS` words (this runs at every tick of a reply talked over: bounded work)."""
    out, keys = list(items), [key(x) for x in items]
    n = 2
    while n <= _LOOP_WORDS and 2 * n <= len(out):
        i = next((i for i in range(len(out) - 2 * n + 1) if keys[i : i + n] == keys[i + n : i + 2 * n]), None)
        if i is None:
            n += 1
        else:
            del out[i + n : i + 2 * n], keys[i + n : i + 2 * n]  # (then look again from the shortest phrase)
            n = 2
    return out


def _near(word: str, reply_words: set[str]) -> bool:
    """`word` is one of the reply's words, or (4 letters or more) a piece or a near miss of one: what
    Whisper writes for the reply's echo ("teen." and "19th." for "thirteen" and "nineteen")."""
    if word in reply_words:
        return True
    if len(word) < 4:
        return False
    return any(
        len(w) >= 4 and (word in w or SequenceMatcher(None, word, w, autojunk=False).ratio() >= _NEAR_WORD)
        for w in reply_words
    )


def echo_score(heard: str, reply: str) -> float:
    """How well `heard` matches some stretch of `reply` (0..1, character similarity of the best span of
    about its length): words the microphone picked up from the loudspeaker match the reply even where
    Whisper misheard them ("she hid your dux" for "she had your dog": 0.81), speech of the user's own
    does not (0.3-0.56 measured on the clips against such replies)."""
    words = reply.split()
    n, best = len(heard), 0.0
    for i in range(len(words)):
        span = ""
        for w in words[i:]:
            span = f"{span} {w}" if span else w
            if len(span) > 1.5 * n + 3:
                break
            if len(span) < 0.5 * n - 3:
                continue
            m = SequenceMatcher(None, heard, span, autojunk=False)
            if m.real_quick_ratio() > best and m.quick_ratio() > best:
                best = max(best, m.ratio())
    return best


class Phase(Enum):
    LISTENING = "listening"
    REPLYING = "replying"  # from the end of the user's turn until the reply has been played (or stopped)


@dataclass(slots=True)
class _Reply:
    number: int
    first_utterance: int  # utterances numbered from here on began while the assistant had the floor
    text: str = ""
    token_ends: list[int] = field(default_factory=list)  # len(text) after each reply token
    text_done: bool = False
    pieces: list[tuple[int, str]] = field(default_factory=list)  # (end offset in text, piece text)
    audio: dict[int, object] = field(default_factory=dict)  # piece index -> samples, not yet played out
    piece_samples: list[int] = field(default_factory=list)  # samples of each piece handed to the output
    start_sample: int | None = None  # where the reply's audio begins in the output stream
    audio_ended: bool = False
    sent: bool = False
    chunker: TextChunker = field(default_factory=TextChunker)
    max_tokens: int | None = None  # the reply's text ends after this many tokens (a Realtime `max_output_tokens`)
    capped: bool = False  # ... and it did
    kept_tokens: int | None = None  # after a cut (barge-in, cancel, truncate): the tokens left in the context
    paused_at_s: float | None = None  # stream time at which speech over the reply paused it (None: playing)
    pause_armed: bool = True  # False after a resume, until VAD's run of speech that paused it has ended
    echo_like_pause: bool = False  # a pause's sound stopped with the playback: VAD no longer pauses this reply
    echo_scores: dict[tuple[str, int], float] = field(default_factory=dict)  # (heard, len(text)) -> score
    question: str = ""  # the user's turn it answers, normalized
    started_s: float = 0.0  # the stream time at which the reply began (its turn ended)

    @property
    def samples(self) -> int:
        return sum(self.piece_samples)

    def words(self) -> set[str]:
        """The reply's words, normalized, with its numbers also as said ("2013": "twenty", "thirteen")."""
        written = [n for w in self.text.split() if (n := _norm(w))]
        return {*written, *spoken(written)}

    def normalized(self) -> str:
        return normalized(self.text)

    def echo_score(self, heard: str) -> float:
        """`echo_score(heard, the reply so far)`, remembered until the reply's text grows: it is asked again
        at every tick while the reply is paused, and costs up to tens of ms for a long reply."""
        key = (heard, len(self.text))
        if (score := self.echo_scores.get(key)) is None:
            if len(self.echo_scores) >= _ECHO_SCORES:
                self.echo_scores.clear()
            score = self.echo_scores[key] = echo_score(heard, self.normalized())
        return score

    def repeats_question(self, heard: str) -> bool:
        """`heard` is the question this reply answers, said again: it matches the question (`_REPEAT_MATCH`)
        better than any stretch of the reply, however closely the reply quotes it (`_REPEAT_MARGIN`)."""
        if len(heard.split()) < _REPEAT_MIN_WORDS or not self.question:
            return False
        key = (heard, -1)  # (the question does not grow)
        if (score := self.echo_scores.get(key)) is None:
            if len(self.echo_scores) >= _ECHO_SCORES:
                self.echo_scores.clear()
            score = self.echo_scores[key] = echo_score(heard, self.question)
        return score >= max(_REPEAT_MATCH, self.echo_score(heard) + _REPEAT_MARGIN)


@dataclass(slots=True)
class _Trail:
    """A reply that has played out, while its echo may still reach the microphone."""

    reply: _Reply
    ended_s: float  # the stream time at which it had played out
    until_s: float  # utterances that begin after this stream time are not its echo
    # utterances that began before `until_s`, let through as the user's or dropped (a few: bounded by time)
    decided: set[int] = field(default_factory=set)


class Conversation:
    def __init__(
        self,
        turn: TurnConfig,
        tts: TtsConfig,
        *,
        speculate: bool = False,
        drafts: int = 2,
        auto_turns: bool = True,
        auto_respond: bool = True,
        llm_p_end: bool = True,
    ) -> None:
        """`llm_p_end`: the LLM reports P(end of turn) for the user's words (the remote backend does not);
        drafts then wait for it, as the sign that the LLM has every committed word. Without it they go at
        the pause (the worker applies the words before the draft, in order), and the acoustic end-of-turn
        model's P(turn over), where there is one, is the endpointer's whole turn signal."""
        self.auto_turns = auto_turns  # False: a turn ends only by `commit`/`respond` (the client decides)
        self.auto_respond = auto_respond  # False: a turn that ends waits for `respond` to be answered
        self.barge_in = True  # False: the user's words never stop a reply (they wait for the next turn)
        # False: words that interrupt a reply open a new turn even when they continue the one it answers
        # (`turn.continue_turn_ms`; a Realtime session's items are OpenAI's: a new one, always)
        self.continue_turns = True
        # How many dB the echo canceller took out of the microphone over a span of the stream (None: it had
        # no echo to cancel there); set by the shell for a session that cancels its echo.
        self.echo_db: Callable[[float, float], float | None] | None = None
        self.max_reply_tokens: int | None = None  # each reply's text ends after this many tokens (None: no cap)
        # Drafts while the user is still speaking too, at most one per this much stream time (0: only at
        # pauses): a draft whose model calls a read-only tool starts the call early (`[tools]
        # listen_draft_ms`; set by the shell where the model has such tools).
        self.listen_draft_s = 0.0
        self._listen_drafted_s = -1e9
        self._spoken: _Reply | None = None  # the last reply that ended, for `truncate`
        self._held_appends: list[AppendUserText] = []  # with auto_turns off: words not committed by the client
        self._cleared_s = 0.0  # stream time of the last `clear`: words of audio before it never reach a turn
        self._unanswered = False  # a turn ended without a reply (auto_respond off, or `commit`)
        self._turn = turn
        self._tts = tts
        self._speculate = speculate
        self._llm_p_end = llm_p_end
        self._max_drafts = drafts
        self._tentative: dict[int, tuple[Word, ...]] = {}  # open utterances' words not committed yet
        self._drafted: set[tuple[int, str]] = set()  # (version, words) drafted this turn
        self._endpointer = Endpointer(turn)
        self._backchannels = turn.backchannel_words
        self.turns = 0
        self._turn_words: list[str] = []  # the user's words of the current turn, as sent to the LLM
        self._ended_words: list[str] = []  # ... and of the turn that ended last, until its reply is heard
        self._ended_eos_s = 0.0  # (where its speech ended, stream seconds)
        self._sent: dict[int, int] = {}  # utterance -> words of it already sent to the LLM
        # the appends of the utterance appended last in this turn, with their words (its final, deciding
        # them again, may take them back), and that utterance (None: typed text, or none since the turn began);
        # also those of the utterance before it, whose last words a continuation's final may join to its own
        self._appended: dict[int, list[tuple[AppendUserText, list[str]]]] = {}
        self._last_append: int | None = None
        self._open: set[int] = set()  # utterances with partials and no final yet
        self._last_utterance = 0
        self._versions = 0
        self._p_end: float | None = None
        self._p_version = -1
        self._p_audio: tuple[float, float] | None = None  # (where the speech ended, P(turn over) of its audio)
        self._held: dict[int, tuple[tuple[Word, ...], int, bool]] = {}  # during a reply: words, committed, final
        self._reply: _Reply | None = None
        self._trail: _Trail | None = None  # the reply that played out last, while its echo may be heard
        self._question = ""  # the last turn's words, normalized (what its reply answers)
        self._stream_s = 0.0  # the latest tick's stream time
        self._echo_like_pauses = 0  # false pauses whose sound stopped with the playback (see ECHO_LIKE_PAUSE_MS)
        self._out_samples = 0  # output stream: samples handed to the shell so far
        self._played_samples = 0

    # --- listening -------------------------------------------------------------------------------------

    def observe(self, events: list[Event]) -> list[Output]:
        """Transcript events of this session's recognizer."""
        out: list[Output] = []
        for event in events:
            if isinstance(event, TranscriptUpdated | UtteranceFinalized):
                out.extend(self._on_words(event))
        return out

    def _on_words(self, event: TranscriptUpdated | UtteranceFinalized) -> list[Output]:
        utt = event.utterance
        final = isinstance(event, UtteranceFinalized)
        committed = len(event.words) if final else event.committed
        self._last_utterance = max(self._last_utterance, utt)
        if final:
            self._open.discard(utt)
        else:
            self._open.add(utt)
        reply = self._reply
        if reply is not None and utt >= reply.first_utterance:
            self._held[utt] = (event.words, committed, final)
            return self._maybe_barge_in()
        if reply is None and self._trailing(utt, event.words, committed, final):
            return []
        out: list[Output] = []
        if final:
            self._tentative.pop(utt, None)
            assert isinstance(event, UtteranceFinalized)
            rejoined = self._rejoin(event)
            if rejoined is not None:
                return rejoined
            out = self._take_back(utt, event.words)
        else:
            self._tentative[utt] = event.words[committed:]
        return out + self._send_words(utt, event.words[:committed])

    def _trailing(self, utt: int, words: tuple[Word, ...], committed: int, final: bool) -> bool:
        """Utterance `utt` may be the echo of the reply that just played out (`ECHO_TAIL_MS`): True while
        its words are held (none of them sent), and for a final dropped: one begun while the reply played
        that is not the user's (`_ignorable`), or one begun after it that was only its echo (a backchannel
        word counts then: "Yes." may answer it). It goes to the user's turn as soon as it counts as them
        talking (`turn.barge_in_words` committed words, or a final with any that is not dropped), as speech
        over a playing reply would interrupt it."""
        trail = self._trail
        if trail is None or utt < trail.reply.first_utterance or utt in trail.decided or self._sent.get(utt):
            return False
        if words and words[0].start_s >= trail.until_s:
            return False  # (it began after the echo had died away)
        over_reply = not words or words[0].start_s < trail.ended_s
        if final:
            trail.decided.add(utt)
            if over_reply:
                dropped = self._ignorable(words, trail.reply)
            else:  # (begun after it ended: only its echo is dropped; "Yes." may answer it)
                dropped = not self._meaningful(words, trail.reply, backchannels_count=True)
            if dropped:
                self._sent[utt] = len(words)
                return True
            return False
        meaningful = {id(w) for w in self._meaningful(words, trail.reply, backchannels_count=not over_reply)}
        if sum(1 for w in words[:committed] if id(w) in meaningful) >= self._turn.barge_in_words:
            trail.decided.add(utt)
            return False
        return True

    def _take_back(self, utt: int, words: tuple[Word, ...]) -> list[Output]:
        """The utterance's final decided again words of it that had been sent (`asr.final_redecode`): take
        its appends back from the LLM's context (and the turn's words) so the final's words replace them;
        only while they are the turn's last appends."""
        appends = self._appended.get(utt)
        if not appends or self._last_append != utt:
            return []
        sent = [text for _, texts in appends for text in texts]
        final = [w.text.strip() for w in words if w.text.strip() and w.start_s >= self._cleared_s]
        if final[: len(sent)] == sent:
            return []
        del self._appended[utt]
        self._sent[utt] = 0
        self._last_append = None
        return self._unsay(appends)

    def _rejoin(self, event: UtteranceFinalized) -> list[Output] | None:
        """A continuation's final that joined the utterance it continues ("review." | "of activities" ->
        "review of activities"): that one's last append and this one's appends are taken back, and the words
        go again as one sentence, as the final reads them. None: no join to make, or those are not the
        turn's last appends (a typed message came between, or the turn ended)."""
        prev, joined, utt = event.continues, event.previous, event.utterance
        if prev is None or not joined or (word := joined[-1].text.strip()) == "":
            return None
        if list(self._appended) not in ([prev], [prev, utt]) or self._last_append not in (prev, utt):
            return None
        last = self._appended[prev][-1]
        if not last[1] or last[1][-1] == word:
            return None
        involved = [last, *self._appended.get(utt, [])]
        out = self._unsay(involved)
        self._appended.clear()
        self._last_append = None
        self._sent[utt] = 0
        return out + self._send_words(utt, event.words, before=[*last[1][:-1], word])

    def _unsay(self, appends: list[tuple[AppendUserText, list[str]]]) -> list[Output]:
        """Take the turn's last `appends` back: from its words, from those held for the client's commit, and
        from the LLM's context (`RetractUserText`, for those that reached it)."""
        sent = [text for _, texts in appends for text in texts]
        del self._turn_words[len(self._turn_words) - len(sent) :]
        held = [a for a, _ in appends if any(a is h for h in self._held_appends)]
        self._held_appends = [h for h in self._held_appends if not any(h is a for a in held)]
        reached = tuple(a.text for a, _ in appends if not any(a is h for h in held))
        if not reached:
            return []
        self._versions += 1
        return [RetractUserText(reached, self._versions)]

    def _send_words(self, utt: int, words: tuple[Word, ...], *, before: list[str] | None = None) -> list[Output]:
        """`words` of utterance `utt` not sent yet go to the LLM (`before`: words said again ahead of them,
        as one append: a rejoined sentence)."""
        new = words[self._sent.get(utt, 0) :]
        if not new and not before:
            return []
        self._sent[utt] = len(words)
        texts = [*(before or ()), *(w.text.strip() for w in new if w.text.strip() and w.start_s >= self._cleared_s)]
        if not texts:
            return []
        text = self._continuation(texts)
        self._turn_words.extend(texts)
        self._versions += 1  # any P(end of turn) held is now for older text
        append = AppendUserText(text, self._versions)
        if utt != self._last_append:  # (only the last appends can be taken back: the one before may be rejoined)
            prev = self._last_append
            self._appended = {prev: self._appended[prev]} if prev is not None and prev in self._appended else {}
        self._appended.setdefault(utt, []).append((append, texts))
        self._last_append = utt
        if not self.auto_turns:  # the client may still clear them: they reach the LLM at its commit
            self._held_appends.append(append)
            return []
        return [append]

    def user_text(self, text: str, *, own_turn_at: float | None = None) -> list[Output]:
        """A typed user message: its words join the user's turn (and the LLM's context) now. `own_turn_at`
        (stream seconds): the message is a whole turn, ended there without a reply (a Realtime item: only
        `respond` answers it; the endpointer must not take the microphone's silence as its end)."""
        texts = text.split()
        if not texts or self._reply is not None:
            return []
        out = self._release_held()
        joined = self._continuation(texts)
        self._turn_words.extend(texts)
        self._versions += 1
        self._last_append = None
        out.append(AppendUserText(joined, self._versions))
        if own_turn_at is not None:
            out += self._end_turn(own_turn_at, 0.0, None, reply=False)
        return out

    def commit(self, stream_s: float) -> list[Output]:
        """The client says the user's turn is over (with `auto_turns` off): its words go to the LLM and
        the turn ends; a reply follows if `auto_respond`."""
        if self._reply is not None:
            return []
        out = self._release_held()
        return out + self._end_turn(stream_s, 0.0, None, reply=self.auto_respond)

    def clear(self, stream_s: float) -> list[Output]:
        """Forget the words of the open turn that have not reached the LLM (with `auto_turns` off: all of
        them since the last commit), and those of audio before `stream_s` that the recognizer has yet to
        commit (an utterance still open at the clear). Returns nothing: the shell confirms."""
        self._cleared_s = stream_s
        dropped = len(self._held_appends)
        self._held_appends.clear()
        if dropped:
            self._turn_words = []
            self._appended.clear()
        self._tentative.clear()
        return []

    def respond(self, stream_s: float, *, max_tokens: int | None = None) -> list[Output]:
        """`response.create`: answer now. Ends the user's turn first if it has words not yet in a turn.
        `max_tokens`: this reply's cap (else `max_reply_tokens`)."""
        if self._reply is not None:
            return []
        out = self._release_held()
        if self._turn_words or not self._unanswered:
            out += self._end_turn(stream_s, 0.0, None, reply=True)
        else:
            out += self._start_reply()
        if max_tokens is not None and self._reply is not None:
            self._reply.max_tokens = max_tokens
        return out

    def _release_held(self) -> list[Output]:
        out: list[Output] = list(self._held_appends)
        self._held_appends.clear()
        return out

    def _continuation(self, texts: list[str]) -> str:
        """`texts` as appended after the turn's words so far (with a leading space unless they open it)."""
        text = " ".join(texts)
        return " " + text if self._turn_words and text else text

    def p_end_of_turn(self, p: float, version: int) -> None:
        """The LLM's P(end of turn) after the append numbered `version` (stale ones are ignored)."""
        if version == self._versions:
            self._p_end, self._p_version = p, version

    def p_audio_end(self, p: float, voice_end_s: float) -> None:
        """The acoustic end-of-turn model's P(turn over) for the speech that ended at `voice_end_s` (stream
        seconds): it holds while no speech follows."""
        self._p_audio = (voice_end_s, p)

    def tick(self, *, stream_s: float, silence_ms: float, asr_settled: bool, voiced_ms: float = 0.0) -> list[Output]:
        """Called as time passes (each VAD batch, each ASR pass). `silence_ms`: since the last voiced audio
        (0 while speaking); `asr_settled`: no recognizer pass due or running for this session; `voiced_ms`:
        how long VAD has heard speech without a break (0 in silence)."""
        out: list[Output] = []
        self._stream_s = stream_s
        if self._reply is not None:
            return self._pause_or_resume(self._reply, stream_s, silence_ms, voiced_ms)
        if not self.auto_turns:
            return out
        text = " ".join(self._turn_words)
        final = asr_settled and not self._open
        p = self._p_end if self._p_version == self._versions else None
        voice_end_s = stream_s - silence_ms / 1000
        p_audio = None
        if self._p_audio is not None and abs(self._p_audio[0] - voice_end_s) < 1e-3:
            p_audio = self._p_audio[1]
        if self._endpointer.turn_over(
            silence_ms=silence_ms, text_final=final, text=text, p_end=p, p_audio=p_audio, text_scored=self._llm_p_end
        ):
            out += self._end_turn(stream_s, silence_ms, p, reply=self.auto_respond, p_audio=p_audio)
        elif (
            self._speculate
            and self.auto_respond
            and silence_ms >= max(self._turn.pause_ms, 32)
            and (p is not None or not self._llm_p_end)
        ):
            out.extend(self._drafts())
        elif (
            self.listen_draft_s
            and self._speculate
            and self.auto_respond
            and stream_s - self._listen_drafted_s >= self.listen_draft_s
        ):
            drafts = self._drafts()[:1]  # (the words so far: the latest hypothesis whole)
            if drafts:
                self._listen_drafted_s = stream_s
            out.extend(drafts)
        return out

    def _end_turn(
        self, stream_s: float, silence_ms: float, p: float | None, *, reply: bool, p_audio: float | None = None
    ) -> list[Output]:
        self.turns += 1
        eos_s = stream_s - silence_ms / 1000
        text = " ".join(self._turn_words)
        out: list[Output] = [TurnEnded(self.turns, text, eos_s, silence_ms, p, p_audio)]
        self._question = normalized(text)
        self._ended_words, self._turn_words = self._turn_words, []
        self._ended_eos_s = eos_s
        self._appended.clear()  # (a finished turn's words are never taken back)
        self._last_append = None
        self._drafted.clear()
        self._unanswered = True
        return out + (self._start_reply() if reply else [])

    def _start_reply(self) -> list[Output]:
        self._unanswered = False
        self._trail = None
        chunker = TextChunker(first_words=self._tts.first_words, max_words=self._tts.max_words)
        self._reply = _Reply(self.turns, self._last_utterance + 1, chunker=chunker, max_tokens=self.max_reply_tokens)
        self._reply.question = self._question
        self._reply.started_s = self._stream_s
        return [StartReply(self.turns), ReplyStarted(self.turns)]

    def _drafts(self) -> list[Output]:
        """The user pauses and the LLM has every committed word: draft the reply for the words they have
        most likely said, the recognizer's latest hypothesis (its uncommitted tail is what the final pass
        usually confirms), then the same without its last, least sure word."""
        if len(self._open) > 1:
            return []  # two utterances' words would reach the LLM in two appends: no single draft matches
        tentative = [
            w.text.strip()
            for u in self._open
            for w in self._tentative.get(u, ())
            if w.text.strip() and w.start_s >= self._cleared_s
        ]
        tails = [tentative, tentative[:-1]] if tentative else [[]]
        out: list[Output] = []
        for tail in tails[: self._max_drafts]:
            if not (self._turn_words or tail):
                continue
            text = self._continuation(tail)
            if (self._versions, text) not in self._drafted:
                self._drafted.add((self._versions, text))
                out.append(DraftReply(text, self._versions))
        return out

    # --- replying --------------------------------------------------------------------------------------

    def reply_text(self, reply: int, texts: list[str], done: bool) -> list[Output]:
        """New reply tokens: `texts[i]` is the whole reply decoded through its next token; `done` when the
        LLM has finished the reply."""
        r = self._reply
        if r is None or r.number != reply or r.text_done:
            return []
        out: list[Output] = []
        for i, text in enumerate(texts):
            shown = _whole_characters(text)
            r.token_ends.append(len(shown))
            if len(shown) > len(r.text) and shown.startswith(r.text):
                out.extend(self._add_text(r, shown[len(r.text) :]))
            last = done and i == len(texts) - 1
            if r.max_tokens is not None and len(r.token_ends) >= r.max_tokens and not last:
                # At the cap: the LLM's reply ends here (its context keeps these tokens); the audio plays on.
                r.capped, done = True, True
                out.append(InterruptReply(r.number, len(r.token_ends)))
                break
        if done:
            r.text_done = True
            out.extend(self._pieces(r, r.chunker.flush()))
            out.extend(self._maybe_end_audio(r))
        return out

    def draft_text(self, texts: list[str]) -> list[Output]:
        """A drafted reply so far (as `reply_text` would get it): its first TTS piece, to synthesize ahead.
        The same tokens give the same pieces, so if the draft becomes the reply this audio is its start."""
        if self._reply is not None:
            return []
        scratch = _Reply(0, 0, chunker=TextChunker(first_words=self._tts.first_words, max_words=self._tts.max_words))
        for text in texts:
            shown = _whole_characters(text)
            if len(shown) > len(scratch.text) and shown.startswith(scratch.text):
                for out in self._add_text(scratch, shown[len(scratch.text) :]):
                    if isinstance(out, Synthesize):
                        return [PrefetchSpeech(out.text)]
        return []

    def _add_text(self, r: _Reply, delta: str) -> list[Output]:
        if not r.text:
            delta = delta.lstrip()
        r.text += delta
        return [ReplyDelta(r.number, delta), *self._pieces(r, r.chunker.push(delta))]

    def _pieces(self, r: _Reply, pieces: list[str]) -> list[Output]:
        out: list[Output] = []
        for piece in pieces:
            start = r.pieces[-1][0] if r.pieces else 0
            at = r.text.find(piece, start)
            end = (at + len(piece)) if at >= 0 else len(r.text)
            r.pieces.append((end, piece))
            out.append(Synthesize(r.number, len(r.pieces) - 1, piece))
        return out

    def audio_ready(self, reply: int, index: int, samples: object) -> list[Output]:
        """TTS finished piece `index` of `reply`; pieces go out in order."""
        r = self._reply
        if r is None or r.number != reply:
            return []
        r.audio[index] = samples
        out: list[Output] = []
        while (nxt := len(r.piece_samples)) in r.audio:
            audio = r.audio.pop(nxt)
            if r.start_sample is None:
                r.start_sample = self._out_samples
            n = len(audio)  # type: ignore[arg-type]
            r.piece_samples.append(n)
            self._out_samples += n
            out.append(PlayAudio(reply, audio))
        return out + self._maybe_end_audio(r)

    def _maybe_end_audio(self, r: _Reply) -> list[Output]:
        if r.text_done and not r.audio_ended and len(r.piece_samples) == len(r.pieces):
            r.audio_ended = True
            if r.start_sample is None:
                r.start_sample = self._out_samples
            return [EndAudio(r.number)]
        return []

    def audio_sent(self, reply: int) -> list[Output]:
        """Every frame of `reply` has been sent."""
        r = self._reply
        if r is None or r.number != reply or r.sent:
            return []
        r.sent = True
        return [ReplyDone(r.number, r.text, 1000 * r.samples / OUTPUT_SAMPLE_RATE), *self._maybe_finish()]

    def played(self, samples: int) -> list[Output]:
        """The client has played `samples` of the output stream (reported, or estimated by the shell)."""
        self._played_samples = max(self._played_samples, samples)
        return self._maybe_finish()

    def _maybe_finish(self) -> list[Output]:
        """Back to listening once the reply has been sent and played out."""
        r = self._reply
        if r is None or not r.sent or r.start_sample is None:
            return []
        if self._played_samples < r.start_sample + r.samples:
            return []
        out: list[Output] = []
        if r.paused_at_s is not None:  # (the client had played it all when the pause reached it)
            out = [ResumeAudio(r.number), ReplyResumed(r.number, 1000 * max(0.0, self._stream_s - r.paused_at_s))]
            r.paused_at_s = None
        return out + self._leave_reply(played_out=True)

    def _leave_reply(self, *, played_out: bool = False) -> list[Output]:
        """The floor returns to the user; words they said meanwhile that were not only backchannels or the
        reply's own echo join their new turn. After a reply that `played_out`, an utterance still open is
        judged against it until it counts as the user talking (`_trailing`): its echo may go on."""
        r = self._reply
        assert r is not None
        self._reply = None
        self._spoken = r
        self._ended_words = []  # (the reply has been heard, or cut: the turn it answered is over)
        # (Where the client decides turns, it commits what it has heard: nothing is held back from it.)
        trails = played_out and self.auto_turns
        self._trail = _Trail(r, self._stream_s, self._stream_s + ECHO_TAIL_MS / 1000) if trails else None
        held, self._held = self._held, {}
        out: list[Output] = []
        for utt, (words, committed, final) in sorted(held.items()):
            if self._trail is not None:  # (it judges every utterance heard over the reply, finals too)
                if self._trailing(utt, words, committed, final):
                    continue
            elif final and self._ignorable(words, r):
                self._sent[utt] = len(words)
                continue
            out.extend(self._send_words(utt, words[:committed]))
        return out

    # --- barge-in ----------------------------------------------------------------------------------------

    def _meaningful(self, words: tuple[Word, ...], r: _Reply, *, backchannels_count: bool = False) -> list[Word]:
        """The words of an utterance heard during reply `r` that count as the user talking: none if the
        utterance is the reply's own echo; else those that are not backchannels (with `backchannels_count`,
        those too) nor (near) words of the reply nor words the audio does not hold (`placed`), a phrase Whisper
        looped on counted once. The question said again is the user's, every word, even where the reply
        quotes it (`_Reply.repeats_question`)."""
        heard = without_loops([w for w in placed(words) if _norm(w.text)], key=lambda w: _norm(w.text))
        text = " ".join(_norm(w.text) for w in heard)
        if not heard or self._echoed(words[0].start_s, words[-1].end_s):
            return []
        repeated = r.repeats_question(text)
        if not repeated and r.echo_score(text) >= self._turn.echo_similarity:
            return []
        reply_words = r.words()
        return [
            w
            for w in heard
            if ((n := _norm(w.text)) not in self._backchannels or backchannels_count)
            and (repeated or not _near(n, reply_words))
            and not self._echoed(w.start_s, w.end_s)
        ]

    def _echoed(self, start_s: float, end_s: float) -> bool:
        """The echo canceller took `turn.echo_word_db` or more out of the audio over [start_s, end_s): the
        microphone heard the loudspeaker there, whatever the recognizer made of it ("This is" of a garbled
        echo). Asked of each word, and of an utterance's whole span: Whisper wrote the question it had been
        prompted with for the reply's echo through a room ("And we're glad to | welcome", 18 and 15 dB taken
        out over each utterance), and its words the canceller took less out of (9.4, 7.1 dB) interrupted the
        reply; a user talking over the echo as loud as it loses 3-6 dB."""
        limit = self._turn.echo_word_db
        if not limit or self.echo_db is None:
            return False
        db = self.echo_db(start_s, end_s)
        return db is not None and db >= limit

    def _ignorable(self, words: tuple[Word, ...], r: _Reply) -> bool:
        """A final heard over reply `r` is not the user's: no word of it counts (`_meaningful`), or too few
        to have interrupted the reply (`turn.barge_in_words`) with the microphone hearing the loudspeaker
        under them (`_over_echo`): through a room, what Whisper makes of the echo ("in the future." over
        "...the regular review...") became a turn of its own at the reply's end, the assistant answered it,
        and its answer's echo the next (bench voice's echo kept listening: 6 of 6 conversations)."""
        meaningful = self._meaningful(words, r)
        return not meaningful or self._fragment(meaningful, r)

    def _fragment(self, meaningful: list[Word], r: _Reply) -> bool:
        """An utterance's words that count (`_meaningful`) are too few to interrupt reply `r` and were heard
        over its echo (see `_ignorable`)."""
        return len(meaningful) < self._turn.barge_in_words and self._over_echo(meaningful, r)

    def _over_echo(self, words: list[Word], r: _Reply) -> bool:
        """The microphone heard the loudspeaker while reply `r` played: the echo canceller had its echo to
        cancel over most of the reply so far, or under every one of `words` (however little it took out).
        Over most of the reply, since it decides that the microphone hears the loudspeaker only after the
        first second or so of playback ("be." 1.5 s into clip06's reply had no level of its own). False
        without echo cancellation, with headphones, or where the loudspeaker was silent."""
        if self.echo_db is None:
            return False
        if self.echo_db(r.started_s, self._stream_s) is not None:
            return True
        return all(self.echo_db(w.start_s, w.end_s) is not None for w in words)

    def _maybe_barge_in(self) -> list[Output]:
        r = self._reply
        assert r is not None
        committed = hypothesis = 0
        counted: list[str] = []  # (the words that count, in order: what `reply.interrupted` says it was `by`)
        for utt, (words, n_committed, final) in list(self._held.items()):
            heard = self._meaningful(words, r)
            meaningful = {id(w) for w in heard}
            # A finished backchannel or echo, or a fragment over the echo (`_ignorable`): forget it. Fragments
            # do not add up: "Great." and "Stay | tight." (the canceller took 11 dB out under "Stay"), two
            # utterances of clip09's echo through a 0 dB room, interrupted its reply as two words.
            if final and (not heard or self._fragment(heard, r)):
                del self._held[utt]
                self._sent[utt] = len(words)
                continue
            committed += sum(1 for w in words[:n_committed] if id(w) in meaningful)
            hypothesis += 0 if final else len(meaningful)
            counted += [w.text.strip() for w in words if id(w) in meaningful]
        # A paused reply is silent already: only words that held over two passes (or a final) confirm it.
        # A hypothesis can be Whisper's hallucination on a cut echo ("it's a very good time to get" for
        # "In 20..."), gone at the next pass; while it lasts it keeps the reply from resuming. The same
        # once a pause of this reply was echo-like (the microphone hears the loudspeaker): the hypotheses
        # that follow are of that sound ("In 1813, we are going to take a look", then "in 20,"). And where
        # speech would pause this reply's audio, a hypothesis never interrupts it: real speech pauses it
        # first (then committed words decide), so a hypothesis over it playing is of a sound VAD did not
        # take for speech (a throat clearing Whisper heard as "uh,", a phrase of the reply's own echo).
        pausable = self._pauses(r) and self._audible(r)
        hypothesis_counts = not pausable and r.paused_at_s is None and not r.echo_like_pause
        if not self.barge_in or (
            committed < self._turn.barge_in_words
            and (not hypothesis_counts or hypothesis < self._turn.barge_in_partial_words)
        ):
            return []
        return self._interrupt("barge_in", by=" ".join(counted), withdraw=self._continues(r))

    def _continues(self, r: _Reply) -> bool:
        """The words that interrupt reply `r` go on with the turn it answers: the speech they are of began
        in the pause the endpointer took for that turn's end, or within `turn.continue_turn_ms` after it
        (a client's commit is the client's to take back)."""
        limit_s = self._turn.continue_turn_ms / 1000
        if not (self.continue_turns and self.auto_turns and limit_s and self._ended_words):
            return False
        starts = [w.start_s for words, _, _ in self._held.values() for w in self._meaningful(words, r)]
        return bool(starts) and self._ended_eos_s <= min(starts) <= r.started_s + limit_s

    def _pause_or_resume(self, r: _Reply, stream_s: float, silence_ms: float, voiced_ms: float) -> list[Output]:
        """Speech over the playing reply pauses it at once; the words then interrupt it (`_maybe_barge_in`),
        or, when none come that do, it resumes where it paused."""
        onset_ms = self._turn.pause_on_speech_ms
        if r.paused_at_s is None:
            if voiced_ms < onset_ms:
                r.pause_armed = True
            if not (self.barge_in and self._pauses(r) and r.pause_armed and voiced_ms >= onset_ms and self._audible(r)):
                return []
            r.paused_at_s = stream_s
            heard_ms = 1000 * max(0, self._played_samples - (r.start_sample or 0)) / OUTPUT_SAMPLE_RATE
            return [PauseAudio(r.number), ReplyPaused(r.number, heard_ms)]
        counted = self._counted_words(r)
        paused_ms = 1000 * (stream_s - r.paused_at_s)
        quiet = silence_ms >= self._turn.resume_silence_ms
        if (quiet and counted < self._turn.barge_in_words) or (
            counted == 0 and paused_ms >= self._turn.resume_timeout_ms
        ):
            r.paused_at_s, r.pause_armed = None, False
            if paused_ms - silence_ms <= ECHO_LIKE_PAUSE_MS:  # (when the sound ended, after the pause)
                r.echo_like_pause = True
                self._echo_like_pauses += 1
            return [ResumeAudio(r.number), ReplyResumed(r.number, paused_ms)]
        return []

    def _pauses(self, r: _Reply) -> bool:
        """VAD alone may pause reply `r` (see ECHO_LIKE_PAUSE_MS)."""
        return self.pauses_on_speech and not r.echo_like_pause

    def _audible(self, r: _Reply) -> bool:
        """Reply `r`'s audio is playing at the client: some has been handed out and not all of it played."""
        if r.start_sample is None or not r.piece_samples:
            return False
        return self._played_samples < r.start_sample + r.samples or not r.audio_ended

    def _counted_words(self, r: _Reply) -> int:
        """Words said over reply `r` that count as the user talking, committed or not (the latest hypothesis)."""
        return sum(len(self._meaningful(words, r)) for words, _, _ in self._held.values())

    def cancel(self) -> list[Output]:
        """The client's `reply.cancel`. Returns [] with no reply in progress (the shell reports `no_reply`)."""
        if self._reply is None:
            return []
        return self._interrupt("cancel")

    def end(self) -> list[Output]:
        """The client's `session.end`: a reply in progress stops as interrupted (reason `session_end`), so
        the client hears why it stopped instead of silence. Returns [] with no reply in progress."""
        if self._reply is None:
            return []
        return self._interrupt("session_end")

    def truncate(self, reply: int, heard_samples: int) -> tuple[str, list[Output]] | None:
        """The client played only the first `heard_samples` of reply `reply`'s audio (a Realtime
        `conversation.item.truncate`). The reply in progress stops there, as on a cancel; the last reply that
        ended keeps only those tokens in the LLM context (the engine cuts it, also when the user's words
        followed it). Returns the text heard and the commands, or None for a reply not kept here (older, or
        the last one while another is in progress)."""
        r = self._reply
        if r is not None and r.number == reply:
            out = self._interrupt("cancel", heard_samples)
            heard = next((o.heard_text for o in out if isinstance(o, ReplyInterrupted)), "")
            return heard, out
        r = self._spoken
        if r is None or r.number != reply or self._reply is not None:  # (a later reply has begun since)
            return None
        kept = len(r.token_ends) if r.kept_tokens is None else r.kept_tokens
        heard_chars = self._heard_chars(r, max(0, min(heard_samples, r.samples)))
        heard_tokens = min(kept, sum(1 for end in r.token_ends if end <= heard_chars))
        heard_text = r.text[: r.token_ends[heard_tokens - 1]].strip() if heard_tokens else ""
        if heard_tokens == kept:
            return heard_text, []  # the context holds no more than that already
        r.kept_tokens = heard_tokens
        return heard_text, [InterruptReply(r.number, heard_tokens)]

    def replace_context(self, system_prompt: str | None, turns: list[tuple[str, str]]) -> list[Output]:
        """Give the LLM a new context (a Realtime client edited its conversation): `turns` are the finished
        turns as the client now has them; the open turn's words that reached the LLM follow them. Returns []
        while a reply is in progress (the shell retries when it ends). The last reply can no longer be cut by
        `truncate` afterwards: the new context holds it as the client reported it."""
        if self._reply is not None:
            return []
        held = sum(len(a.text.split()) for a in self._held_appends)
        open_words = self._turn_words[: len(self._turn_words) - held]
        self._spoken = None
        self._last_append = None  # (the new context holds the open words as one text)
        return [ReplaceContext(system_prompt, tuple(turns), " ".join(open_words))]

    def set_turn_config(self, turn: TurnConfig) -> None:
        """New endpointing settings (a Realtime `session.update`), from the next decision on."""
        self._turn = turn
        self._endpointer = Endpointer(turn)

    @property
    def pauses_on_speech(self) -> bool:
        """VAD alone still pauses replies in this session (see ECHO_LIKE_PAUSES)."""
        return bool(self._turn.pause_on_speech_ms) and self._echo_like_pauses < ECHO_LIKE_PAUSES

    @property
    def text_settled(self) -> bool:
        """No utterance is waiting for its final transcript."""
        return not self._open

    @property
    def reply_start_sample(self) -> int | None:
        """Where the current reply's audio begins in the output stream (None: no reply, or no audio yet)."""
        return None if self._reply is None else self._reply.start_sample

    @property
    def replying(self) -> bool:
        return self._reply is not None

    def capped(self, reply: int) -> bool:
        """Reply `reply` (in progress or the last one) ended at its token cap."""
        r = self._reply if self._reply is not None and self._reply.number == reply else self._spoken
        return r is not None and r.number == reply and r.capped

    @property
    def starved(self) -> bool:
        """The user is owed reply audio that does not exist yet: the turn has ended (or the reply has begun)
        and the client has played everything synthesized so far. Decode or synthesis is behind playback."""
        r = self._reply
        if r is None or r.audio_ended:
            return False
        return r.start_sample is None or self._played_samples >= r.start_sample + r.samples

    @property
    def phase(self) -> Phase:
        return Phase.REPLYING if self._reply is not None else Phase.LISTENING

    def _interrupt(
        self, reason: str, heard: int | None = None, *, by: str = "", withdraw: bool = False
    ) -> list[Output]:
        """Stop the reply; the client heard its first `heard` samples (None: as far as it has played). `by`:
        a barge-in's words. `withdraw`: they continue the turn the reply answers (`_continues`): the reply
        is taken back whole and the turn is open again (`turn.continued`), the words joining it."""
        r = self._reply
        assert r is not None
        heard_samples = 0
        if heard is not None:
            heard_samples = max(0, min(heard, r.samples))
        elif r.start_sample is not None:
            heard_samples = max(0, min(self._played_samples - r.start_sample, r.samples))
        heard_chars = self._heard_chars(r, heard_samples)
        heard_tokens = sum(1 for end in r.token_ends if end <= heard_chars)
        heard_text = r.text[: r.token_ends[heard_tokens - 1]].strip() if heard_tokens else ""
        r.kept_tokens = 0 if withdraw else heard_tokens
        out: list[Output] = [
            InterruptReply(r.number, heard_tokens, withdraw=withdraw),
            StopAudio(r.number),
            ReplyInterrupted(r.number, 1000 * heard_samples / OUTPUT_SAMPLE_RATE, heard_text, reason, by),
        ]
        r.sent = True
        if withdraw:
            self._turn_words = [*self._ended_words, *self._turn_words]
            out.append(TurnContinued(r.number, " ".join(self._turn_words)))
        out += self._leave_reply()
        if withdraw:
            self._spoken = None  # (nothing of it is left to truncate)
        return out

    def rebase_output(self, sent_samples: int) -> None:
        """After `StopAudio`: the output stream holds exactly what was sent, and the client skips what it
        had not played (its played position jumps to the end of what it received)."""
        self._out_samples = sent_samples
        self._played_samples = max(self._played_samples, sent_samples)

    @staticmethod
    def _heard_chars(r: _Reply, heard_samples: int) -> int:
        """Characters of the reply text voiced in its first `heard_samples` samples: whole pieces, then the
        part of the current piece in proportion to its time, cut back to a word boundary."""
        start_char, at = 0, 0
        for (end_char, _), n in zip(r.pieces, r.piece_samples, strict=False):
            if heard_samples >= at + n:
                start_char, at = end_char, at + n
                continue
            if n == 0:
                break
            cut = start_char + int((end_char - start_char) * (heard_samples - at) / n)
            space = r.text.rfind(" ", start_char, cut + 1)
            return space if space > start_char else start_char
        return start_char
