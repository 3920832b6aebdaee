"""`duplexd chat`: talk to the dialog engine in a terminal (text only; for trying models and debugging).

Each line you type is one user turn; the reply streams as the engine decodes it. Lines starting with `/`
are commands: `/reset` starts a new conversation, `/stats` shows the session's KV use, `/quit` leaves.
"""

from __future__ import annotations

import time
from typing import TextIO

from duplexd.dialog.engine import DialogEngine

HELP = "Type a message and press Enter. /reset starts over, /stats shows KV use, /quit (or Ctrl-D) leaves."


class _Streamer:
    """Turns reply token ids into text increments (a character can span several byte-level tokens)."""

    def __init__(self, engine: DialogEngine) -> None:
        self.engine = engine
        self.tokens: list[int] = []
        self.shown = ""

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.engine.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new


def reply(engine: DialogEngine, sid: int, text: str, out: TextIO) -> tuple[int, float]:
    """One user turn: ingest `text`, stream the reply to `out`. Returns (reply tokens, seconds decoding)."""
    engine.append_user_text(sid, text)
    while engine.busy():
        engine.step()
    engine.start_reply(sid)
    streamer = _Streamer(engine)
    first_s: float | None = None
    while engine.replying(sid):
        tokens = engine.step().get(sid, [])
        if tokens and first_s is None:
            first_s = time.perf_counter()
        out.write(streamer.push(tokens))
        out.flush()
    while engine.busy():  # the end-of-reply marker goes into the context now, not at the next turn
        engine.step()
    out.write("\n")
    decode_s = time.perf_counter() - first_s if first_s is not None else 0.0
    return len(streamer.tokens), decode_s


def run_chat(engine: DialogEngine, inp: TextIO, out: TextIO, *, interactive: bool) -> int:
    if interactive:
        out.write(HELP + "\n")
    sid = engine.open()
    while True:
        if interactive:
            out.write("you> ")
            out.flush()
        line = inp.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            break
        if text == "/reset":
            engine.close(sid)
            sid = engine.open()
            out.write("(new conversation)\n")
            continue
        if text == "/stats":
            out.write(
                f"tokens seen {engine.tokens_seen(sid)}, resident KV {engine.resident_tokens(sid)} "
                f"of {engine.config.window.capacity} (sinks {engine.config.window.sink_tokens})\n"
            )
            continue
        if interactive:
            out.write("bot> ")
        n, decode_s = reply(engine, sid, text, out)
        if interactive and n > 1 and decode_s > 0:
            out.write(f"({n} tokens, {(n - 1) / decode_s:.1f} tok/s)\n")
    engine.close(sid)
    return 0
