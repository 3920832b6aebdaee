"""Speculative listening is lossless: through the real LLM worker and SmolLM2, the reply a conversation
gets with drafts is token for token the reply it gets without them, whatever the drafts assumed.

Each script is what the conversation core sends the worker: the user's words in the pieces they commit
in, drafts at pauses, the end of the turn. It runs twice on the same engine, speculation on and off.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from duplexd.commands import AppendUserText, DraftReply, InterruptReply, RetractUserText, StartReply
from duplexd.config import SpeculationConfig
from duplexd.dialog.engine import DialogEngine, EngineConfig
from duplexd.scheduler.dialog import DialogWorker

pytestmark = pytest.mark.slow

REPLY_TOKENS = 8  # (a drafted part, then decoding on from the adopted state)


@pytest.fixture(scope="module")
def engine(gguf_file: Path) -> DialogEngine:  # (gguf_file: skipped where SmolLM2 cannot be fetched)
    return DialogEngine.load(EngineConfig(max_sessions=6, max_reply_tokens=REPLY_TOKENS))


@dataclass
class Client:
    done: asyncio.Event = field(default_factory=asyncio.Event)
    speculation: list[tuple[int, bool, int]] = field(default_factory=list)

    def on_reply(self, reply: int, texts: list[str], done: bool) -> None:
        if done:
            self.done.set()

    def on_p_end(self, p: float, version: int) -> None:
        pass

    def on_draft(self, texts: list[str]) -> None:
        pass

    def on_speculation(self, reply: int, drafts: int, hit: bool, draft_tokens: int) -> None:
        self.speculation.append((drafts, hit, draft_tokens))


# ("say", text) appends the user's next words; ("draft", text) drafts; ("retract", "a|b") takes back the
# last appends "a", "b"; ("idle", "") waits
Step = tuple[str, str]


async def settle(worker: DialogWorker, *, drafts: bool = True) -> None:
    """Until the worker has applied every command and has nothing left to step (drafts parked; with
    `drafts=False`, drafts may still have work).

    The engine belongs to the worker's thread; read from here, a step in flight can look idle for an
    instant (a token popped from the queue, its successor not yet queued), so idle must be seen twice,
    20 ms apart, with no step in between."""
    engine, seen = worker.engine, None
    for _ in range(3000):
        if not worker.pending and not engine.busy(drafts=drafts):
            if seen == engine.stats["steps"]:
                return
            seen = engine.stats["steps"]
            await asyncio.sleep(0.02)
            continue
        seen = None
        await asyncio.sleep(0.005)
    raise AssertionError("the worker never settled")


@contextlib.asynccontextmanager
async def running(worker: DialogWorker) -> AsyncIterator[DialogWorker]:
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        task.cancel()
        worker.close_worker()


async def asked(worker: DialogWorker, client: Client, question: str = "What is the capital of France?") -> int:
    """A conversation whose question the LLM has taken in (the conversation core drafts only then)."""
    sid = await worker.open(client)
    worker.submit(sid, AppendUserText(question, 1))
    await settle(worker, drafts=False)
    return sid


async def converse(engine: DialogEngine, script: list[Step], speculate: bool) -> tuple[list[int], Client]:
    worker = DialogWorker(engine, speculation=SpeculationConfig(enabled=speculate, draft_tokens=4))
    async with running(worker):
        client = Client()
        sid = await worker.open(client)
        version = 0
        for kind, text in script:
            if kind == "say":
                version += 1
                worker.submit(sid, AppendUserText(text, version))
            elif kind == "draft":
                worker.submit(sid, DraftReply(text, version))
            elif kind == "retract":  # (pieces separated by "|")
                version += 1
                worker.submit(sid, RetractUserText(tuple(text.split("|")), version))
            else:
                await settle(worker)
        worker.submit(sid, StartReply(1))
        await asyncio.wait_for(client.done.wait(), 120)
        reply = engine.reply_tokens(sid)
        worker.close(sid)
        await settle(worker)
        assert engine.sessions == 0  # the conversation and every draft freed their KV slots
        return reply, client


def pieces(text: str, n: int) -> list[str]:
    """The words of `text` in `n` commits, as the conversation core appends them (leading spaces)."""
    words = text.split()
    cuts = [round(i * len(words) / n) for i in range(n + 1)]
    out = [" ".join(words[a:b]) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
    return [out[0], *(" " + p for p in out[1:])]


def scripts(text: str) -> dict[str, list[Step]]:
    """Pause patterns over one utterance's words."""
    p = pieces(text, 3)
    head = [("say", x) for x in p[:-1]]
    last = p[-1]
    return {
        # The user pauses before their last words; two drafts for two different endings, the second right.
        "second": [*head, ("draft", last + " Really?"), ("draft", last), ("idle", ""), ("say", last)],
        # A pause inside the utterance: a draft for the words so far, then the user resumes.
        "resumed": [*head, ("idle", ""), ("draft", ""), ("idle", ""), ("say", last)],
    }


async def test_every_clip_and_pause_pattern_gets_the_same_reply_with_and_without_drafts(engine, clips) -> None:
    texts = [c.text for c in clips if c.text]
    assert len(texts) >= 10
    hits = 0
    for text in texts:
        variants = scripts(text)
        # Every variant gives the LLM the same words in the same pieces: one reply without drafts for all.
        plain, _ = await converse(engine, variants["second"], speculate=False)
        for name, script in variants.items():
            drafted, client = await converse(engine, script, speculate=True)
            assert drafted == plain, f"{name}: {text!r}"
            ((drafts, hit, brought),) = client.speculation
            assert drafts >= 1
            if name == "second":
                assert hit and brought >= 1, f"{name}: the matching draft was not used ({text!r})"
            if name == "resumed":
                assert not hit  # the draft assumed the turn ended before the last words
            hits += hit
    assert hits == len(texts)


async def test_a_draft_for_other_words_is_never_emitted(engine) -> None:
    script: list[Step] = [("say", "What is the capital of"), ("draft", " Spain?"), ("idle", ""), ("say", " France?")]
    plain, _ = await converse(engine, script, speculate=False)
    drafted, client = await converse(engine, script, speculate=True)
    assert drafted == plain and client.speculation == [(1, False, 0)]
    spain, _ = await converse(engine, [("say", "What is the capital of"), ("say", " Spain?")], speculate=False)
    assert spain != plain  # (the draft's words did lead elsewhere)


async def test_words_taken_back_leave_the_reply_of_the_final_words_and_drafts_made_on_them_unused(engine) -> None:
    """The recognizer's final decided the last words again (`RetractUserText`): a draft made on the words
    taken back is never used, one made on the corrected words is, and the reply is, token for token, the
    one given only the final words."""
    final = [("say", "What is the capital of"), ("say", " France?")]
    plain, _ = await converse(engine, final, speculate=False)
    misheard = [("say", "What is the capital of"), ("say", " Spain"), ("say", " or"), ("draft", "?"), ("idle", "")]
    corrected = [*misheard, ("retract", " Spain| or"), ("say", " France?")]
    drafted, client = await converse(engine, corrected, speculate=True)
    assert drafted == plain and client.speculation == [(1, False, 0)]
    drafted, client = await converse(engine, [*corrected, ("idle", ""), ("draft", ""), ("idle", "")], speculate=True)
    assert drafted == plain, client.speculation
    assert client.speculation[0][1], client.speculation  # (the draft on the corrected words was used)


async def test_drafts_wait_while_other_work_runs(engine) -> None:
    """`yield_to` (a recognizer pass or a reply's synthesis running): drafts get no step until it ends."""
    busy = True
    worker = DialogWorker(engine, speculation=SpeculationConfig(draft_tokens=6), yield_to=lambda: busy)
    async with running(worker):
        client = Client()
        sid = await asked(worker, client)
        worker.submit(sid, DraftReply("", 1))
        steps, draft_steps = engine.stats["steps"], engine.stats["draft_steps"]
        await asyncio.sleep(0.3)
        assert engine.stats["steps"] == steps  # the draft waits
        busy = False
        await settle(worker)
        assert engine.stats["draft_steps"] > draft_steps and engine.stats["steps"] > steps
        worker.submit(sid, StartReply(1))
        await asyncio.wait_for(client.done.wait(), 60)
        assert client.speculation == [(1, True, 6)]
        worker.close(sid)
        await settle(worker)


async def test_a_hit_goes_out_without_waiting_for_the_step_in_flight(engine) -> None:
    """At the end of the turn a hit's drafted tokens reach the client at once, while another session's
    prefill step is still running, and the reply is still token for token the one made without drafts."""
    question = "What is the capital of France?"
    plain, _ = await converse(engine, [("say", question)], speculate=False)
    worker = DialogWorker(engine, speculation=SpeculationConfig(draft_tokens=6))
    async with running(worker):
        client, other = Client(), Client()
        seen: list[tuple[int, int]] = []  # (engine steps, texts) at each report
        client.on_reply = lambda reply, texts, done: (  # type: ignore[method-assign]
            seen.append((engine.stats["steps"], len(texts))),
            done and client.done.set(),
        )
        sid, busy_sid = await asked(worker, client, question), await worker.open(other)
        worker.submit(sid, DraftReply("", 1))
        await settle(worker)  # the draft is parked with its 6 tokens
        # Another conversation's long turn: prefill steps one after another (64 tokens each).
        worker.submit(busy_sid, AppendUserText(" ".join(["Tell me about the history of Paris."] * 40), 1))
        await asyncio.sleep(0.05)
        assert engine.busy(drafts=False)  # (so a step is in flight whenever this coroutine runs)
        steps = engine.stats["steps"]
        worker.submit(sid, StartReply(1))
        await asyncio.sleep(0)  # the reply's first tokens are handed over in the next loop iteration
        assert seen == [(steps, 6)]  # all six drafted tokens, and no step ended in between
        await asyncio.wait_for(client.done.wait(), 120)
        assert engine.reply_tokens(sid) == plain
        assert sum(n for _, n in seen) == len(plain)  # each token reported once
        assert worker.stats.early == 1 and worker.stats.hits == 1
        worker.close(sid)
        worker.close(busy_sid)
        await settle(worker)


async def test_a_head_start_runs_a_draft_beside_a_recognizer_pass_up_to_its_first_tokens(engine) -> None:
    """`head_start_tokens`: while only a recognizer pass runs, drafts step until they have that many reply
    tokens, then wait like any draft; beside a reply's synthesis they get no step at all."""
    asr_busy, tts_busy = True, True
    worker = DialogWorker(
        engine,
        speculation=SpeculationConfig(draft_tokens=6, head_start_tokens=2),
        yield_to=lambda: asr_busy or tts_busy,
        head_start=lambda: not tts_busy,
    )
    async with running(worker):
        sid = await asked(worker, Client())
        worker.submit(sid, DraftReply(" Really?", 1))
        steps = engine.stats["steps"]
        await asyncio.sleep(0.3)
        assert engine.stats["steps"] == steps  # a reply is being synthesized: no head start
        tts_busy = False
        for _ in range(600):  # words, then the header and the first token, then the second token
            await asyncio.sleep(0.01)
            (draft,) = worker._pool.drafts(sid)
            if len(engine.reply_tokens(draft.sid)) >= 2:
                break
        await asyncio.sleep(0.3)
        assert len(engine.reply_tokens(draft.sid)) == 2  # and no further while the pass runs
        asr_busy = False
        await settle(worker)
        assert len(engine.reply_tokens(draft.sid)) == 6
        worker.close(sid)
        await settle(worker)


class _ThreadRecorder:
    """The engine, recording every method the worker calls on the event loop's thread (not the test's own
    reads: `settle` polls the engine from the loop)."""

    def __init__(self, engine: DialogEngine) -> None:
        self._engine = engine
        self.on_loop: list[str] = []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._engine, name)
        if not callable(attr):
            return attr

        def call(*args: object, **kwargs: object) -> object:
            caller = sys._getframe(1).f_globals.get("__name__")
            if threading.current_thread() is threading.main_thread() and caller == DialogWorker.__module__:
                self.on_loop.append(name)
            return attr(*args, **kwargs)

        return call


async def test_no_engine_call_runs_on_the_event_loop(engine) -> None:
    """Opening, appending words, drafting (a fork: a KV copy), adopting, reading replies, interrupting and
    closing all run on the worker's thread: the event loop only queues commands and takes callbacks."""
    recorder = _ThreadRecorder(engine)
    worker = DialogWorker(recorder, speculation=SpeculationConfig(draft_tokens=6))  # type: ignore[arg-type]
    async with running(worker):
        assert threading.current_thread() is threading.main_thread()  # (the loop's thread)
        client = Client()
        sid = await asked(worker, client)
        worker.submit(sid, DraftReply(" Please.", 1))
        worker.submit(sid, DraftReply("", 1))
        await settle(worker)
        worker.submit(sid, StartReply(1))  # (a hit: its tokens go out at once)
        await asyncio.wait_for(client.done.wait(), 120)
        worker.submit(sid, InterruptReply(1, 2))
        worker.submit(sid, AppendUserText("And of Spain?", 2))
        await settle(worker, drafts=False)
        worker.close(sid)
        await settle(worker)
        assert worker.stats.hits == 1
    assert recorder.on_loop == []
    assert engine.sessions == 0


async def test_steps_are_timed_apart_by_what_else_runs_on_the_cores(engine) -> None:
    """`step_times`: steps taken while another model works (`contended`) are counted apart from those
    alone, so the voice benchmark can show what contention costs the LLM."""
    busy = False
    worker = DialogWorker(engine, speculation=SpeculationConfig(enabled=False), contended=lambda: busy)
    async with running(worker):
        client = Client()
        sid = await asked(worker, client)
        worker.submit(sid, StartReply(1))
        await asyncio.wait_for(client.done.wait(), 120)
        alone = worker.step_times()
        assert alone["alone_n"] >= REPLY_TOKENS and alone["beside_other_model_n"] == 0
        assert alone["alone_p50_ms"] > 0 and alone["ratio"] is None
        busy, client.done = True, asyncio.Event()
        worker.submit(sid, AppendUserText("And of Spain?", 2))
        worker.submit(sid, StartReply(2))
        await asyncio.wait_for(client.done.wait(), 120)
        both = worker.step_times()
        assert both["alone_n"] == alone["alone_n"] and both["beside_other_model_n"] >= REPLY_TOKENS
        assert both["ratio"] is not None and both["ratio"] > 0
        worker.close(sid)
        await settle(worker)


async def test_steps_wait_their_turn_on_the_cores(engine) -> None:
    """`cores` (shared with the recognizer's passes): no engine step runs while another worker holds it."""
    cores = threading.Lock()
    worker = DialogWorker(engine, speculation=SpeculationConfig(enabled=False), cores=cores)
    async with running(worker):
        client = Client()
        sid = await asked(worker, client)
        await asyncio.to_thread(cores.acquire)  # (a recognizer pass is running)
        steps = engine.stats["steps"]
        worker.submit(sid, StartReply(1))
        await asyncio.sleep(0.3)
        assert engine.stats["steps"] == steps and not client.done.is_set()
        cores.release()
        await asyncio.wait_for(client.done.wait(), 120)
        assert engine.stats["steps"] > steps
        worker.close(sid)
        await settle(worker)
