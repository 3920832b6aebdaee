"""The remote dialog backend against a real `duplexd serve-llm` child, driven through the real LLM worker.

The same model decodes greedily on both sides, so a conversation through `RemoteDialogEngine` must give
the replies the in-process `DialogEngine` gives, turn for turn, an interrupted reply included (its heard
part is all the next turns see). A server that cannot be reached, or that never answers, ends the reply
with an error and the conversation goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from duplexd.bench.server import free_port, serve_llm_process
from duplexd.commands import AppendUserText, InterruptReply, StartReply
from duplexd.config import DialogConfig, SpeculationConfig
from duplexd.dialog.engine import DialogEngine, EngineConfig
from duplexd.dialog.remote import PieceTokenizer, RemoteConfig, RemoteDialogEngine, RemoteFront, _trim
from duplexd.scheduler.dialog import DialogWorker

slow = pytest.mark.slow  # (tests that load the model)

MAX_TOKENS = 40
SYSTEM = DialogConfig().system_prompt
TURNS = ["What is the capital of France?", " Tell me about its history.", " Name three colours of the rainbow."]
HEARD = 3  # pieces of the second reply the user heard before talking over it


# Both sides in float32: a conversation replayed from its transcript (the server prefills it in chunks) and
# the same conversation lived turn by turn (its replies decoded one token at a time) agree token for token
# in float32; in bfloat16 the two kernels' rounding moves a greedy choice by the third turn (measured).
DTYPE = "float32"


@pytest.fixture(scope="module")
def local(gguf_file: Path) -> DialogEngine:  # (gguf_file: skipped where SmolLM2 cannot be fetched)
    return DialogEngine.load(EngineConfig(max_sessions=2, max_reply_tokens=MAX_TOKENS, dtype=DTYPE))


@pytest.fixture(scope="module")
def llm_url(local: DialogEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("serve-llm") / "duplexd.toml"
    config.write_text(f'[dialog]\ndtype = "{DTYPE}"\n')
    with serve_llm_process("--max-tokens", str(MAX_TOKENS), "--max-sessions", "4", "--config", str(config)) as port:
        yield f"http://127.0.0.1:{port}/v1"


def remote_engine(url: str, **kwargs: object) -> RemoteDialogEngine:
    config = RemoteConfig(url=url, model="smollm2", max_sessions=4, max_reply_tokens=MAX_TOKENS, **kwargs)  # type: ignore[arg-type]
    return RemoteDialogEngine(config)


class Client:
    """A `DialogClient` that keeps each reply's texts and when it was done."""

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}
        self.done: dict[int, asyncio.Event] = {}
        self.p_ends: list[float] = []
        self.relayed: dict[int, str] = {}  # reply -> the local model's prefix (`dialog.mode = "relay"`)

    def event(self, reply: int) -> asyncio.Event:
        return self.done.setdefault(reply, asyncio.Event())

    def on_reply(self, reply: int, texts: list[str], done: bool) -> None:
        self.texts.setdefault(reply, []).extend(texts)
        if done:
            self.event(reply).set()

    def on_p_end(self, p: float, version: int) -> None:
        self.p_ends.append(p)

    def on_draft(self, texts: list[str]) -> None:
        pass

    def on_speculation(self, reply: int, drafts: int, hit: bool, draft_tokens: int) -> None:
        pass

    def on_relay(self, reply: int, text: str, model: str, remote_model: str, decided_ms: float) -> None:
        self.relayed[reply] = text


async def until(condition: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def heard_pieces(texts: list[str]) -> int | None:
    """Where `converse` cuts the second reply: after `HEARD` pieces (None: not yet that many)."""
    return HEARD if len(texts) >= HEARD else None


async def converse(
    engine: DialogEngine | RemoteDialogEngine, cut: Callable[[list[str]], int | None] = heard_pieces
) -> tuple[list[str], Client]:
    """Three turns through the LLM worker; the second reply is interrupted where `cut` says, given its
    texts so far (`texts[i]`: the reply through piece i; if it ends first, after `HEARD` pieces)."""
    worker = DialogWorker(engine, speculation=SpeculationConfig(enabled=False))  # type: ignore[arg-type]
    task = asyncio.create_task(worker.run())
    client = Client()
    replies: list[str] = []
    try:
        sid = await asyncio.wait_for(worker.open(client), 10)
        for n, text in enumerate(TURNS, start=1):
            worker.submit(sid, AppendUserText(text, n))
            worker.submit(sid, StartReply(n))
            if n == 2:
                await until(lambda n=n: cut(client.texts.get(n, [])) is not None or client.event(n).is_set())
                heard = cut(client.texts[n]) or HEARD
                worker.submit(sid, InterruptReply(n, heard))  # (applied before the next turn's words)
                replies.append(client.texts[n][heard - 1])
            else:
                await asyncio.wait_for(client.event(n).wait(), 60)
                replies.append(client.texts[n][-1] if client.texts.get(n) else "")
        worker.close(sid)
        await until(lambda: engine.sessions == 0)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        worker.close_worker()
    return replies, client


@slow
async def test_remote_conversation_equals_the_in_process_one(local: DialogEngine, llm_url: str) -> None:
    expected, _ = await converse(local)
    assert all(expected) and len(expected[1]) < len(expected[0])
    remote = remote_engine(llm_url)
    got, remote_client = await converse(remote)
    assert got == expected
    assert not remote_client.p_ends  # (no P(end of turn) from a chat API)
    assert remote.stats["failed"] == 0 and remote.stats["requests"] == 3
    assert len(remote.tokenizer) == 0  # every piece forgotten with its session


@slow
async def test_the_transcript_keeps_only_the_heard_part(llm_url: str) -> None:
    engine = remote_engine(llm_url)
    sid = engine.open()
    engine.append_user_text(sid, TURNS[0])
    engine.start_reply(sid)
    while engine.replying(sid):
        engine.step()
    first = engine.tokenizer.decode(engine.reply_tokens(sid))
    engine.append_user_text(sid, TURNS[1])
    engine.start_reply(sid)
    while len(engine.reply_tokens(sid)) < HEARD and engine.replying(sid):
        engine.step()
    heard = engine.tokenizer.decode(engine.reply_tokens(sid)[:HEARD])
    engine.interrupt(sid, HEARD)
    assert not engine.replying(sid) and not engine.busy()
    engine.append_user_text(sid, TURNS[2])
    assert engine.history(sid) == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TURNS[0]},
        {"role": "assistant", "content": first},
        {"role": "user", "content": TURNS[1]},
        {"role": "assistant", "content": heard},
        {"role": "user", "content": TURNS[2]},
    ]
    # Cut again after the user's next words (a Realtime client's later truncate): they follow what is left.
    one = engine.tokenizer.decode(engine.reply_tokens(sid)[:1])
    engine.interrupt(sid, 1)
    assert engine.history(sid)[-2:] == [{"role": "assistant", "content": one}, {"role": "user", "content": TURNS[2]}]
    engine.close(sid)


@slow
async def test_a_withdrawn_reply_leaves_the_turn_open_in_the_transcript(llm_url: str) -> None:
    """The user went on after the turn's end (`turn.continue_turn_ms`): the reply, in flight or finished,
    leaves the transcript, and the user's turn is open again; the next request asks the whole question."""
    engine = remote_engine(llm_url)

    def reply(sid: int) -> str:
        engine.start_reply(sid)
        while engine.replying(sid):
            engine.step()
        return engine.tokenizer.decode(engine.reply_tokens(sid))

    control = engine.open()
    engine.append_user_text(control, "What is the capital of France?")
    expected = reply(control)
    for finish in (False, True):
        sid = engine.open()
        engine.append_user_text(sid, "What is the capital")
        engine.start_reply(sid)
        while engine.replying(sid) and (finish or not engine.reply_tokens(sid)):
            engine.step()
        assert engine.withdraw_reply(sid)
        assert not engine.replying(sid) and not engine.busy() and engine.reply_tokens(sid) == []
        engine.append_user_text(sid, " of France?")
        assert engine.history(sid) == [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the capital of France?"},
        ]
        assert reply(sid) == expected
        engine.append_user_text(sid, " Thanks.")  # (the user spoke after the reply: it is theirs now)
        assert not engine.withdraw_reply(sid)
        engine.close(sid)
    engine.close(control)


@slow
async def test_an_adopted_draft_is_the_reply_and_a_dropped_one_is_cancelled(local: DialogEngine, llm_url: str) -> None:
    engine = remote_engine(llm_url)
    sid = engine.open()
    engine.append_user_text(sid, TURNS[0])
    drafts = [engine.fork(sid, decode_limit=4) for _ in range(2)]
    engine.append_user_text(drafts[1], " Or Spain?")
    for d in drafts:
        engine.start_reply(d)
    deadline = time.monotonic() + 60
    while not all(engine.parked(d) for d in drafts):
        assert time.monotonic() < deadline
        engine.step()
    assert engine.state_key(sid) != engine.state_key(drafts[1])
    engine.close(drafts[1])  # the wrong guess: its request is cancelled
    engine.adopt(sid, drafts[0])  # (the worker matched state keys before the fork's words; same here)
    while engine.replying(sid):
        engine.step()
    assert engine.tokenizer.decode(engine.reply_tokens(sid)) == _local_reply(local, TURNS[0])
    engine.close(sid)
    assert engine.sessions == 0 and engine.free_slots == 4


def _local_reply(engine: DialogEngine, text: str) -> str:
    sid = engine.open()
    engine.append_user_text(sid, text)
    engine.start_reply(sid)
    while engine.replying(sid):
        engine.step()
    reply = engine.tokenizer.decode(engine.reply_tokens(sid))
    engine.close(sid)
    return reply


@pytest.mark.parametrize("server", ["refused", "silent"])
async def test_an_unreachable_or_silent_server_ends_the_reply_with_an_error(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listening (connection refused), or a socket that accepts and never answers (the timeout):
    each reply ends, empty, with the error logged; the worker and the conversation go on."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the backlog; nobody ever reads them
        port = silent.getsockname()[1] if server == "silent" else free_port()
        engine = remote_engine(f"http://127.0.0.1:{port}/v1", timeout_s=0.5)
        worker = DialogWorker(engine, speculation=SpeculationConfig(enabled=False))  # type: ignore[arg-type]
        task = asyncio.create_task(worker.run())
        client = Client()
        try:
            with caplog.at_level(logging.ERROR, logger="duplexd.dialog.remote"):
                sid = await worker.open(client)
                for n in (1, 2):
                    worker.submit(sid, AppendUserText(TURNS[0], n))
                    worker.submit(sid, StartReply(n))
                    await asyncio.wait_for(client.event(n).wait(), 10)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            worker.close_worker()
    assert client.texts == {1: [], 2: []}
    assert engine.stats["failed"] == 2
    errors = [r.getMessage() for r in caplog.records if "remote LLM reply failed" in r.getMessage()]
    assert len(errors) == 2, errors
    assert ("ConnectionRefusedError" if server == "refused" else "timed out") in errors[0]


def test_config_and_bounds() -> None:
    with pytest.raises(ValueError, match="dialog.remote_url"):
        DialogConfig(backend="remote", remote_url="gpu-host:8001")
    with pytest.raises(ValueError, match="dialog.backend"):
        DialogConfig(backend="vllm")
    config = DialogConfig(backend="remote", remote_url="http://u:p@gpu:8001/v1/", remote_api_key="secret")
    remote = RemoteConfig.from_config(config)
    assert "secret" not in repr(config) and "secret" not in repr(remote)
    assert remote.endpoint == "http://gpu:8001/v1/chat/completions"  # (what logs show: no credentials)
    assert remote.model == "smollm2"

    history = deque(
        [("user", "a" * 10), ("assistant", "b" * 10), ("user", "c" * 10), ("assistant", "d"), ("user", "e")]
    )
    _trim(history, 15)
    assert list(history) == [("user", "c" * 10), ("assistant", "d"), ("user", "e")]
    _trim(history, 0)
    assert list(history) == [("user", "e")]

    tok = PieceTokenizer()
    ids = [tok.add(t) for t in ("Hel", "lo", " there")]
    assert tok.decode(ids[:2]) == "Hello" and tok.decode(ids) == "Hello there"
    tok.forget(ids)
    assert len(tok) == 0


@slow
async def test_the_voice_server_replies_through_the_remote_backend(engines, llm_url: str) -> None:
    """The whole server (real ASR, TTS, LLM worker) with `backend = "remote"` in place of the local engine:
    a typed Realtime message gets the reply the local engine gives, and /healthz and /metrics still work."""
    openai = pytest.importorskip("openai")
    from duplexd.config import ServerConfig
    from duplexd.transport.server import Server

    config = ServerConfig()
    config = dataclasses.replace(config, transport=dataclasses.replace(config.transport, port=0))
    remote = RemoteDialogEngine(RemoteConfig.from_config(dataclasses.replace(config.dialog, remote_url=llm_url)))
    replies, health = [], {}
    for dialog in (engines.dialog, remote):
        server = Server(config, dataclasses.replace(engines, dialog=dialog))
        stop = asyncio.Event()
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(server.run(stop, ready=ready))
        try:
            port = await asyncio.wait_for(ready, 30)
            client = openai.AsyncOpenAI(api_key="x", websocket_base_url=f"ws://127.0.0.1:{port}/v1")
            async with client.realtime.connect(model="duplexd") as conn:
                await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
                await conn.conversation.item.create(
                    item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": TURNS[0]}]}
                )
                await conn.response.create()
                text = ""
                async with asyncio.timeout(60):
                    async for event in conn:
                        if event.type == "response.output_text.delta":
                            text += event.delta
                        elif event.type == "response.done":
                            assert event.response.status == "completed"
                            break
            replies.append(text)
            for path in ("/healthz", "/metrics"):
                with await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{port}{path}", None, 5) as r:
                    health[path] = r.read().decode()
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
    assert replies[0] and replies[1] == replies[0]
    llm = json.loads(health["/healthz"])["llm"]  # (the engine's stats)
    assert llm["requests"] >= 1 and llm["failed"] == 0
    assert "kv_slots" in health["/metrics"]
    assert remote.stats["requests"] >= 1 and remote.stats["failed"] == 0


async def _sse_server(handler) -> tuple[asyncio.Server, str]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        )
        body = json.loads(await reader.readexactly(length))
        writer.write(handler(head, body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


def _chunked(*events: bytes) -> bytes:
    """A 200 SSE response framed as vLLM's and llama.cpp's servers frame it (chunked transfer encoding)."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


def _delta(text: str | None, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


async def _reply(engine: RemoteDialogEngine, text: str = "Hi", system: str | None = None, prefix: str = "") -> str:
    """One turn's reply, stepped until it ends."""
    sid = engine.open(system)
    engine.append_user_text(sid, text)
    engine.start_reply(sid, prefix)
    while engine.replying(sid):
        await asyncio.to_thread(engine.step)
    text = engine.tokenizer.decode(engine.reply_tokens(sid))
    engine.close(sid)
    return text


async def test_the_stream_format_of_other_servers(caplog: pytest.LogCaptureFixture) -> None:
    """Chunked framing, comments, role-only and usage chunks; the request is greedy, streamed and carries
    the key; HTTP errors and errors inside the stream end the reply with the server's message logged."""
    seen: list[tuple[bytes, dict]] = []

    def ok(head: bytes, body: dict) -> bytes:
        seen.append((head, body))
        usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
        return _chunked(
            b": ping\n\n", _delta(""), _delta("Hel"), _delta("lo!"), _delta(None, "stop"), usage, b"data: [DONE]\n\n"
        )

    server, url = await _sse_server(ok)
    async with server:
        assert await _reply(remote_engine(url, api_key="k3y")) == "Hello!"
    head, body = seen[0]
    assert b"authorization: bearer k3y" in head.lower()
    assert body["stream"] is True and body["temperature"] == 0 and body["max_tokens"] == MAX_TOKENS
    assert body["messages"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]

    def refused(head: bytes, body: dict) -> bytes:
        error = json.dumps({"error": {"message": "model 'smollm2' not found", "type": "invalid_request_error"}})
        return b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error.encode())

    def broken(head: bytes, body: dict) -> bytes:
        return _chunked(_delta("Par"), b'data: {"error": {"message": "CUDA out of memory"}}\n\n')

    for handler, message, text in [(refused, "model 'smollm2' not found", ""), (broken, "CUDA out of memory", "Par")]:
        server, url = await _sse_server(handler)
        caplog.clear()
        async with server:
            engine = remote_engine(url, api_key="k3y")
            with caplog.at_level(logging.ERROR, logger="duplexd.dialog.remote"):
                assert await _reply(engine) == text
        assert engine.stats["failed"] == 1
        (record,) = [r.getMessage() for r in caplog.records]
        assert message in record and "k3y" not in record


@slow
async def test_a_spoken_turn_drafts_an_early_request_and_adopts_it(engines, llm_url: str, clip_by_name) -> None:
    """Speculative listening with a backend that has no P(end of turn): the conversation drafts at the
    user's pause, the draft's request goes out then, and at the end of the turn (after the endpointer's
    long wait) the reply is that stream, equal to a fresh request for the same turn."""
    from duplexd.bench import scenarios as sc
    from duplexd.clients.converse import converse_pcm
    from duplexd.config import ServerConfig
    from duplexd.transport.server import Server

    config = ServerConfig()
    # The draft that can be adopted is the one made on the recognizer's final words, which arrive some
    # time into the pause: on a loaded machine (the whole suite on 2 cores) later than the 0.8 s that
    # speech sounding finished waits, and the turn then ends on words nobody drafted ("in the stars."
    # after drafts of "in the start."). Longer waits keep this about adoption, not about how fast the
    # recognizer runs here.
    config = dataclasses.replace(
        config,
        transport=dataclasses.replace(config.transport, port=0),
        turn=dataclasses.replace(config.turn, min_silence_ms=3000, max_silence_ms=4000),
    )
    remote = RemoteDialogEngine(RemoteConfig.from_config(dataclasses.replace(config.dialog, remote_url=llm_url)))
    server = Server(config, dataclasses.replace(engines, dialog=remote))
    stop = asyncio.Event()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(server.run(stop, ready=ready))
    audio = sc.load(clip_by_name["clip22_deepspeech_new_home.wav"].path)
    try:
        port = await asyncio.wait_for(ready, 30)
        result = await converse_pcm(
            f"ws://127.0.0.1:{port}/v1/stream",
            audio,
            sc.RATE,
            max_s=60,
            until=lambda events: any(r.event["type"] == "reply.done" for r in events),
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    (spec,) = [r.event for r in result.events if r.event["type"] == "reply.speculation"]
    assert spec["drafts"] >= 1 and spec["hit"], spec
    (turn,) = [r.event["text"] for r in result.events if r.event["type"] == "turn.ended"]
    (done,) = [r.event["text"] for r in result.events if r.event["type"] == "reply.done"]
    fresh = RemoteDialogEngine(remote.config)
    assert done == await _reply(fresh, turn, SYSTEM)  # the adopted stream is the reply a fresh request gets
    assert server.dialog is not None and server.dialog.stats.hits == 1


async def test_a_repeating_or_long_remote_reply_ends_there() -> None:
    """The server's sampling is its own, so the guard's text rules apply to the streamed pieces: a reply
    that starts a sentence over ends before the repeat (its request is cancelled), and one that goes on
    past `max_reply_sentences` ends after that sentence, the piece that carries the next one cut."""
    looping = [_delta("I'm glad you're happy"), _delta(" with me."), _delta(" I'm"), _delta(" glad"), _delta(" you're")]
    looping += [_delta(" happy with me.")] * 40  # (never reached)
    long = [_delta("Paris is the capital."), _delta(" It is old."), _delta(" It has"), _delta(" a river.")]
    for events, sentences, expected in [
        (looping, 0, "I'm glad you're happy with me. I'm glad"),
        (looping, 2, "I'm glad you're happy with me. I'm glad"),
        (long, 2, "Paris is the capital. It is old."),
        (long, 1, "Paris is the capital."),
        (long, 0, "Paris is the capital. It is old. It has a river."),
    ]:
        server, url = await _sse_server(lambda head, body, events=events: _chunked(*events, b"data: [DONE]\n\n"))
        async with server:
            assert await _reply(remote_engine(url, max_reply_sentences=sentences)) == expected
    assert RemoteConfig(url="http://h/v1", model="m").max_reply_sentences == DialogConfig().max_reply_sentences


def test_a_rewritten_transcript_is_what_the_next_request_sends() -> None:
    engine = remote_engine("http://127.0.0.1:9")  # (no request is made)
    sid = engine.open()
    engine.append_user_text(sid, "Hello there")
    engine.rewrite(
        sid,
        "Be brief.",
        [("user", "One"), ("user", "two"), ("assistant", "Yes."), ("assistant", "Sure.")],
        open_user=" and three ",
    )
    assert engine.history(sid) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "One two"},  # (turns of one role in a row: one message)
        {"role": "assistant", "content": "Yes. Sure."},
        {"role": "user", "content": "and three"},
    ]
    engine.rewrite(sid, None, [("assistant", "Welcome.")])  # (a transcript starts with the user)
    assert engine.history(sid) == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "Welcome."},
    ]
    engine.rewrite(sid, None, [("user", "Hi."), ("assistant", "Hello."), ("user", "Bye.")])
    engine.append_user_text(sid, " Now.")  # (the last user turn is open: the words join it, as locally)
    assert engine.history(sid)[-1] == {"role": "user", "content": "Bye. Now."}
    with pytest.raises(ValueError):
        engine.rewrite(sid, None, [("function", "x")])
    with pytest.raises(ValueError):  # (a tool exchange's turns are JSON: `tools.calls`)
        engine.rewrite(sid, None, [("tool", "x")])
    engine.close(sid)


def test_retracted_user_words_leave_the_transcript() -> None:
    """The recognizer's final decided an utterance's words again: its appends are taken back from the open
    user turn, exactly as given, and the corrected words follow the words before them."""
    engine = remote_engine("http://127.0.0.1:9")  # (no request is made)
    sid = engine.open()
    engine.append_user_text(sid, "Hello there")
    engine.append_user_text(sid, " men the")
    engine.append_user_text(sid, " coat")
    assert not engine.retract_user_text(sid, [" men the"])  # (not the last appends)
    assert engine.retract_user_text(sid, [" men the", " coat"])
    engine.append_user_text(sid, " mend the coat")
    assert engine.history(sid)[-1] == {"role": "user", "content": "Hello there mend the coat"}
    engine.close(sid)


def assert_taken_back_as_if_said_right(engine: RemoteFront, misheard: list[str], taken: list[str]) -> None:
    """An engine in front of a remote one, its conversation given "What is the" + `misheard`, of which the
    appends `taken` are taken back and " capital of France?" appended: its transcript and the local model's
    P(end of turn) are those of the turn said right the first time."""
    control, sid = engine.open(), engine.open()
    for text in ("What is the", " capital of France?"):
        engine.append_user_text(control, text)
    for text in ("What is the", *misheard):
        engine.append_user_text(sid, text)
    while engine.busy():
        engine.step()
    assert not engine.retract_user_text(sid, [" France"])  # (not its last words: nothing changes)
    assert engine.retract_user_text(sid, taken)
    engine.append_user_text(sid, " capital of France?")
    assert_heard_alike(engine, sid, control)


def assert_heard_alike(engine: RemoteFront, sid: int, control: int) -> None:
    """Once the engine is idle, conversation `sid`'s transcript and the local model's P(end of turn) for it are
    those of `control`; both are closed then."""
    while engine.busy():
        engine.step()
    p = engine.p_end_of_turn(control)
    assert p is not None and engine.p_end_of_turn(sid) == pytest.approx(p, abs=1e-6)
    assert engine.history(sid) == engine.history(control)
    engine.close(control)
    engine.close(sid)


@slow
def test_words_taken_back_are_taken_back_from_the_turn_scorer_too(local: DialogEngine) -> None:
    """`TurnScoredEngine`: the local model scoring the turn hears the corrected words, as the remote
    transcript does."""
    from duplexd.dialog.turn_scorer import TurnScoredEngine

    scored = TurnScoredEngine(remote_engine("http://127.0.0.1:9"), local)  # (no request is made)
    assert_taken_back_as_if_said_right(scored, [" capital of Spain"], [" capital of Spain"])
    assert local.sessions == 0


@slow
def test_a_withdrawn_reply_reopens_the_turn_the_scorer_reads_too(local: DialogEngine) -> None:
    """`TurnScoredEngine`: the turn open again, the local model scores it whole as it goes on."""
    from duplexd.dialog.turn_scorer import TurnScoredEngine

    scored = TurnScoredEngine(remote_engine("http://127.0.0.1:9"), local)  # (its request fails: withdrawn)
    control, sid = scored.open(), scored.open()
    scored.append_user_text(control, "What is the capital of France?")
    scored.append_user_text(sid, "What is the capital")
    scored.start_reply(sid)
    assert scored.withdraw_reply(sid)
    scored.append_user_text(sid, " of France?")
    assert_heard_alike(scored, sid, control)
    assert local.sessions == 0


async def scored_turns(engine: object) -> tuple[list[str], list[float]]:
    """Each of `TURNS` appended, its P(end of turn) awaited, then answered: the replies and the P's."""
    worker = DialogWorker(engine, speculation=SpeculationConfig(enabled=False))  # type: ignore[arg-type]
    task = asyncio.create_task(worker.run())
    client = Client()
    try:
        sid = await asyncio.wait_for(worker.open(client), 10)
        for n, text in enumerate(TURNS, start=1):
            worker.submit(sid, AppendUserText(text, n))
            await until(lambda n=n: len(client.p_ends) >= n)
            worker.submit(sid, StartReply(n))
            await asyncio.wait_for(client.event(n).wait(), 60)
        worker.close(sid)
        await until(lambda: engine.sessions == 0)  # type: ignore[attr-defined]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        worker.close_worker()
    return ["".join(client.texts.get(n, [])[-1:]) for n in range(1, len(TURNS) + 1)], client.p_ends


@slow
async def test_the_local_model_scores_the_turns_of_a_remote_conversation(local: DialogEngine, llm_url: str) -> None:
    """`TurnScoredEngine`: the replies are still the remote server's, and every turn gets a P(end of turn)
    from the local model; the first, whose context is the same on both sides, is the local engine's own."""
    from duplexd.dialog.turn_scorer import TurnScoredEngine

    expected, local_p = await scored_turns(local)
    scored = TurnScoredEngine(remote_engine(llm_url), local)  # (the same engine scores: its slots are free)
    got, p_ends = await scored_turns(scored)
    assert got == expected and all(got)
    assert len(p_ends) == len(TURNS) and all(0 < p < 1 for p in p_ends)
    assert p_ends[0] == pytest.approx(local_p[0], rel=1e-3)
    assert scored.stats["requests"] == 3 and scored.stats["failed"] == 0
    report = scored.scorer_report()
    assert report["steps"] > 0 and report["kv_bytes"] > 0 and report["sessions"] == 0  # (closed with its conversation)
    assert local.sessions == 0
    assert scored.reports_p_end and not remote_engine(llm_url).reports_p_end  # (the conversation waits for it)


@slow
async def test_a_reply_given_its_first_words_is_continued_by_serve_llm(llm_url: str) -> None:
    """The reply's first words are given (the relay's committed prefix); the server continues them, and the
    reply (what the transcript keeps, what the conversation hears) is those words and the continuation,
    one piece per given word, then the server's pieces."""
    whole = await _reply(remote_engine(llm_url), TURNS[0])
    prefix = " ".join(whole.split(" ")[:2])
    engine = remote_engine(llm_url)
    sid = engine.open()
    engine.append_user_text(sid, TURNS[0])
    engine.start_reply(sid, prefix)
    assert [engine.tokenizer.decode([t]) for t in engine.reply_tokens(sid)] == [
        prefix.split(" ")[0],
        *(" " + w for w in prefix.split(" ")[1:]),
    ]
    while engine.replying(sid):
        await asyncio.to_thread(engine.step)
    assert engine.tokenizer.decode(engine.reply_tokens(sid)) == whole and engine.continues is True
    assert engine.history(sid)[-1] == {"role": "assistant", "content": whole}


async def test_a_server_that_refuses_to_continue_is_asked_again_without_the_words() -> None:
    """OpenAI's own API refuses `continue_final_message` (an unrecognized argument): the reply is then the
    server's own from the start (the given words are dropped), and no later request asks again."""
    seen: list[dict] = []

    def strict(head: bytes, body: dict) -> bytes:
        seen.append(body)
        if "continue_final_message" in body:
            error = json.dumps({"error": {"message": "Unrecognized request argument supplied: continue_final_message"}})
            return b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error.encode())
        return _chunked(_delta("Paris is"), _delta(" lovely."), _delta(None, "stop"), b"data: [DONE]\n\n")

    server, url = await _sse_server(strict)
    async with server:
        engine = remote_engine(url)
        assert await _reply(engine, prefix="Paris, I") == "Paris is lovely."
        assert engine.continues is False and engine.stats["failed"] == 0
        assert await _reply(engine, prefix="Paris, I") == "Paris is lovely."
    assert seen[0]["messages"][-1] == {"role": "assistant", "content": "Paris, I"}
    assert seen[0]["continue_final_message"] is True and seen[0]["add_generation_prompt"] is False
    assert [("continue_final_message" in b) for b in seen] == [True, False, False]
    assert seen[1]["messages"][-1]["role"] == "user"


@slow
async def test_a_server_whose_model_has_no_tool_format_gets_the_request_again_without_tools(
    llm_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SmolLM2-135M's chat template has no tool format, and `duplexd serve-llm` refuses `tools` (HTTP 400, as
    vLLM does without a tool parser): the reply is asked again without them, and no later request sends
    them; the reply is the one the model gives without tools."""
    from duplexd.tools.calls import ToolSpec

    plain = await _reply(remote_engine(llm_url), TURNS[0])
    engine = remote_engine(llm_url)
    sid = engine.open()
    engine.set_tools(sid, [ToolSpec("get_weather", "The weather in a city.")])
    engine.append_user_text(sid, TURNS[0])
    engine.start_reply(sid)
    while engine.replying(sid):
        await asyncio.to_thread(engine.step)
    assert engine.tokenizer.decode(engine.reply_tokens(sid)) == plain
    assert engine.tools_refused and engine.stats["failed"] == 0 and engine.take_tool_events(sid) == []
    assert "does not take tools" in caplog.text
