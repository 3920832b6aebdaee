"""Dual-path replies (`[dialog] mode = "relay"`, after RelayS2S): the local model speaks a reply's first words,
the remote model continues from exactly those words.

At the end of the user's turn (or at a pause, for a draft) the local engine (the embedded SmolLM2 by default)
decodes the reply's first tokens, keeping how sure it was of each (`engine.TokenStats`); `accept_prefix`
takes the whole words before the first token it was not sure of, at most `[relay] prefix_words`. Then the
remote request goes out with those words as the final assistant message to continue
(`RemoteDialogEngine.start_reply(prefix)`): the reply's first pieces are the prefix, the rest is the remote
model's, and the transcript holds exactly prefix + continuation. Nothing accepted: the request goes out
without a prefix (the remote model's reply alone). A server that refuses to continue a message is asked
again without it, from then on (`RemoteDialogEngine.continues`). With `[relay]
remote_at_once` (off by default: measured, it brought nothing with the remote model on the same cores)
the remote model is asked for its own reply at the end of the turn, while the prefix is decided; an
accepted prefix asks again with it (`RemoteDialogEngine.restart_reply`), none keeps that request.

    open / close / fork / adopt   -> both engines
    append_user_text              -> both (the local session first re-reads the remote transcript, see below)
    start_reply                   -> the local session decodes the prefix; `step` then starts the remote reply
    p_end_of_turn                 -> the local model's (the turn signal, as with `dialog.turn_model`)
    interrupt / reply_tokens / ...-> the remote engine's: the transcript is its

The local session reads the remote transcript's last `[relay] context_turns` turns, rewritten at the first
user words after each reply (so it reads what was heard, cut replies included). A conversation with no
local slot left is relayed by nobody: its replies are the remote model's alone.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from duplexd.config import DialogConfig, RelayConfig
from duplexd.dialog.engine import DialogEngine, EngineConfig, Priority, TokenStats
from duplexd.dialog.remote import RemoteDialogEngine, RemoteFront
from duplexd.errors import Overloaded

PREFIX_TOKENS = 24  # the most tokens the local model decodes for a prefix (5 words are ~7 of SmolLM2's)


def sure(stats: Sequence[TokenStats | None], rule: RelayConfig) -> bool:
    """The local model was sure enough of these tokens, together, to speak them for the remote one: their
    geometric-mean probability at least `min_prob`, mean entropy at most `max_entropy`, mean top-2 margin
    at least `min_margin` (`RelayConfig`). A token it did not pick (None) is never its to speak."""
    if not stats or any(s is None for s in stats):
        return False
    known = [s for s in stats if s is not None]
    n = len(known)
    probable = math.exp(sum(s.logprob for s in known) / n) >= rule.min_prob
    return (
        probable
        and sum(s.entropy for s in known) / n <= rule.max_entropy
        and sum(s.margin for s in known) / n >= rule.min_margin
    )


def accept_prefix(
    tokens: Sequence[int],
    stats: Sequence[TokenStats | None],
    decode: Callable[[Sequence[int]], str],
    rule: RelayConfig,
    done: bool,
) -> tuple[str, bool]:
    """The prefix the local model's reply so far (`tokens`, `stats`; `done`: it has ended) gives, and whether
    it is decided: the longest run of its first whole words, at most `rule.prefix_words`, whose tokens it
    was `sure` of together. Undecided until `prefix_words` words are complete (a word is, once a later token
    starts another) or the reply has ended. (Together, not token by token: SmolLM2's first reply token is
    never sure alone, p 0.04-0.38 on the question clips, while "I'm sorry for any" as a whole is.)"""
    text = decode(list(tokens))
    words = [m for m in re.finditer(r"\S+", text) if m.end() < len(text) or done]
    if not done and len(words) < rule.prefix_words:
        return "", False
    known = list(stats[: len(tokens)]) + [None] * (len(tokens) - len(stats))
    best, n = "", 0
    for word in words[: rule.prefix_words]:
        while len(decode(list(tokens[:n]))) < word.end():  # (the tokens that spell the words through this one)
            n += 1
        if sure(known[:n], rule):
            best = text[: word.end()].strip()
    return best, True


class RelayDialogEngine(RemoteFront):
    """Replies begun by a local model and continued by a remote one (see the module docstring). Not
    thread-safe, like both engines: one worker calls it."""

    reports_p_end = True

    def __init__(self, remote: RemoteDialogEngine, local: DialogEngine, relay: RelayConfig) -> None:
        super().__init__(remote)
        self.local, self.relay = local, relay
        local.record_stats = True
        self._local: dict[int, int] = {}  # remote session -> its local session (none: remote only)
        self._prompts: dict[int, str | None] = {}
        self._priority: dict[int, Priority] = {}
        self._stale: set[int] = set()  # sessions whose local side has not re-read the transcript since a reply
        self._prefixing: dict[int, Priority] = {}  # sessions whose reply waits for the local model's first words
        self._racing: set[int] = set()  # ... and whose remote request went out meanwhile, without them
        self._began: dict[int, float] = {}  # when the local model began a reply (monotonic s)
        self._decided: dict[int, tuple[str, float]] = {}  # prefix and ms to decide it, until `take_relayed`
        self.local_busy_s = 0.0
        self.relay_stats = {"replies": 0, "with_prefix": 0, "prefix_words": 0}

    @classmethod
    def from_config(cls, dialog: DialogConfig, relay: RelayConfig) -> RelayDialogEngine:
        remote = RemoteDialogEngine.from_config(dialog)
        local = replace(dialog, backend="local", mode="direct", model=relay.model)
        return cls(remote, DialogEngine.load(EngineConfig.from_config(local)), relay)

    # --- the remote engine's, but while a prefix is decided ---------------------------------------------

    def reply_tokens(self, sid: int) -> list[int]:
        """The remote reply's pieces (the prefix's first); none while the prefix is being decided (the remote
        conversation still holds the last reply then)."""
        return [] if sid in self._prefixing else self.remote.reply_tokens(sid)

    # --- both ----------------------------------------------------------------------------------------------

    def open(
        self,
        system_prompt: str | None = None,
        *,
        priority: Priority = Priority.NORMAL,
        max_reply_tokens: int | None = None,
        max_reply_sentences: int | None = None,
    ) -> int:
        sid = self.remote.open(
            system_prompt, priority=priority, max_reply_tokens=max_reply_tokens, max_reply_sentences=max_reply_sentences
        )
        try:
            self._local[sid] = self.local.open(system_prompt, priority=priority, max_reply_tokens=PREFIX_TOKENS)
        except Overloaded:  # (no local slot: this conversation's replies are the remote model's alone)
            pass
        self._prompts[sid], self._priority[sid] = system_prompt, priority
        return sid

    def close(self, sid: int) -> None:
        self.remote.close(sid)
        self._forget(sid)

    def fork(self, sid: int, *, priority: Priority = Priority.DRAFT, decode_limit: int | None = None) -> int:
        child = self.remote.fork(sid, priority=priority, decode_limit=decode_limit)
        self._prompts[child], self._priority[child] = self._prompts.get(sid), priority
        if (lsid := self._local.get(sid)) is not None:
            try:
                self._local[child] = self.local.fork(lsid, priority=priority)
            except Overloaded:
                pass
            if sid in self._stale:
                self._stale.add(child)
        return child

    def adopt(self, sid: int, draft: int) -> None:
        self.remote.adopt(sid, draft)
        own, drafted = self._local.get(sid), self._local.pop(draft, None)
        if own is not None and drafted is not None:
            self.local.adopt(own, drafted)
        elif drafted is not None:
            self.local.close(drafted)
        if self._prefixing.pop(draft, None) is not None:
            self._prefixing[sid] = Priority.NORMAL
            self._race(sid)
        for timing in (self._began, self._decided):
            if draft in timing:
                timing[sid] = timing.pop(draft)  # type: ignore[assignment]
        self._prompts.pop(draft, None)
        self._priority.pop(draft, None)
        self._stale.discard(draft)
        self._stale.add(sid)  # (the reply will follow in the transcript)

    def steps_to_reply(self, sid: int) -> int:
        """The local model's steps to its first word while the reply would start (or starts) there; then the
        remote's. A draft and its conversation are compared alike: a draft counted one step further (the
        prefix's decision) looked behind from its first step, and was dropped every time (bench relay)."""
        lsid = self._local.get(sid)
        if lsid is not None and (sid in self._prefixing or not self.remote.replying(sid)):
            return self.local.steps_to_reply(lsid)
        return self.remote.steps_to_reply(sid)

    def parked(self, sid: int) -> bool:
        return sid not in self._prefixing and self.remote.parked(sid)

    def replying(self, sid: int) -> bool:
        return sid in self._prefixing or self.remote.replying(sid)

    def busy(self, *, drafts: bool = True) -> bool:
        prefixing = any(drafts or p is Priority.NORMAL for p in self._prefixing.values())
        return prefixing or self.local.busy(drafts=drafts) or self.remote.busy(drafts=drafts)

    def append_user_text(self, sid: int, text: str) -> None:
        self.remote.append_user_text(sid, text)
        if (lsid := self._local.get(sid)) is None:
            return
        if not self._reread(sid):
            self.local.append_user_text(lsid, text)

    def retract_user_text(self, sid: int, texts: Sequence[str]) -> bool:
        if not self.remote.retract_user_text(sid, texts):
            return False
        lsid = self._local.get(sid)
        if lsid is not None and sid not in self._stale and not self.local.retract_user_text(lsid, texts):
            self._stale.add(sid)  # (its next words re-read the transcript, corrected)
        return True

    def p_end_of_turn(self, sid: int) -> float | None:
        lsid = self._local.get(sid)
        return None if lsid is None or sid in self._stale else self.local.p_end_of_turn(lsid)

    def start_reply(self, sid: int, prefix: str = "") -> None:
        if self.replying(sid):
            return
        lsid = self._local.get(sid)
        self._reread(sid)
        if prefix or lsid is None or self.local.replying(lsid) or sid in self._stale:
            self.remote.start_reply(sid, prefix)  # (given words, or no local side: the remote model alone)
        else:
            self.local.start_reply(lsid)
            self._prefixing[sid] = self._priority.get(sid, Priority.NORMAL)
            self._began[sid] = time.monotonic()
            self._decided.pop(sid, None)
            if self._prefixing[sid] is not Priority.DRAFT:  # (a draft at a pause has time to decide first)
                self._race(sid)
        self._stale.add(sid)

    def interrupt(self, sid: int, heard_tokens: int) -> None:
        if self._prefixing.pop(sid, None) is not None:  # nothing was said yet: the turn closes, empty
            self.local.interrupt(self._local[sid], 0)
            if sid not in self._racing:
                self.remote.start_reply(sid)
            self._racing.discard(sid)
            self.remote.interrupt(sid, 0)  # (also a racing reply that has already ended)
            return
        self.remote.interrupt(sid, heard_tokens)

    def withdraw_reply(self, sid: int) -> bool:
        """The remote transcript's (`RemoteDialogEngine.withdraw_reply`); the local side re-reads it at the
        user's next words. False while the local model still decides the prefix (the reply is then
        interrupted as usual)."""
        if sid in self._prefixing or not self.remote.withdraw_reply(sid):
            return False
        self._stale.add(sid)
        return True

    def rewrite(
        self, sid: int, system_prompt: str | None, turns: Sequence[tuple[str, str]], open_user: str = ""
    ) -> None:
        self.remote.rewrite(sid, system_prompt, turns, open_user)
        self._prompts[sid] = system_prompt
        if (lsid := self._local.get(sid)) is not None and not self.local.replying(lsid):
            self.local.rewrite(lsid, system_prompt, list(turns)[-self.relay.context_turns :], open_user)
            self._stale.discard(sid)

    def step(self) -> dict[int, list[int]]:
        """The local model's steps first (prefixes, and the user's words for P(end of turn)); each prefix
        decided starts its remote reply; then the remote's pieces."""
        if self.local.busy():
            t0 = time.perf_counter()
            self.local.step()
            self.local_busy_s += time.perf_counter() - t0
        for sid in list(self._prefixing):
            self._relay(sid)
        return self.remote.step(wait=not self.local.busy()) if self.remote.busy() else {}

    def take_relayed(self, sid: int) -> tuple[str, str, str, float] | None:
        """Once per reply, when its prefix is decided: the prefix, the local and remote models, and the
        milliseconds the local model took to decide it (`events.ReplyRelayed`)."""
        if (decided := self._decided.pop(sid, None)) is None:
            return None
        return decided[0], self.local.config.model, self.remote.config.model, decided[1]

    def relay_report(self) -> dict[str, object]:
        """For /healthz: the local model, its time, and how many replies began with its words."""
        return {
            "model": self.local.config.model,
            "busy_s": round(self.local_busy_s, 3),
            **self.relay_stats,
            "continues": self.remote.continues,
        }

    # --- inside --------------------------------------------------------------------------------------------

    def _relay(self, sid: int) -> None:
        """Start `sid`'s remote reply once its local prefix is decided (`accept_prefix`)."""
        lsid = self._local[sid]
        tokens, stats = self.local.reply_tokens(lsid), self.local.reply_stats(lsid)
        prefix, decided = accept_prefix(
            tokens, stats, self.local.tokenizer.decode, self.relay, not self.local.replying(lsid)
        )
        if not decided:
            return
        self.local.interrupt(lsid, len(tokens))  # (stops it; the next turn re-reads the transcript anyway)
        del self._prefixing[sid]
        if sid in self._racing:  # (the remote model's own reply is on its way: ask again only with a prefix)
            self._racing.discard(sid)
            if prefix and not self.remote.restart_reply(sid, prefix):
                prefix = ""
        else:
            self.remote.start_reply(sid, prefix)
        self._decided[sid] = (prefix, 1000 * (time.monotonic() - self._began.pop(sid, time.monotonic())))
        self.relay_stats["replies"] += 1
        if prefix:
            self.relay_stats["with_prefix"] += 1
            self.relay_stats["prefix_words"] += len(prefix.split())

    def _race(self, sid: int) -> None:
        """Ask the remote model for its own reply now, while the local one decides the prefix
        (`[relay] remote_at_once`)."""
        if self.relay.remote_at_once and not self.remote.replying(sid):
            self.remote.start_reply(sid)
            self._racing.add(sid)

    def _reread(self, sid: int) -> bool:
        """Rewrite a stale local session from the remote transcript (once neither side replies); whether it
        was. The transcript then holds the user's open words too."""
        lsid = self._local.get(sid)
        if lsid is None or sid not in self._stale or self.replying(sid) or self.local.replying(lsid):
            return False
        turns = [(m["role"], m["content"]) for m in self.remote.history(sid)[1:]]
        open_user = turns.pop()[1] if turns and turns[-1][0] == "user" else ""
        self.local.rewrite(lsid, self._prompts.get(sid), turns[-self.relay.context_turns :], open_user)
        self._stale.discard(sid)
        return True

    def _forget(self, sid: int) -> None:
        self._prefixing.pop(sid, None)
        self._racing.discard(sid)
        self._began.pop(sid, None)
        self._decided.pop(sid, None)
        self._priority.pop(sid, None)
        self._stale.discard(sid)
        self._prompts.pop(sid, None)
        if (lsid := self._local.pop(sid, None)) is not None:
            self.local.close(lsid)
