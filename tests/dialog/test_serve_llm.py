"""`duplexd serve-llm` as a real child process, spoken to by the official `openai` client (unchanged).

The reference is the in-process `DialogEngine` on the same model: greedy decoding is deterministic and
batch-invariant, so a reply streamed over HTTP is, token for token, the one the engine gives in process,
alone or decoded beside another request.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from duplexd.bench.server import serve_llm_process
from duplexd.dialog.engine import DialogEngine, EngineConfig
from duplexd.errors import EngineError
from duplexd.llm_server import (
    ApiError,
    ChatRequest,
    HttpLimits,
    LlmHttpServer,
    LlmService,
    parse_chat_request,
    parse_head,
)

slow = pytest.mark.slow  # (tests that load the model; the parsers' tests need none)

MAX_TOKENS = 40
KEY = "test-key-1234"
Q1 = "What is the capital of France?"
Q2 = "And what is it famous for?"
Q3 = "Name three colours of the rainbow."


@dataclass(frozen=True, slots=True)
class LlmServer:
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, api_key: str = KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(gguf_file: Path) -> DialogEngine:  # (gguf_file: skipped where SmolLM2 cannot be fetched)
    return DialogEngine.load(EngineConfig(max_sessions=4, max_reply_tokens=MAX_TOKENS))


@pytest.fixture(scope="module")
def server(engine: DialogEngine) -> Iterator[LlmServer]:
    args = ("--max-tokens", str(MAX_TOKENS), "--max-sessions", "4")
    with serve_llm_process(*args, api_key=KEY, env={**os.environ, "OMP_NUM_THREADS": "1"}) as port:
        yield LlmServer(port)


def local_reply(engine: DialogEngine, turns: list[tuple[str, str]]) -> list[int]:
    """The in-process reply after `turns` ((role, text); assistant texts replayed as finished replies)."""
    sid = engine.open()
    try:
        for role, text in turns:
            if role == "user":
                engine.append_user_text(sid, text)
            else:
                engine.append_assistant_text(sid, text)
        engine.start_reply(sid)
        while engine.replying(sid):
            engine.step()
        return engine.reply_tokens(sid)
    finally:
        engine.close(sid)


def increments(engine: DialogEngine, tokens: list[int]) -> list[str]:
    """The text each token adds (what a streaming server sends, one chunk per token)."""
    texts = [engine.tokenizer.decode(tokens[:k], skip_special_tokens=True) for k in range(len(tokens) + 1)]
    return [b[len(a) :] for a, b in zip(texts, texts[1:], strict=False)]


def messages(turns: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in turns]


async def stream(client: openai.AsyncOpenAI, turns: list[tuple[str, str]], **kwargs: object) -> list[str]:
    deltas: list[str] = []
    response = await client.chat.completions.create(
        model="smollm2", messages=messages(turns), stream=True, temperature=0, **kwargs
    )
    async for chunk in response:
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
    return deltas


# --- the engine's replayed assistant turn (what serve-llm builds a request's context from) ---------------


@slow
def test_a_replayed_assistant_turn_is_the_context_its_reply_left(engine: DialogEngine) -> None:
    live = engine.open()
    engine.append_user_text(live, Q1)
    engine.start_reply(live)
    while engine.busy():
        engine.step()
    reply = engine.reply_tokens(live)
    assert reply
    engine.append_user_text(live, Q2)

    replayed = engine.open()
    engine.append_user_text(replayed, Q1)
    engine.append_assistant_text(replayed, engine.tokenizer.decode(reply))
    engine.append_user_text(replayed, Q2)
    while engine.busy():
        engine.step()
    assert engine.context_tokens(replayed) == engine.context_tokens(live)

    # ... and an interrupted one: only the heard tokens, then the end of the turn.
    engine.start_reply(live)
    while engine.replying(live):
        engine.step()
    engine.interrupt(live, 3)
    engine.append_assistant_text(replayed, engine.tokenizer.decode(engine.reply_tokens(live)))
    while engine.busy():
        engine.step()
    assert len(engine.reply_tokens(live)) == 3
    assert engine.context_tokens(replayed) == engine.context_tokens(live)
    engine.start_reply(replayed)
    with pytest.raises(EngineError):  # (a reply is in progress: it comes first)
        engine.append_assistant_text(replayed, "no")
    engine.close(live)
    engine.close(replayed)


# --- serve-llm over HTTP -----------------------------------------------------------------------------------


@slow
async def test_streamed_reply_is_the_in_process_reply_token_for_token(server: LlmServer, engine: DialogEngine) -> None:
    first = [("user", Q1)]
    expected = local_reply(engine, first)
    async with server.client() as client:
        assert await stream(client, first) == increments(engine, expected)
        # multi-turn: the history replays into the engine as the conversation left it
        turns = [*first, ("assistant", engine.tokenizer.decode(expected)), ("user", Q2)]
        assert await stream(client, turns) == increments(engine, local_reply(engine, turns))
        # a system prompt of the request's own, and content as text parts
        system = {"role": "system", "content": "You answer like a pirate."}
        parts = {"role": "user", "content": [{"type": "text", "text": Q3}]}
        got = await client.chat.completions.create(model="smollm2", messages=[system, parts], stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in got if c.choices])
    sid = engine.open("You answer like a pirate.")
    engine.append_user_text(sid, Q3)
    engine.start_reply(sid)
    while engine.replying(sid):
        engine.step()
    assert text == engine.tokenizer.decode(engine.reply_tokens(sid))
    engine.close(sid)


def _word_prefix(engine: DialogEngine, tokens: list[int], words: int) -> str:
    text = engine.tokenizer.decode(tokens)
    return " ".join(text.split(" ")[:words])


@slow
def test_a_reply_continued_from_its_own_first_words_is_the_same_reply(engine: DialogEngine) -> None:
    """Greedy decoding: given the first words of the reply it would give, the engine gives the rest of it."""
    full = local_reply(engine, [("user", Q1)])
    text = engine.tokenizer.decode(full)
    prefix = _word_prefix(engine, full, 2)
    sid = engine.open()
    engine.append_user_text(sid, Q1)
    engine.start_reply(sid, prefix)
    while engine.replying(sid):
        engine.step()
    assert engine.tokenizer.decode(engine.reply_tokens(sid)) == text
    engine.close(sid)


@slow
async def test_a_final_assistant_message_is_continued(server: LlmServer, engine: DialogEngine) -> None:
    """vLLM's `continue_final_message` (and llama.cpp's final assistant message): the reply goes on from the
    given words, and only what follows them comes back; the usage counts only those tokens."""
    full = local_reply(engine, [("user", Q1)])
    text = engine.tokenizer.decode(full)
    prefix = _word_prefix(engine, full, 2)
    turns = [{"role": "user", "content": Q1}, {"role": "assistant", "content": prefix}]
    vllm = {"continue_final_message": True, "add_generation_prompt": False}
    async with server.client() as client:
        streamed = await client.chat.completions.create(model="smollm2", messages=turns, stream=True, extra_body=vllm)
        got = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
        whole = await client.chat.completions.create(model="smollm2", messages=turns)
    assert prefix + got == text and got
    assert whole.choices[0].message.content == got
    assert whole.usage is not None and whole.usage.completion_tokens == len(full) - len(engine.tokenizer.encode(prefix))


@slow
async def test_non_streaming_completion_and_usage(server: LlmServer, engine: DialogEngine) -> None:
    expected = local_reply(engine, [("user", Q3)])
    async with server.client() as client:
        done = await client.chat.completions.create(model="smollm2", messages=messages([("user", Q3)]))
        short = await client.chat.completions.create(
            model="smollm2", messages=messages([("user", Q3)]), max_completion_tokens=5
        )
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="smollm2",
                messages=messages([("user", Q3)]),
                stream=True,
                max_tokens=5,
                stream_options={"include_usage": True},
            )
        ]
        models = await client.models.list()
    assert done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == engine.tokenizer.decode(expected)
    assert done.choices[0].finish_reason == ("length" if len(expected) == MAX_TOKENS else "stop")
    assert done.usage is not None and done.usage.completion_tokens == len(expected)
    assert done.usage.prompt_tokens > 10
    assert short.choices[0].message.content == engine.tokenizer.decode(expected[:5])
    assert short.choices[0].finish_reason == "length"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert [m.id for m in models.data] == ["smollm2"]


@slow
async def test_concurrent_requests_are_decoded_together_and_both_complete(
    server: LlmServer, engine: DialogEngine
) -> None:
    a, b = [("user", Q1)], [("user", Q3)]
    async with server.client() as client:
        got_a, got_b = await asyncio.gather(stream(client, a), stream(client, b))
    assert got_a == increments(engine, local_reply(engine, a))
    assert got_b == increments(engine, local_reply(engine, b))


@slow
@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 0.7}, "temperature"),
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"stop": ["\n"]}, "stop"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages.[0]"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "messages.[1]"),
        ({"messages": []}, "messages"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
async def test_unsupported_requests_get_an_openai_shaped_400(server: LlmServer, kwargs: dict, param: str) -> None:
    request = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], **kwargs}
    async with server.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(**request)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


@slow
async def test_unknown_model_and_wrong_key(server: LlmServer) -> None:
    async with server.client() as client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    async with server.client(api_key="wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()


async def raw(port: int, data: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


@slow
@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /nope HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n", 404),
        (b"DELETE /v1/models HTTP/1.1\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n", 405),
        (b"GET /v1/models HTTP/1.1\r\n\r\n", 401),
        (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", 413),
        (b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 501),
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /v1/models HTTP/1.1\r\nbad header\r\n\r\n", 400),
        (b"GET /v1/models HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer "
            + KEY.encode()
            + b"\r\nContent-Length: 5\r\n\r\n{nope",
            400,
        ),
    ],
)
async def test_malformed_http_gets_an_error_answer(server: LlmServer, request_bytes: bytes, status: int) -> None:
    got, body = await raw(server.port, request_bytes)
    assert got == status
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


@slow
async def test_a_client_that_goes_away_frees_its_session(engine: DialogEngine) -> None:
    """In process (to see the service's state): streams abandoned after their first chunk are cancelled and
    their sessions closed, so the next request is served instead of refused."""
    service = LlmService(engine, "smollm2")
    stop = asyncio.Event()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(LlmHttpServer(service).run("127.0.0.1", 0, stop, ready.set_result))
    try:
        port = await asyncio.wait_for(ready, 10)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        async with client:
            for _ in range(engine.config.max_sessions):
                response = await client.chat.completions.create(
                    model="smollm2", messages=messages([("user", Q1)]), stream=True
                )
                async for _chunk in response:
                    break
                await response.close()
            for _ in range(100):
                if service.stats["cancelled"] == engine.config.max_sessions and engine.sessions == 0:
                    break
                await asyncio.sleep(0.05)
            assert service.stats["cancelled"] == engine.config.max_sessions
            assert engine.sessions == 0
            got = await stream(client, [("user", Q1)])
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        service.close()
    assert got == increments(engine, local_reply(engine, [("user", Q1)]))


# --- the pure parts ---------------------------------------------------------------------------------------


def test_parse_head() -> None:
    limits = HttpLimits(max_body_bytes=100)
    head = parse_head(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nContent-Length:  7 \r\nA-B: c\r\n\r\n", limits)
    assert (head.method, head.path, head.content_length, head.headers["a-b"]) == (
        "POST",
        "/v1/chat/completions",
        7,
        "c",
    )
    for data, status in [
        (b"POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n", 413),
        (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET / HTTP/1.1\r\n folded\r\n\r\n", 400),
        (b"GET /\xff HTTP/1.1\r\n\r\n", 400),
        (b"GET x HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nExpect: magic\r\n\r\n", 417),
    ]:
        with pytest.raises(ApiError) as caught:
            parse_head(data, limits)
        assert caught.value.status == status, data


def test_parse_chat_request() -> None:
    def parse(**req: object) -> ChatRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **req}
        return parse_chat_request(json.dumps(body).encode(), model="m", max_tokens=50)

    assert parse() == ChatRequest("m", None, (("user", "hi"),), stream=False, max_tokens=50)
    req = parse(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "c"},
        ],
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=80,
        max_completion_tokens=7,
        temperature=0,
        top_p=0.5,
        seed=3,
        user="u",
    )
    assert req == ChatRequest("m", "be brief", (("user", "ab"), ("assistant", ""), ("user", "c")), True, 7, True)
    assert parse(max_tokens=500).max_tokens == 50  # (the server's reply limit)
    for bad, param in [
        ({"frobnicate": 1}, "frobnicate"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]}, "messages.[1]"),
        ({"messages": [{"role": "tool", "content": "a"}]}, "messages.[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.[0].content"),
    ]:
        with pytest.raises(ApiError) as caught:
            parse(**bad)
        assert (caught.value.status, caught.value.param) == (400, param), bad
    # A final assistant message is continued (vLLM's continue_final_message, llama.cpp's default).
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    want = ChatRequest("m", None, (("user", "hi"),), False, 50, prefix="Hello, I am")
    assert parse(messages=turns) == want
    assert parse(messages=turns, continue_final_message=True, add_generation_prompt=False) == want
    for bad in (
        {"messages": turns, "continue_final_message": False},
        {"messages": turns, "add_generation_prompt": True},
        {"continue_final_message": True},  # (nothing to continue)
        {"messages": turns, "continue_final_message": "yes"},
    ):
        with pytest.raises(ApiError) as caught:
            parse(**bad)
        assert caught.value.status == 400 and caught.value.param in ("messages", "continue_final_message"), bad
    with pytest.raises(ApiError) as caught:
        parse(model="other")
    assert (caught.value.status, caught.value.code) == (404, "model_not_found")
    with pytest.raises(ApiError) as caught:
        parse_chat_request(b"[1]", model="m", max_tokens=5)
    assert caught.value.status == 400
