"""The LLM's context follows the Realtime conversation's items.

Edits at the end stay in place: a user message appended, a barge-in, a truncate of the last response. Every
other edit (`conversation.item.delete`, assistant and system items, items inserted earlier, a truncate of an
older response) marks the context stale, and it is rebuilt from the items (`realtime_items.render`) between
responses: `sync` runs after every client event and as every response ends. A response's own `instructions`
rebuild it for that response; the session's come back after it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from duplexd.transport import realtime as rt
from duplexd.transport.realtime_items import Items, heard_part, render, words
from duplexd.transport.realtime_out import RealtimeOut
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE

if TYPE_CHECKING:
    from duplexd.transport.connection import Connection

log = logging.getLogger(__name__)


class LlmContext:
    """The conversation's items as the client edits them, and the LLM context that follows them."""

    def __init__(self, conn: Connection, items: Items, out: RealtimeOut, settings: rt.SessionSettings) -> None:
        self.conn, self.items, self.out, self.settings = conn, items, out, settings
        self.prompt = settings.instructions  # the instructions the LLM context was built with
        self.stale = False  # the items were edited in a way the context does not show yet

    def _ev(self, kind: str, **fields: Any) -> None:
        self.conn.send(self.out.event(kind, **fields))

    def create_item(self, event: rt.ItemCreate, event_id: str | None, now: float) -> None:
        """A user message at the end joins the LLM's context in place (a whole turn, unless the user is
        speaking: then it joins that turn); any other item, or one inserted earlier, is kept where the client
        put it and the context is rebuilt from the items (between responses)."""
        session, conv = self.conn.session, self.conn.conversation
        assert session is not None and conv is not None
        previous = event.previous_item_id
        if previous is not None and previous != "root" and previous not in self.items:
            raise rt.RealtimeError(
                "item_create_invalid_previous_item_id",
                f"Previous item with id {previous[:64]} not found.",
                param="previous_item_id",
                event_id=event_id,
            )
        at_end = previous in (None, self.items.last) or (previous == "root" and not self.items)
        joins_turn = event.role == "user" and bool(event.text) and at_end
        if joins_turn:
            self.refuse_while_responding("adding items", event_id, now)
        item = {**event.item, "id": event.item_id or self.out.ids.new("item"), "object": "realtime.item"}
        item.setdefault("status", "completed")
        after = self.items.last if previous is None else None if previous == "root" else previous
        for kind in ("conversation.item.added", "conversation.item.done"):
            self._ev(kind, previous_item_id=after, item=item)
        self.items.insert(item, after)
        if joins_turn:
            # A whole turn that waits for response.create, unless the user is speaking (it joins that turn).
            own = session.heard_s if self.out.user_item is None else None
            self.conn.dispatch(conv.user_text(event.text, own_turn_at=own), now)
        elif event.role is not None or item["type"] in ("function_call", "function_call_output"):
            self.stale = True  # (a tool exchange is part of the context: `realtime_items.render`)
            self.sync(now)
        else:
            log.info("session %s: %s item kept; not part of the LLM's context", session.id, item.get("type"))

    def refuse_while_responding(self, doing: str, event_id: str | None, now: float) -> None:
        """OpenAI's error for a response or a user item while a response is in progress (one that has had
        its `response.done` is over for the client)."""
        self.settle_reply(now)
        conv = self.conn.conversation
        if conv is not None and conv.replying:
            raise rt.RealtimeError(
                "conversation_already_has_active_response",
                "Conversation already has an active response in progress. Wait until the response is finished "
                f"before {doing}.",
                event_id=event_id,
            )

    def rebuild(self, instructions: str, now: float) -> None:
        """Give the LLM the context the items now describe, with `instructions` (not during a response)."""
        conv = self.conn.conversation
        assert conv is not None
        system, turns = render(self.items.values(), instructions)
        out = conv.replace_context(system, turns)
        if out:
            log.info("session %s: LLM context rebuilt from %d turns", self._sid, len(turns))
            self.conn.dispatch(out, now)
            self.stale, self.prompt = False, instructions

    @property
    def outdated(self) -> bool:
        """The items were edited, or a response's own instructions are still in the LLM's context."""
        return self.stale or self.prompt != self.settings.instructions

    def sync(self, now: float) -> None:
        """Between responses: rebuild the LLM's context if the items were edited, or if a response's own
        instructions are still in it."""
        conv = self.conn.conversation
        if conv is None or self.out.response is not None:
            return
        if self.outdated:
            self.settle_reply(now)  # (the response is over for the client: its audio no longer counts as a reply)
            if not conv.replying:
                self.rebuild(self.settings.instructions, now)

    def settle_reply(self, now: float) -> None:
        """After `response.done` the response is over for a Realtime client, whose playback the server
        does not hear about: count its audio as played, so the conversation takes the next turn."""
        conv = self.conn.conversation
        if conv is not None and conv.replying and self.out.response is None:
            self.conn.clock.anchor(self.conn.playout.sent, now)
            self.conn.dispatch(conv.played(self.conn.playout.sent), now)

    def truncate(self, item_id: str, index: int, end_ms: int, event_id: str | None, now: float) -> None:
        """The client stopped playing item `item_id` at `end_ms` of its audio: that is what the user heard. The
        response in progress stops there; the last response keeps only that much in the LLM's context."""
        conv = self.conn.conversation
        assert conv is not None
        item, reply = self.items.get(item_id), self.items.reply_of(item_id)
        if item is None or reply is None:
            raise rt.RealtimeError(
                "item_truncate_invalid_item_id",
                f"Item with item_id not found or not an assistant message: {item_id[:64]}",
                param="item_id",
                event_id=event_id,
            )
        r = self.out.response
        audio_ms = self.items.audio_ms(item_id)
        if (r is None or r.item_id != item_id) and end_ms > audio_ms + 1:  # (in progress: its audio is still made)
            raise rt.RealtimeError(
                "invalid_value",
                f"Audio content of {round(audio_ms)}ms is already shorter than {end_ms}ms",
                param="audio_end_ms",
                event_id=event_id,
            )
        heard_samples = round(end_ms * OUTPUT_SAMPLE_RATE / 1000)
        if conv.replying and conv.reply_start_sample is not None:  # (pacing: where the client's playback is)
            played = min(self.conn.playout.sent, conv.reply_start_sample + heard_samples)
            self.conn.clock.anchor(played, now)
        cut = conv.truncate(reply, heard_samples)
        if cut is not None:
            heard, outputs = cut
            self.conn.dispatch(outputs, now)
            self.items.set_words(item_id, heard)
        else:  # an older response: its words in proportion to the audio heard, and the context rebuilt
            self.items.set_words(item_id, heard_part(words(item), end_ms / audio_ms if audio_ms else 0.0))
            self.stale = True
            self.sync(now)
        self._ev("conversation.item.truncated", item_id=item_id, content_index=index, audio_end_ms=end_ms)

    @property
    def _sid(self) -> str:
        return self.conn.session.id if self.conn.session is not None else "-"

    def delete(self, item_id: str, event_id: str | None, now: float) -> None:
        """Forget an item; the LLM's context is rebuilt without it (between responses)."""
        if item_id not in self.items:
            raise rt.RealtimeError(
                "item_delete_invalid_item_id",
                f"Item with item_id not found: {item_id[:64]}",
                param="item_id",
                event_id=event_id,
            )
        self.items.delete(item_id)
        self._ev("conversation.item.deleted", item_id=item_id)
        self.stale = True
        self.sync(now)
