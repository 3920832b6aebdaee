"""A Realtime session's out-of-band responses (`response.create` with `conversation: "none"` or `input`).

Each runs on a dialog session of its own, opened for it (its context: the conversation's items, or the
`input` given) and closed when it ends; its text goes out as `output_text` events. Text only: the voice
pipeline belongs to the conversation. Without a free dialog session the response fails as a response (no
`error`: OpenAI accepts the request).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from duplexd import commands as cmd
from duplexd.errors import Overloaded
from duplexd.scheduler.dialog import DialogWorker
from duplexd.transport.realtime_out import RealtimeOut, Response, part, part_ids

MAX_OUT_OF_BAND = 4  # out-of-band responses in progress at once (each holds a dialog session)


class OutOfBand:
    def __init__(self, dialog: DialogWorker, out: RealtimeOut, send: Callable[[dict[str, Any]], None]) -> None:
        self._dialog, self._out, self._send = dialog, out, send
        self._live: dict[str, _Reply] = {}  # response id -> in progress

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._live

    async def start(
        self,
        r: Response,
        system: str,
        turns: list[tuple[str, str]],
        rate_limits: list[dict[str, Any]],
        alive: Callable[[], bool],
    ) -> None:
        """Answer with `system` and `turns` as the context (`alive`: the connection is still there once a
        dialog session is open)."""
        out = self._out
        self._send(out.event("response.created", response=out.response_object(r, "in_progress", in_conversation=False)))
        self._send(out.event("rate_limits.updated", rate_limits=rate_limits))
        reply = _Reply(self, r)
        if len(self._live) >= MAX_OUT_OF_BAND:
            reply.fail(f"{MAX_OUT_OF_BAND} out-of-band responses are in progress already.")
            return
        try:
            reply.sid = await self._dialog.open(reply)
        except Overloaded as exc:
            reply.fail(f"No dialog session is free for an out-of-band response ({exc}).")
            return
        if not alive():
            self._dialog.close(reply.sid)
            return
        self._live[r.id] = reply
        open_user = turns.pop()[1] if turns and turns[-1][0] == "user" else ""
        self._dialog.submit(reply.sid, cmd.ReplaceContext(system, tuple(turns), open_user))
        self._dialog.submit(reply.sid, cmd.StartReply(1))
        item = out.message(r, "in_progress", [])
        self._send(out.event("response.output_item.added", response_id=r.id, output_index=0, item=item))
        self._send(out.event("response.content_part.added", **part_ids(r), part=part(r)))

    def cancel(self, response_id: str) -> None:
        self._live[response_id].finish("cancelled", "client_cancelled")

    def close(self) -> None:
        """The client is gone: free their dialog sessions."""
        for reply in self._live.values():
            if reply.sid is not None:
                self._dialog.close(reply.sid)
        self._live.clear()


class _Reply:
    """One out-of-band response: the dialog worker's client for its dialog session."""

    def __init__(self, owner: OutOfBand, r: Response) -> None:
        self.owner, self.r = owner, r
        self.sid: int | None = None
        self.tokens = 0

    def _send(self, kind: str, **fields: Any) -> None:
        self.owner._send(self.owner._out.event(kind, **fields))

    def on_reply(self, reply: int, texts: list[str], done: bool) -> None:  # DialogClient
        r = self.r
        if r.id not in self.owner:
            return
        self.tokens += len(texts)
        text = texts[-1] if texts else r.text
        if text.startswith(r.text) and len(text) > len(r.text):
            delta, r.text = text[len(r.text) :], text
            self._send("response.output_text.delta", **part_ids(r), delta=delta)
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

    def on_relay(self, reply: int, text: str, model: str, remote_model: str, decided_ms: float) -> None:  # DialogClient
        pass

    def on_tools(self, reply: int, events: list[object]) -> None:  # DialogClient (no tools out of band)
        pass

    def finish(self, status: str, reason: str | None) -> None:
        """The response ends (`completed`, or `incomplete` / `cancelled` before its end): its dialog
        session is closed, and its last events go out."""
        r, out = self.r, self.owner._out
        self.owner._live.pop(r.id, None)
        if self.sid is not None:
            self.owner._dialog.close(self.sid)
            self.sid = None
        for event in out.ended(r, status, reason, in_conversation=False):
            self.owner._send(event)

    def fail(self, message: str) -> None:
        """No dialog session for it: the response fails (no `error`: OpenAI accepts the request)."""
        response = self.owner._out.response_object(self.r, "failed", in_conversation=False)
        response["status_details"] = {
            "type": "failed",
            "error": {"type": "server_error", "code": "out_of_band_unavailable", "message": message},
        }
        self._send("response.done", response=response)
