"""`/v1/realtime`: an OpenAI Realtime session on the same session core as `/v1/stream`.

The connection is a `Connection` (the same `Session`, `Conversation`, workers, pacing, admission and
limits) that reads OpenAI client events and writes OpenAI server events instead of the native ones:

    input_audio_buffer.append     -> 24 kHz PCM16 frames into the Session (VAD, streaming ASR)
    VAD speech start / stop       -> input_audio_buffer.speech_started / speech_stopped
    committed words (LocalAgreement) -> conversation.item.input_audio_transcription.delta
    end of turn (endpointer, or commit) -> input_audio_buffer.committed, conversation.item.added,
                                        ...transcription.completed, conversation.item.done
    reply                         -> response.created, response.output_item.added, conversation.item.added,
                                     response.content_part.added, ...output_audio_transcript.delta (or
                                     output_text.delta), response.output_audio.delta, ... .done,
                                     response.done (completed, or cancelled on barge-in / response.cancel)

Audio goes out paced as on the native path (at most `audio_lead_ms` ahead of real-time playback: a Realtime
client sends no playback reports); `conversation.item.truncate` tells the server where playback stopped, for
the response in progress or the last one (its audio may still play after `response.done`).

The conversation's items (user turns, typed messages, responses) are kept, at most `MAX_ITEMS`, for
`conversation.item.retrieve`, `.delete` and `.truncate`. Fields duplexd accepts and does not honour are logged
once per update (never an `error`: clients end their session on errors OpenAI would not send).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from duplexd import commands as cmd
from duplexd.errors import ErrorCode, Overloaded
from duplexd.events import (
    ErrorRaised,
    Event,
    ReplyDone,
    ReplyInterrupted,
    ReplyStarted,
    SpeechStarted,
    SpeechStopped,
    TranscriptUpdated,
    TurnEnded,
    UtteranceFinalized,
)
from duplexd.streaming import conversation as cv
from duplexd.transport import protocol
from duplexd.transport import realtime as rt
from duplexd.transport.connection import CLOSE_POLICY, CLOSE_TRY_AGAIN_LATER, Connection, _Closing
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

log = logging.getLogger(__name__)

COMMIT_SILENCE_S = 0.7  # `input_audio_buffer.commit`: silence appended so the recognizer finalizes the words
# Errors that answer a race with the server (a cancel as the response ends, a response.create as one starts):
# clients ignore them, and they do not count towards `max_errors` (a long session has many barge-ins).
RACES = frozenset(
    {"response_cancel_not_active", "conversation_already_has_active_response", "input_audio_buffer_commit_empty"}
)
MAX_ITEMS = 256  # conversation items kept for retrieve / delete / truncate (the oldest are forgotten)
# A context rebuilt from the items (after an edit the KV cannot make in place) holds the newest turns up to
# this many characters (~2k tokens: more than the KV window keeps, and a bounded prefill).
MAX_CONTEXT_CHARS = 8000
MAX_OUT_OF_BAND = 4  # out-of-band responses in progress at once (each holds a dialog session)
# semantic_vad `eagerness`: factors on the server's end-of-turn silences (min: a complete sentence, max: not)
EAGERNESS = {"high": (0.5, 0.5), "medium": (1.0, 1.0), "auto": (1.0, 1.0), "low": (1.5, 2.0)}


@dataclasses.dataclass(slots=True)
class _Response:
    id: str
    item_id: str
    reply: int
    modalities: tuple[str, ...]
    metadata: dict[str, str] | None = None
    max_output_tokens: int | None = None
    text: str = ""
    audio_ms: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class _Pending:
    """`response.create`'s parameters, for the response it starts."""

    modalities: tuple[str, ...] | None
    metadata: dict[str, str] | None
    max_output_tokens: int | None


class RealtimeConnection(Connection):
    numbered = False
    reports_playback = False

    def __init__(self, server: Any, ws: Any) -> None:
        super().__init__(server, ws)
        self.ids = rt.Ids("")
        self.settings = rt.SessionSettings(instructions=server.config.dialog.system_prompt)
        self._user_item: str | None = None  # the user item being spoken (audio), until its turn ends
        self._previous_item: str | None = None
        self._utt_sent: dict[int, int] = {}  # utterance -> words already sent as transcription deltas
        self._response: _Response | None = None
        self._next: _Pending | None = None  # response.create's, for the next response
        self._commit_pending = False
        self._in_seq = 0
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()  # id -> the item as last reported
        self._item_reply: dict[str, int] = {}  # assistant item id -> its reply
        self._item_audio_ms: dict[str, float] = {}  # assistant item id -> its audio sent
        self._idle_since: float | None = None  # (idle_timeout_ms) since the last response played out
        self._responded = False  # a response has ended (the idle timeout counts only after one)
        # The LLM's context follows the items: appended to in place, rebuilt from them after other edits.
        self._context_prompt = self.settings.instructions  # the instructions the LLM context was built with
        self._stale = False  # the items were edited in a way the context does not show yet
        self._oob: dict[str, _OutOfBand] = {}  # response id -> out-of-band response in progress
        t = server.config
        self._vad_defaults = rt.VadDefaults(t.vad.threshold, round(1000 * t.asr.preroll_s), t.turn.min_silence_ms)

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def _opening(self) -> None:
        try:
            await self._start(protocol.SessionStart(version=1, sample_rate=rt.AUDIO_RATE, dialog=True))
        except Overloaded as exc:
            self.ended = True
            extra = {} if exc.retry_after_ms is None else {"retry_after_ms": exc.retry_after_ms}
            self._out_error(ErrorCode.OVERLOADED, str(exc), **extra)
            raise _Closing(CLOSE_TRY_AGAIN_LATER, "overloaded") from None
        if self.conversation is None:
            self._rt_error(rt.RealtimeError("server_error", "This server runs without a dialog model."))
            self.ended = True
            raise _Closing(CLOSE_POLICY, "no dialog model")

    def _started_message(self, msg: protocol.SessionStart, dialog: bool) -> dict[str, Any]:
        assert self.session is not None
        self.ids = rt.Ids(self.session.id)
        return {
            "type": "session.created",
            "event_id": self.ids.new("event"),
            "session": rt.session_object(self.session.id, self.settings, self._vad_defaults),
        }

    def _new_conversation(self) -> cv.Conversation:
        conv = super()._new_conversation()
        self._apply_turn_detection(conv, self.settings.turn_detection)
        return conv

    def release(self) -> None:
        for oob in list(self._oob.values()):  # (their dialog sessions: the client is gone)
            if oob.sid is not None and self.server.dialog is not None:
                self.server.dialog.close(oob.sid)
        self._oob.clear()
        super().release()

    # -- client events -----------------------------------------------------------------------------------

    async def _on_audio(self, data: bytes) -> None:
        self._client_error(rt.RealtimeError("invalid_event", "Binary messages are not part of this protocol."))

    async def _on_text(self, data: str) -> bool:
        try:
            event, event_id = rt.parse(data)
            await self._handle_event(event, event_id)
        except rt.RealtimeError as exc:
            self._client_error(exc)
        return False

    def _client_error(self, exc: rt.RealtimeError) -> None:
        self._rt_error(exc)
        if exc.code in RACES:
            return  # (not a client's fault: it could not know)
        self.server.counters["protocol_errors"] += 1
        self.errors += 1
        if self.errors >= self.server.config.transport.max_errors:
            self._rt_error(rt.RealtimeError(ErrorCode.TOO_MANY_ERRORS.value, "Too many invalid events."))
            raise _Closing(CLOSE_POLICY, ErrorCode.TOO_MANY_ERRORS.value)

    def _rt_error(self, exc: rt.RealtimeError, kind: str = "invalid_request_error") -> None:
        self.send(rt.error_event(self.ids, exc, kind))

    async def _handle_event(self, event: rt.ClientEvent, event_id: str | None) -> None:
        session, conv = self.session, self.conversation
        assert session is not None and conv is not None
        match event:
            case rt.AudioAppend(pcm=pcm):
                await self._append(pcm)
            case rt.SessionUpdate():
                await self._update(event, event_id)
            case rt.AudioCommit():
                if conv.auto_turns and self._user_item is None:  # (with VAD: the server committed it already)
                    raise rt.RealtimeError(
                        "input_audio_buffer_commit_empty",
                        "Error committing input audio buffer: no speech since the last commit.",
                        event_id=event_id,
                    )
                self._commit_pending = True
                silence = np.zeros(int(COMMIT_SILENCE_S * rt.AUDIO_RATE), "<i2").tobytes()
                await self._append(silence, limited=False)  # (ours, not the client's: not rate limited)
                self._maybe_commit()
            case rt.AudioClear():
                conv.clear()
                self._user_item = None
                self._ev("input_audio_buffer.cleared")
            case rt.OutputAudioClear():
                r = self._response
                if r is not None:
                    self._dispatch(conv.cancel())
                    self._ev("output_audio_buffer.cleared", response_id=r.id)
            case rt.ItemCreate():
                self._create_item(event, event_id)
            case rt.ResponseCreate():
                await self._respond(event, event_id)
            case rt.ResponseCancel(response_id=rid) if rid is not None and rid in self._oob:
                self._oob[rid].finish("cancelled", "client_cancelled")
            case rt.ResponseCancel(response_id=rid):
                r = self._response
                if r is None or (rid is not None and rid != r.id):
                    raise rt.RealtimeError(
                        "response_cancel_not_active",
                        "Cancellation failed: no active response found",
                        event_id=event_id,
                    )
                self._dispatch(conv.cancel())
            case rt.ItemTruncate(item_id=item_id, content_index=index, audio_end_ms=end_ms):
                self._truncate(item_id, index, end_ms, event_id)
            case rt.ItemRetrieve(item_id=item_id):
                item = self._items.get(item_id)
                if item is None:
                    raise rt.RealtimeError(
                        "item_retrieve_invalid_item_id",
                        f"Item with item_id not found: {item_id[:64]}",
                        param="item_id",
                        event_id=event_id,
                    )
                self._ev("conversation.item.retrieved", item=item)
            case rt.ItemDelete(item_id=item_id):
                self._delete(item_id, event_id)

    def _create_item(self, event: rt.ItemCreate, event_id: str | None) -> None:
        """A user message at the end joins the LLM's context in place (a whole turn, unless the user is
        speaking: then it joins that turn); any other item, or one inserted earlier, is kept where the client
        put it and the context is rebuilt from the items (between responses)."""
        session, conv = self.session, self.conversation
        assert session is not None and conv is not None
        previous = event.previous_item_id
        if previous is not None and previous != "root" and previous not in self._items:
            raise rt.RealtimeError(
                "item_create_invalid_previous_item_id",
                f"Previous item with id {previous[:64]} not found.",
                param="previous_item_id",
                event_id=event_id,
            )
        at_end = previous in (None, self._previous_item) or (previous == "root" and not self._items)
        if event.role == "user" and at_end and event.text:
            self._settle_reply()
            if conv.replying:
                raise rt.RealtimeError(
                    "conversation_already_has_active_response",
                    "Conversation already has an active response in progress. Wait until the response is "
                    "finished before adding items.",
                    event_id=event_id,
                )
        item = {**event.item, "id": event.item_id or self.ids.new("item"), "object": "realtime.item"}
        item.setdefault("status", "completed")
        after = self._previous_item if previous is None else None if previous == "root" else previous
        for kind in ("conversation.item.added", "conversation.item.done"):
            self._ev(kind, previous_item_id=after, item=item)
        self._insert_item(item, after)
        if event.role == "user" and at_end and event.text:
            # A whole turn that waits for response.create, unless the user is speaking (it joins that turn).
            own = session.heard_s if self._user_item is None else None
            self._dispatch(conv.user_text(event.text, own_turn_at=own))
        elif event.role is not None:
            self._stale = True
            self._sync_context()
        else:
            log.info("session %s: %s item kept; not part of the LLM's context", session.id, item.get("type"))

    def _insert_item(self, item: dict[str, Any], after: str | None) -> None:
        """Keep `item` after item `after` (None: first)."""
        if after == self._previous_item:
            self._keep_item(item)
            self._previous_item = item["id"]
            return
        items = list(self._items.items())
        at = 0 if after is None else next(i for i, (key, _) in enumerate(items) if key == after) + 1
        items.insert(at, (item["id"], dict(item)))
        self._items = OrderedDict(items)
        self._forget_oldest()

    async def _respond(self, event: rt.ResponseCreate, event_id: str | None) -> None:
        session, conv = self.session, self.conversation
        assert session is not None and conv is not None
        if event.ignored:
            log.info("session %s: response.create: not honoured here: %s", session.id, ", ".join(event.ignored))
        max_tokens = self.settings.max_output_tokens if event.max_output_tokens is False else event.max_output_tokens
        assert max_tokens is None or isinstance(max_tokens, int)
        if event.out_of_band:
            await self._out_of_band(event, max_tokens, event_id)
            return
        self._settle_reply()
        if conv.replying:
            raise rt.RealtimeError(
                "conversation_already_has_active_response",
                "Conversation already has an active response in progress. Wait until the response is finished "
                "before creating a new one.",
                event_id=event_id,
            )
        instructions = self.settings.instructions if event.instructions is None else event.instructions
        if self._stale or instructions != self._context_prompt:
            self._rebuild(instructions)  # (this response's own instructions: the session's come back after it)
        self._next = _Pending(event.output_modalities, event.metadata, max_tokens)
        self._dispatch(conv.respond(session.heard_s, max_tokens=max_tokens))

    async def _out_of_band(self, event: rt.ResponseCreate, max_tokens: int | None, event_id: str | None) -> None:
        """`conversation: "none"` or `input` items: a response outside the conversation, on a dialog session
        of its own (the conversation's items, or the `input` given, as its context). Text only: the voice
        pipeline belongs to the conversation. It fails as a response (no `error`) when no dialog session is
        free."""
        server = self.server
        assert server.dialog is not None
        items: list[dict[str, Any]] = list(self._items.values())
        if event.input is not None:
            items = []
            for given in event.input:
                if isinstance(given, str):
                    if given not in self._items:
                        raise rt.RealtimeError(
                            "invalid_value",
                            f"Item with id {given[:64]} not found in the conversation.",
                            param="response.input",
                            event_id=event_id,
                        )
                    items.append(self._items[given])
                else:
                    items.append({**given.item, "id": given.item_id or self.ids.new("item")})
        instructions = self.settings.instructions if event.instructions is None else event.instructions
        system, turns = _render(items, instructions)
        r = _Response(self.ids.new("resp"), self.ids.new("item"), 0, ("text",), event.metadata, max_tokens)
        self._ev("response.created", response=self._response_object(r, "in_progress", conversation=False))
        self._rate_limits(r)
        oob = _OutOfBand(self, r)
        if len(self._oob) >= MAX_OUT_OF_BAND:
            oob.fail(f"{MAX_OUT_OF_BAND} out-of-band responses are in progress already.")
            return
        try:
            oob.sid = await server.dialog.open(oob)
        except Overloaded as exc:
            oob.fail(f"No dialog session is free for an out-of-band response ({exc}).")
            return
        if self.session is None:  # (the connection ended while it waited)
            server.dialog.close(oob.sid)
            return
        self._oob[r.id] = oob
        open_user = turns.pop()[1] if turns and turns[-1][0] == "user" else ""
        server.dialog.submit(oob.sid, cmd.ReplaceContext(system, tuple(turns), open_user))
        server.dialog.submit(oob.sid, cmd.StartReply(1))
        item = self._item(r, "in_progress", [])
        self._ev("response.output_item.added", response_id=r.id, output_index=0, item=item)
        self._ev("response.content_part.added", **self._part_ids(r), part=self._part(r))

    def _rebuild(self, instructions: str) -> bool:
        """Give the LLM the context the items now describe, with `instructions` (not during a response)."""
        conv = self.conversation
        assert conv is not None
        system, turns = _render(list(self._items.values()), instructions)
        out = conv.replace_context(system, turns)
        if not out:
            return False
        log.info("session %s: LLM context rebuilt from %d turns", self._sid, len(turns))
        self._dispatch(out)
        self._stale, self._context_prompt = False, instructions
        return True

    def _sync_context(self) -> None:
        """Between responses: rebuild the LLM's context if the items were edited, or if a response's own
        instructions are still in it."""
        conv = self.conversation
        if conv is None or self._response is not None:
            return
        if self._stale or self._context_prompt != self.settings.instructions:
            self._settle_reply()  # (the response is over for the client: its audio no longer counts as a reply)
            if not conv.replying:
                self._rebuild(self.settings.instructions)

    def _settle_reply(self) -> None:
        """After `response.done` the response is over for a Realtime client, whose playback the server
        does not hear about: count its audio as played, so the conversation takes the next turn."""
        conv = self.conversation
        if conv is not None and conv.replying and self._response is None:
            self._reported = (self.playout.sent, time.monotonic())
            self._dispatch(conv.played(self.playout.sent))

    async def _append(self, pcm: bytes, *, limited: bool = True) -> None:
        session = self.session
        assert session is not None
        step = 2 * rt.AUDIO_RATE * self.server.config.transport.max_frame_ms // 1000
        now = time.monotonic()
        if limited and not self.audio_limit.allow(len(pcm) / 2 / rt.AUDIO_RATE, now):
            raise rt.RealtimeError(
                "rate_limited",
                f"Audio is arriving faster than real time ({self.audio_limit.ahead_s(now):.1f} s ahead, "
                f"{self.audio_limit.burst_s:g} s allowed); this append was dropped.",
                param="audio",
            )
        for at in range(0, len(pcm), step):
            self._in_seq += 1
            chunks = session.accept_frame(self._in_seq, pcm[at : at + step], now)
            await self._run_vad(session, chunks)

    async def _update(self, u: rt.SessionUpdate, event_id: str | None) -> None:
        conv, server, session = self.conversation, self.server, self.session
        assert conv is not None and server.dialog is not None and session is not None
        ignored = list(u.ignored)
        if u.instructions is not None:
            self.settings.instructions = u.instructions  # (in the LLM's context from the next response on)
        if u.output_modalities is not None:
            self.settings.output_modalities = u.output_modalities
        if u.max_output_tokens is not False:
            assert u.max_output_tokens is None or isinstance(u.max_output_tokens, int)
            self.settings.max_output_tokens = u.max_output_tokens
            conv.max_reply_tokens = u.max_output_tokens
        if u.tool_choice is not None:
            self.settings.tool_choice = u.tool_choice
        if u.turn_detection is not False:
            td = u.turn_detection
            assert td is None or isinstance(td, rt.TurnDetection)
            self.settings.turn_detection = td
            self._apply_turn_detection(conv, td)
        if ignored:
            log.info(
                "session %s: session.update accepted; not honoured here: %s",
                session.id,
                ", ".join(ignored),
                extra={"event": "realtime.ignored", "session": session.id, "fields": ignored},
            )
        self.send(
            {
                "type": "session.updated",
                "event_id": self.ids.new("event"),
                "session": rt.session_object(session.id, self.settings, self._vad_defaults),
            }
        )
        self._sync_context()

    def _apply_turn_detection(self, conv: cv.Conversation, td: rt.TurnDetection | None) -> None:
        """server_vad: the client's threshold, pre-roll and silence (fixed: min = max); semantic_vad: the
        endpointer's own P(end of turn) and silences, scaled by eagerness."""
        conv.auto_turns = td is not None
        conv.auto_respond = td is not None and td.create_response  # (a commit waits for response.create)
        conv.barge_in = td is None or td.interrupt_response  # (without VAD the client cancels itself)
        self._idle_since = None
        base = self.server.config.turn
        turn = base
        if td is not None and td.type == "semantic_vad":
            low, high = EAGERNESS[td.eagerness]
            lo = round(base.min_silence_ms * low)
            turn = dataclasses.replace(
                base, min_silence_ms=lo, max_silence_ms=max(lo, round(base.max_silence_ms * high))
            )
        elif td is not None and td.silence_duration_ms is not None:
            turn = dataclasses.replace(
                base, min_silence_ms=td.silence_duration_ms, max_silence_ms=td.silence_duration_ms
            )
        conv.set_turn_config(turn)
        if self.session is not None:
            server_vad = td is not None and td.type == "server_vad"
            self.session.tune_vad(
                threshold=td.threshold if server_vad and td is not None else None,
                preroll_ms=td.prefix_padding_ms if server_vad and td is not None else None,
            )

    def _truncate(self, item_id: str, index: int, end_ms: int, event_id: str | None) -> None:
        """The client stopped playing item `item_id` at `end_ms` of its audio: that is what the user heard. The
        response in progress stops there; the last response keeps only that much in the LLM's context."""
        conv = self.conversation
        assert conv is not None
        item, reply = self._items.get(item_id), self._item_reply.get(item_id)
        if item is None or reply is None:
            raise rt.RealtimeError(
                "item_truncate_invalid_item_id",
                f"Item with item_id not found or not an assistant message: {item_id[:64]}",
                param="item_id",
                event_id=event_id,
            )
        r = self._response
        audio_ms = self._item_audio_ms.get(item_id, 0.0)
        if (r is None or r.item_id != item_id) and end_ms > audio_ms + 1:  # (in progress: its audio is still made)
            raise rt.RealtimeError(
                "invalid_value",
                f"Audio content of {round(audio_ms)}ms is already shorter than {end_ms}ms",
                param="audio_end_ms",
                event_id=event_id,
            )
        heard_samples = round(end_ms * OUTPUT_SAMPLE_RATE / 1000)
        if conv.replying and conv.reply_start_sample is not None:  # (pacing: where the client's playback is)
            played = min(self.playout.sent, conv.reply_start_sample + heard_samples)
            self._reported = (played, time.monotonic())
        cut = conv.truncate(reply, heard_samples)
        if cut is not None:
            heard, outputs = cut
            self._dispatch(outputs)
            self._set_transcript(item_id, heard)
        else:  # an older response: its words in proportion to the audio heard, and the context rebuilt
            self._set_transcript(item_id, _heard_part(_words(item), end_ms / audio_ms if audio_ms else 0.0))
            self._stale = True
            self._sync_context()
        self._ev("conversation.item.truncated", item_id=item_id, content_index=index, audio_end_ms=end_ms)

    @property
    def _sid(self) -> str:
        return self.session.id if self.session is not None else "-"

    def _delete(self, item_id: str, event_id: str | None) -> None:
        """Forget an item; the LLM's context is rebuilt without it (between responses)."""
        if item_id not in self._items:
            raise rt.RealtimeError(
                "item_delete_invalid_item_id",
                f"Item with item_id not found: {item_id[:64]}",
                param="item_id",
                event_id=event_id,
            )
        self._item_reply.pop(item_id, None)
        self._item_audio_ms.pop(item_id, None)
        del self._items[item_id]
        if self._previous_item == item_id:
            self._previous_item = next(reversed(self._items), None)
        self._ev("conversation.item.deleted", item_id=item_id)
        self._stale = True
        self._sync_context()

    def _set_transcript(self, item_id: str, text: str) -> None:
        item = self._items.get(item_id)
        if item is not None and item.get("content"):
            part = dict(item["content"][0])
            part["transcript" if "transcript" in part else "text"] = text
            item["content"] = [part]

    def _keep_item(self, item: dict[str, Any], reply: int | None = None, audio_ms: float = 0.0) -> None:
        if reply is not None:
            self._item_reply[item["id"]] = reply
            self._item_audio_ms[item["id"]] = audio_ms
        self._items[item["id"]] = dict(item)
        self._items.move_to_end(item["id"])
        self._forget_oldest()

    def _forget_oldest(self) -> None:
        while len(self._items) > MAX_ITEMS:
            old, _ = self._items.popitem(last=False)
            self._item_reply.pop(old, None)
            self._item_audio_ms.pop(old, None)

    def _maybe_commit(self) -> None:
        session, conv = self.session, self.conversation
        if not self._commit_pending or session is None or conv is None:
            return
        if conv.auto_turns and self._user_item is None:
            self._commit_pending = False  # the endpointer ended the turn first
            return
        if session.asr_settled and conv.text_settled:
            self._commit_pending = False
            if self._user_item is None:
                self._user_item = self.ids.new("item")
            self._dispatch(conv.commit(session.heard_s))

    def _tick(self) -> None:
        super()._tick()
        self._maybe_commit()
        self._maybe_idle()
        self._sync_context()

    def _maybe_idle(self) -> None:
        """server_vad `idle_timeout_ms`: no speech for that long once the last response has played out
        -> `input_audio_buffer.timeout_triggered`, an empty user turn, and a response."""
        session, conv, td = self.session, self.conversation, self.settings.turn_detection
        if session is None or conv is None or td is None or td.idle_timeout_ms is None or not self._responded:
            return
        now = time.monotonic()
        if conv.replying or self._user_item is not None or self._commit_pending:
            self._idle_since = None
            return
        if self._idle_since is None:
            self._idle_since = now
            return
        idle_s = now - self._idle_since
        if idle_s * 1000 < td.idle_timeout_ms:
            return
        self._idle_since = None
        self._user_item = self.ids.new("item")
        end_ms = round(1000 * session.heard_s)
        self._ev(
            "input_audio_buffer.timeout_triggered",
            audio_start_ms=max(0, end_ms - round(1000 * idle_s)),
            audio_end_ms=end_ms,
            item_id=self._user_item,
        )
        self._next = _Pending(None, None, self.settings.max_output_tokens)
        self._dispatch(conv.respond(session.heard_s, max_tokens=self.settings.max_output_tokens))

    # -- server events -----------------------------------------------------------------------------------

    def _user_text_item(self, item_id: str, text: str) -> None:
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_text", "text": text}],
        }
        for kind in ("conversation.item.added", "conversation.item.done"):
            self.send(
                {"type": kind, "event_id": self.ids.new("event"), "previous_item_id": self._previous_item, "item": item}
            )
        self._keep_item(item)
        self._previous_item = item_id

    def _ev(self, kind: str, **fields: Any) -> None:
        self.send({"type": kind, "event_id": self.ids.new("event"), **fields})

    def _out_event(self, event: Event) -> None:
        send, ids = self.send, self.ids
        match event:
            case SpeechStarted(t_s=t):
                if self._user_item is None:
                    self._user_item = ids.new("item")
                send(
                    {
                        "type": "input_audio_buffer.speech_started",
                        "event_id": ids.new("event"),
                        "audio_start_ms": round(1000 * t),
                        "item_id": self._user_item,
                    }
                )
            case SpeechStopped(t_s=t) if self._user_item is not None:
                send(
                    {
                        "type": "input_audio_buffer.speech_stopped",
                        "event_id": ids.new("event"),
                        "audio_end_ms": round(1000 * t),
                        "item_id": self._user_item,
                    }
                )
            case TranscriptUpdated(utterance=u, words=words, committed=n):
                self._transcript_delta(u, words[:n])
            case UtteranceFinalized(utterance=u, words=words):
                self._transcript_delta(u, words)
            case TurnEnded(text=text, eos_s=eos):
                self._user_turn_done(text, eos)
            case ReplyStarted(reply=reply):
                self._response_started(reply)
            case ReplyDone(reply=reply, text=text):
                self._response_done(reply, text, "completed", None)
            case ReplyInterrupted(reply=reply, heard_text=heard, reason=reason):
                why = "turn_detected" if reason == "barge_in" else "client_cancelled"
                self._response_done(reply, heard, "cancelled", why)
            case ErrorRaised(code=code, message=message):
                self._rt_error(rt.RealtimeError(str(code), message), kind="server_error")
            case _:
                pass  # frame acks, speculation reports: not part of this protocol

    def _transcript_delta(self, utterance: int, words: tuple[Any, ...]) -> None:
        sent = self._utt_sent.get(utterance, 0)
        new = [w.text.strip() for w in words[sent:] if w.text.strip()]
        self._utt_sent[utterance] = max(sent, len(words))
        if not new or self._user_item is None or (self.conversation is not None and self.conversation.replying):
            return
        self.send(
            {
                "type": "conversation.item.input_audio_transcription.delta",
                "event_id": self.ids.new("event"),
                "item_id": self._user_item,
                "content_index": 0,
                "delta": " ".join(new) + " ",
            }
        )

    def _user_turn_done(self, text: str, eos_s: float) -> None:
        item_id, self._user_item = self._user_item, None
        if item_id is None:  # a turn of typed items only: they were reported when created
            return
        ids, send = self.ids, self.send
        send(
            {
                "type": "input_audio_buffer.committed",
                "event_id": ids.new("event"),
                "previous_item_id": self._previous_item,
                "item_id": item_id,
            }
        )
        item: dict[str, Any] = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": None}],
        }
        self._ev("conversation.item.added", previous_item_id=self._previous_item, item=item)
        send(
            {
                "type": "conversation.item.input_audio_transcription.completed",
                "event_id": ids.new("event"),
                "item_id": item_id,
                "content_index": 0,
                "transcript": text,
                "usage": {"type": "duration", "seconds": round(max(0.0, eos_s), 3)},
            }
        )
        item["content"] = [{"type": "input_audio", "transcript": text}]
        self._ev("conversation.item.done", previous_item_id=self._previous_item, item=item)
        self._keep_item(item)
        self._previous_item = item_id

    def _response_started(self, reply: int) -> None:
        ids = self.ids
        pending, self._next = self._next, None
        if pending is None:  # (a reply of server VAD)
            pending = _Pending(None, None, self.settings.max_output_tokens)
        modalities = pending.modalities or self.settings.output_modalities
        r = _Response(ids.new("resp"), ids.new("item"), reply, modalities, pending.metadata, pending.max_output_tokens)
        self._response = r
        self.text_only = modalities == ("text",)
        self._ev("response.created", response=self._response_object(r, "in_progress"))
        self._rate_limits(r)
        item = self._item(r, "in_progress", [])
        self._ev("response.output_item.added", response_id=r.id, output_index=0, item=item)
        self._ev("conversation.item.added", previous_item_id=self._previous_item, item=item)
        self._keep_item(item, reply)
        self._ev("response.content_part.added", **self._part_ids(r), part=self._part(r))

    def _send_token(self, reply: int, text: str) -> None:
        r = self._response
        if r is None or r.reply != reply:
            return
        r.text += text
        kind = "response.output_text.delta" if self.text_only else "response.output_audio_transcript.delta"
        self.send({"type": kind, "event_id": self.ids.new("event"), **self._part_ids(r), "delta": text})

    def _out_audio(self, seq: int, pcm: bytes) -> None:
        r = self._response
        if r is None or self.text_only:
            return
        r.audio_ms += 1000 * len(pcm) / 2 / OUTPUT_SAMPLE_RATE
        self._ev("response.output_audio.delta", **self._part_ids(r), delta=rt.encode_audio(pcm))

    def _response_done(self, reply: int, text: str, status: str, reason: str | None) -> None:
        r = self._response
        if r is None or r.reply != reply:
            return
        self._response = None
        if status == "completed" and self.conversation is not None and self.conversation.capped(reply):
            status, reason = "incomplete", "max_output_tokens"
        part = self._part_ids(r)
        r.text = text
        if self.text_only:
            self._ev("response.output_text.done", **part, text=text)
        else:
            self._ev("response.output_audio.done", **part)
            self._ev("response.output_audio_transcript.done", **part, transcript=text)
        self._ev("response.content_part.done", **part, part=self._part(r))
        item = self._item(r, "completed" if status == "completed" else "incomplete", [self._content(r)])
        self._ev("response.output_item.done", response_id=r.id, output_index=0, item=item)
        self._ev("conversation.item.done", previous_item_id=self._previous_item, item=item)
        self._keep_item(item, reply, r.audio_ms)
        self._previous_item = r.item_id
        self._responded = True
        response = self._response_object(r, status, [item])
        if reason is not None:
            response["status_details"] = {"type": status, "reason": reason}
        self._ev("response.done", response=response)
        if self._stale or self._context_prompt != self.settings.instructions:
            asyncio.get_running_loop().call_soon(self._sync_context)  # (after the conversation's commands)

    def _rate_limits(self, r: _Response) -> None:
        """`rate_limits.updated` as a response starts. duplexd has no quotas: `requests` reports the sessions
        the server admits now and how many are free; `tokens`, this response's output budget."""
        server = self.server
        limit = max(1, round(server.admission.sessions))
        tokens = r.max_output_tokens or self.server.config.dialog.max_reply_tokens
        self._ev(
            "rate_limits.updated",
            rate_limits=[
                {"name": "requests", "limit": limit, "remaining": max(0, limit - len(server.sessions))},
                {"name": "tokens", "limit": tokens, "remaining": tokens},
            ],
        )

    def _response_object(
        self, r: _Response, status: str, output: list[Any] | None = None, *, conversation: bool = True
    ) -> dict[str, Any]:
        return {
            "id": r.id,
            "object": "realtime.response",
            "conversation_id": f"conv_{self._sid}" if conversation else None,
            "status": status,
            "output": output or [],
            "output_modalities": list(r.modalities),
            "audio": {"output": {"format": rt.AUDIO_FORMAT, "voice": self.settings.voice}},
            "max_output_tokens": "inf" if r.max_output_tokens is None else r.max_output_tokens,
            "metadata": r.metadata,
        }

    def _item(self, r: _Response, status: str, content: list[Any]) -> dict[str, Any]:
        return {
            "id": r.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _content(self, r: _Response) -> dict[str, Any]:
        if r.modalities == ("text",):
            return {"type": "output_text", "text": r.text}
        return {"type": "output_audio", "transcript": r.text}

    def _part(self, r: _Response) -> dict[str, Any]:
        if r.modalities == ("text",):
            return {"type": "text", "text": r.text}
        return {"type": "audio", "transcript": r.text}

    @staticmethod
    def _part_ids(r: _Response) -> dict[str, Any]:
        return {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}


class _OutOfBand:
    """A response outside the conversation (`RealtimeConnection._out_of_band`): the dialog worker's client
    for its own dialog session, open until the response ends; its text goes out as `output_text` events."""

    def __init__(self, conn: RealtimeConnection, r: _Response) -> None:
        self.conn, self.r = conn, r
        self.sid: int | None = None
        self.tokens = 0

    def on_reply(self, reply: int, texts: list[str], done: bool) -> None:  # DialogClient
        conn, r = self.conn, self.r
        if r.id not in conn._oob:
            return
        self.tokens += len(texts)
        text = texts[-1] if texts else r.text
        if text.startswith(r.text) and len(text) > len(r.text):
            delta, r.text = text[len(r.text) :], text
            conn._ev("response.output_text.delta", **conn._part_ids(r), delta=delta)
        if r.max_output_tokens is not None and self.tokens >= r.max_output_tokens and not done:
            self.finish("incomplete", "max_output_tokens")
        elif done:
            self.finish("completed", None)

    def on_p_end(self, p: float, version: int) -> None:  # DialogClient (no user turn here)
        pass

    def on_draft(self, texts: list[str]) -> None:  # DialogClient (no drafts here)
        pass

    def on_speculation(self, reply: int, drafts: int, hit: bool, draft_tokens: int) -> None:  # DialogClient
        pass

    def finish(self, status: str, reason: str | None) -> None:
        """The response ends (`completed`, or `incomplete` / `cancelled` before its end): its dialog
        session is closed, and its last events go out."""
        conn, r = self.conn, self.r
        conn._oob.pop(r.id, None)
        if self.sid is not None and conn.server.dialog is not None:
            conn.server.dialog.close(self.sid)
            self.sid = None
        part = conn._part_ids(r)
        conn._ev("response.output_text.done", **part, text=r.text)
        conn._ev("response.content_part.done", **part, part=conn._part(r))
        item = conn._item(r, "completed" if status == "completed" else "incomplete", [conn._content(r)])
        conn._ev("response.output_item.done", response_id=r.id, output_index=0, item=item)
        response = conn._response_object(r, status, [item], conversation=False)
        if reason is not None:
            response["status_details"] = {"type": status, "reason": reason}
        conn._ev("response.done", response=response)

    def fail(self, message: str) -> None:
        """No dialog session for it: the response fails (no `error`: OpenAI accepts the request)."""
        conn, r = self.conn, self.r
        response = conn._response_object(r, "failed", conversation=False)
        response["status_details"] = {
            "type": "failed",
            "error": {"type": "server_error", "code": "out_of_band_unavailable", "message": message},
        }
        conn._ev("response.done", response=response)


def _words(item: dict[str, Any]) -> str:
    """A message item's words: its text parts, and its audio parts' transcripts."""
    parts = item.get("content") or []
    words = (p.get("text") or p.get("transcript") or "" for p in parts if isinstance(p, dict))
    return " ".join(w for w in words if isinstance(w, str) and w).strip()


def _render(items: list[dict[str, Any]], instructions: str) -> tuple[str, list[tuple[str, str]]]:
    """The LLM context the items describe: the system prompt (`instructions`, then any system messages'
    words) and the user and assistant turns, the newest up to `MAX_CONTEXT_CHARS`. Other items (function
    calls and their outputs) are not part of it."""
    system, turns = [instructions], []
    for item in items:
        role = item.get("role") if item.get("type") == "message" else None
        words = _words(item) if role is not None else ""
        if role == "system" and words:
            system.append(words)
        elif role == "assistant" or (role == "user" and words):
            turns.append((role, words))
    kept, size = 0, 0
    for _, words in reversed(turns):
        if kept and size + len(words) > MAX_CONTEXT_CHARS:
            break
        kept, size = kept + 1, size + len(words)
    return "\n\n".join(w for w in system if w), turns[len(turns) - kept :]


def _heard_part(text: str, fraction: float) -> str:
    """The part of a reply heard when its audio stopped at `fraction` of its length (cut at a word)."""
    if fraction >= 1:
        return text
    cut = int(len(text) * max(0.0, fraction))
    space = text.rfind(" ", 0, cut + 1)
    return text[: max(space, 0)].strip()
