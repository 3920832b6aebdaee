"""pipecat's `OpenAIRealtimeLLMService`, unchanged, calling a function through duplexd (issue 25): the tool is
pipecat's (`register_function`), given in its context's `ToolsSchema`; duplexd's remote backend asks the
scripted tool-calling model (`bench/tool_llm.py`, the stand-in for a tool-capable model). pipecat runs the
function on `response.function_call_arguments.done`, sends its `function_call_output` and asks for the answer,
which duplexd gives from the result. No error reaches pipecat."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

pytestmark = pytest.mark.slow

# (see test_pipecat.py: pipecat swaps asyncio.wait_for process-wide on import; it gets its own only in its test)
_ASYNCIO_WAIT_FOR = asyncio.wait_for
pytest.importorskip("pipecat.services.openai.realtime.llm")
_PIPECAT_WAIT_FOR, asyncio.wait_for = asyncio.wait_for, _ASYNCIO_WAIT_FOR

from loguru import logger  # noqa: E402
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema  # noqa: E402
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema  # noqa: E402
from pipecat.frames.frames import ErrorFrame, LLMRunFrame  # noqa: E402
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair  # noqa: E402
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402
from test_pipecat import Frames, Loudspeaker, Microphone  # noqa: E402
from wiretap import RATE_HZ, WireTap  # noqa: E402

from duplexd.bench.tool_llm import ScriptedToolLlm, order_key  # noqa: E402
from duplexd.config import ServerConfig  # noqa: E402
from duplexd.dialog.remote import RemoteConfig, RemoteDialogEngine  # noqa: E402


@pytest.fixture(autouse=True)
def _pipecat_s_wait_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asyncio, "wait_for", _PIPECAT_WAIT_FOR)


QUESTION = "What is the weather in Lisbon?"


async def test_pipecat_runs_a_function_the_model_calls_and_gets_the_answer_from_its_result(engines) -> None:
    from duplexd.transport.server import Server

    calls: list[dict] = []

    async def get_weather(params) -> None:
        calls.append(dict(params.arguments))
        await params.result_callback({"forecast": "Sunny, 24 C."})

    pipecat_errors: list[str] = []
    sink = logger.add(lambda m: pipecat_errors.append(str(m)), level="ERROR")
    with ScriptedToolLlm() as model:
        model.prefer = "get_weather"  # (a model that decides the question needs it)
        config = ServerConfig()
        config = dataclasses.replace(config, transport=dataclasses.replace(config.transport, port=0))
        remote = RemoteDialogEngine(RemoteConfig(url=model.url, model="scripted"))
        server = Server(config, dataclasses.replace(engines, dialog=remote))
        stop = asyncio.Event()
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(server.run(stop, ready=ready))
        try:
            tap = WireTap(await asyncio.wait_for(ready, 30))
            async with tap.running():
                llm = OpenAIRealtimeLLMService(
                    api_key="not-checked",
                    base_url=f"ws://127.0.0.1:{tap.port}/v1/realtime",
                    settings=OpenAIRealtimeLLMService.Settings(system_instruction="Use your tools."),
                )
                llm.register_function("get_weather", get_weather)
                weather = FunctionSchema(
                    name="get_weather",
                    description="The weather in a city.",
                    properties={"city": {"type": "string"}},
                    required=["city"],
                )
                context = LLMContext([{"role": "user", "content": QUESTION}], tools=ToolsSchema([weather]))
                user, assistant = LLMContextAggregatorPair(context)
                mic, speaker, frames = Microphone(), Loudspeaker(), Frames()
                worker = PipelineWorker(
                    Pipeline([mic, user, llm, speaker, assistant]),
                    params=PipelineParams(audio_in_sample_rate=RATE_HZ, audio_out_sample_rate=RATE_HZ),
                    observers=[frames],
                    idle_timeout_secs=None,
                )
                runner = WorkerRunner(handle_sigint=False)
                await runner.add_workers(worker)
                running = asyncio.create_task(runner.run())
                try:
                    await worker.queue_frames([LLMRunFrame()])
                    await tap.wait_for("response.done", 2)  # the call, then the answer from its result
                    await worker.stop_when_done()
                    await asyncio.wait_for(asyncio.shield(running), 30)
                finally:
                    if not running.done():
                        await worker.cancel()
                        await asyncio.wait_for(running, 30)
        finally:
            logger.remove(sink)
            stop.set()
            await asyncio.wait_for(serving, 30)

    assert not tap.errors(), tap.summary()
    assert not frames.of(ErrorFrame) and not pipecat_errors, (frames.of(ErrorFrame), pipecat_errors)
    assert calls == [{"city": order_key(QUESTION)}]
    session = [e["session"] for e in tap.of("session.update", "client") if e["session"].get("tools")]
    assert session and session[-1]["tools"][0]["name"] == "get_weather"
    done = [e["response"] for e in tap.of("response.done")]
    assert [r["status"] for r in done] == ["completed", "completed"]
    assert done[0]["output"][-1]["type"] == "function_call"
    [output] = [
        e["item"] for e in tap.of("conversation.item.create", "client") if e["item"]["type"] == "function_call_output"
    ]
    assert output["call_id"] == done[0]["output"][-1]["call_id"]
    assert json.loads(output["output"]) == {"forecast": "Sunny, 24 C."}
    answer = "".join(
        e["delta"] for e in tap.of("response.output_audio_transcript.delta") if e["response_id"] == done[1]["id"]
    )
    assert answer == 'Here is what I found. {"forecast": "Sunny, 24 C."}'
