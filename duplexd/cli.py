"""`duplexd serve | stream | bench | models` — the one entry point."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from duplexd import __version__, logs
from duplexd.config import ServerConfig, load_config
from duplexd.errors import CliError, EngineError, UsageError

log = logging.getLogger("duplexd")


def load_engines(config: ServerConfig):
    """Every model the server runs: VAD and ASR always; the dialog LLM and TTS unless dialog is off."""
    from duplexd.asr.engine import FasterWhisperEngine
    from duplexd.asr.vad import SileroVad
    from duplexd.transport.server import Engines

    t0 = time.perf_counter()
    vad = SileroVad(config.vad.model_path or None)
    asr = FasterWhisperEngine(config.asr)
    dialog = tts = turn_audio = tools = None
    if config.dialog.enabled:
        from duplexd.asr.turn_audio import load_turn_audio
        from duplexd.tts.engine import load_tts

        turn_audio = load_turn_audio(config.turn.audio_model)
        if config.dialog.mode == "relay":  # the local model speaks first, the remote one continues
            from duplexd.dialog.relay import RelayDialogEngine

            dialog = RelayDialogEngine.from_config(config.dialog, config.relay)
        elif config.dialog.backend == "remote" and config.dialog.turn_model:
            from duplexd.dialog.turn_scorer import TurnScoredEngine  # (the local model scores the turns)

            dialog = TurnScoredEngine.from_config(config.dialog)
        elif config.dialog.backend == "remote":  # replies stream from an OpenAI-compatible server elsewhere
            from duplexd.dialog.remote import RemoteDialogEngine

            dialog = RemoteDialogEngine.from_config(config.dialog)
        else:
            from duplexd.dialog.engine import DialogEngine, EngineConfig

            dialog = DialogEngine.load(EngineConfig.from_config(config.dialog))
        tts = load_tts(config.tts)
        tools = _load_tools(config, dialog)
    log.info(
        "models loaded in %.1fs: VAD silero-vad (onnx), ASR %s (%s, beam %d), LLM %s, TTS %s, turn audio %s",
        time.perf_counter() - t0,
        asr.name,
        config.asr.compute_type,
        config.asr.beam_size,
        (config.dialog.model if config.dialog.backend == "local" else dialog.config.model) if dialog else "off",
        tts.name if tts else "off",
        turn_audio.name if turn_audio else "off",
    )
    engines = Engines(vad, asr, dialog, tts, turn_audio, tools)
    warm_up(engines)
    return engines


def _load_tools(config: ServerConfig, dialog):
    """`[tools] mcp_servers` (and `session_mcp`): start them (or connect), list their tools, give them to the
    dialog engine. Returns the hub (closed with the server), or None. Raises `McpUnavailable`."""
    if not config.tools.servers() and not config.tools.session_mcp:
        return None
    if not hasattr(dialog, "attach_tools"):
        log.warning('[tools] mcp_servers: tools need [dialog] backend = "remote" (the embedded model has none)')
        return None
    from duplexd.tools.mcp import McpHub
    from duplexd.tools.runner import ToolRunner

    hub = McpHub(config.tools)
    hub.start()
    dialog.attach_tools(ToolRunner(hub, config.tools))
    return hub


def warm_up(engines) -> None:
    """One small run through every model, so the first user does not pay for lazy initialization (the
    first ASR pass, LLM step and synthesis each took seconds longer than later ones)."""
    import numpy as np

    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    engines.asr.transcribe((0.01 * rng.standard_normal(16_000)).astype(np.float32), "")
    if engines.dialog is not None:
        sid = engines.dialog.open()
        engines.dialog.append_user_text(sid, "Hello.")
        engines.dialog.start_reply(sid)
        for _ in range(4):
            engines.dialog.step()
        engines.dialog.close(sid)
    if engines.tts is not None:
        engines.tts.synthesize("Hello.")
    if engines.turn_audio is not None:
        engines.turn_audio.probability(np.zeros(16_000, np.float32))
    log.info("engines warmed up in %.1fs", time.perf_counter() - t0)


async def serve(config: ServerConfig) -> None:
    """Open the port, load the models while it answers "loading", then serve until SIGINT/SIGTERM."""
    from duplexd.transport.listener import Listener

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    t = config.transport
    listener = await Listener.open(t, config.security)  # a busy port is an OSError now, not after loading
    shown = "localhost" if t.host in ("0.0.0.0", "127.0.0.1", "::") else t.host
    log.info("duplexd %s listening on http://%s:%d/, loading models", __version__, shown, listener.port)
    try:
        engines = await _until_stopped(stop, load_engines, config)
    except BaseException:
        await listener.close()
        raise
    if engines is None:  # stopped while loading (the loading thread is a daemon: it dies with the process)
        await listener.close()
        log.info("stopped")
        return
    from duplexd.transport.server import STREAM_PATH, Server

    server = Server(config, engines)
    ready: asyncio.Future[int] = loop.create_future()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(server.run(stop, ready=ready, listener=listener))
        port = await ready
        log.info("ready: http://%s:%d/ (WebSocket ws://%s:%d%s)", shown, port, shown, port, STREAM_PATH)
        print(f"duplexd ready: open http://{shown}:{port}/", flush=True)
    log.info("stopped")


async def _until_stopped(stop: asyncio.Event, fn, *args):
    """`fn(*args)` on a daemon thread; its result, or None if `stop` is set first (a Ctrl-C while the models
    load must not wait for them)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(exc: BaseException | None, result: object) -> None:
        if not done.done():
            done.set_result(result) if exc is None else done.set_exception(exc)

    def work() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as error:  # (handed to the loop, raised there)
            result, exc = None, error
        with contextlib.suppress(RuntimeError):  # the loop is gone: stopped while loading
            loop.call_soon_threadsafe(settle, exc, result)

    threading.Thread(target=work, name="duplexd-load", daemon=True).start()
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([done, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if done.done():
        return done.result()
    done.cancel()
    return None


def _cmd_serve(args: argparse.Namespace) -> int:
    from duplexd.asr.engine import resolve_asr_model
    from duplexd.asr.turn_audio import resolve_turn_audio

    try:
        overrides = {"transport": {"host": args.host, "port": args.port}, "dialog": {"enabled": args.dialog}}
        config = load_config(args.config, overrides=overrides)
        resolve_asr_model(config.asr.model)  # a wrong path is a config error, before any model loads
        if config.dialog.enabled:
            resolve_turn_audio(config.turn.audio_model)
    except (OSError, ValueError) as exc:
        log.error("bad configuration: %s", exc)
        return 2
    from duplexd.tools.mcp import McpUnavailable

    try:
        asyncio.run(serve(config))
    except OSError as exc:  # binding the port, before any model loads
        t = config.transport
        log.error("cannot listen on %s:%d: %s", t.host, t.port, exc)
        return 1
    except McpUnavailable as exc:
        log.error("%s", exc)
        return 1
    global _exit_at_once
    _exit_at_once = True
    return 0


def _cmd_serve_llm(args: argparse.Namespace) -> int:
    from duplexd.dialog.engine import DialogEngine, EngineConfig
    from duplexd.errors import EngineError
    from duplexd.llm_server import serve_llm

    overrides = {"dialog": {"model": args.model, "max_sessions": args.max_sessions}}
    try:
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be a TCP port, got {args.port}")
        config = load_config(args.config, overrides=overrides)
        engine_config = EngineConfig.from_config(config.dialog)
        if args.max_tokens is not None:
            engine_config = dataclasses.replace(engine_config, max_reply_tokens=args.max_tokens)
    except (OSError, ValueError) as exc:
        log.error("bad configuration: %s", exc)
        return 2
    try:
        engine = DialogEngine.load(engine_config)
    except (EngineError, ValueError) as exc:
        log.error("could not load the dialog model: %s", exc)
        return 1
    api_key = args.api_key if args.api_key is not None else os.environ.get(_LLM_KEY_ENV, "")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def ready(port: int) -> None:
            log.info("duplexd serve-llm: model %s on http://%s:%d/v1", config.dialog.model, args.host, port)
            print(f"duplexd serve-llm ready: http://{args.host}:{port}/v1", flush=True)

        await serve_llm(
            engine, model=config.dialog.model, host=args.host, port=args.port, api_key=api_key, stop=stop, ready=ready
        )

    try:
        asyncio.run(run())
    except ExceptionGroup as group:
        if group.subgroup(OSError) is None:
            raise
        log.error("cannot listen on %s:%d: %s", args.host, args.port, _first(group))
        return 1
    log.info("stopped")
    global _exit_at_once
    _exit_at_once = True
    return 0


_LLM_KEY_ENV = "DUPLEXD_LLM_API_KEY"


def _first(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _cmd_cluster(args: argparse.Namespace) -> int:
    from duplexd import cluster

    return cluster.main(args)


def _cmd_stream(args: argparse.Namespace) -> int:
    import soundfile as sf

    from duplexd.clients.stream import Line, StreamOutput, read_audio, stream_pcm

    if not args.file.is_file():
        raise UsageError(f"no audio file at {args.file}: give the path of a WAV or FLAC file")
    try:
        pcm, rate = read_audio(args.file)
    except (sf.LibsndfileError, OSError) as exc:
        reason = getattr(exc, "error_string", exc)
        raise UsageError(f"cannot read {args.file} as audio ({reason}): give a WAV or FLAC file") from exc
    output = StreamOutput(json_lines=args.json, acks=args.acks, tty=sys.stdout.isatty())

    def write(lines: list[Line]) -> None:
        for line in lines:
            print(line.text, end=line.end, file=sys.stderr if line.stderr else sys.stdout, flush=True)

    try:
        result = asyncio.run(
            stream_pcm(args.url, pcm, rate, speed=args.speed, on_event=lambda got: write(output.show(got)))
        )
    finally:
        write(output.close())  # (what was heard is printed, however the stream ended)
    return 0 if result.close_code in (None, 1000) else 1


def _cmd_loadtest(args: argparse.Namespace) -> int:
    from duplexd.clients import loadtest
    from duplexd.clients.stream import check_server

    if args.sessions < 1 or args.duration <= 0:
        raise UsageError("--sessions must be >= 1 and --duration > 0")
    asyncio.run(check_server(args.url))  # a wrong --url fails here, not as N failed users in a report
    return loadtest.main(args)


BENCHMARKS = {  # `duplexd bench NAME`: the module whose `main(args)` runs it
    "asr": "duplexd.bench.asr",
    "llm": "duplexd.bench.llm",
    "context": "duplexd.bench.context",
    "voice": "duplexd.bench.voice",
    "speculation": "duplexd.bench.speculation",
    "replies": "duplexd.bench.replies",
    "relay": "duplexd.bench.dual_path",  # (`duplexd/bench/relay.py` is the UDP relay of `bench transport`)
    "capacity": "duplexd.bench.capacity",
    "overload": "duplexd.bench.capacity",  # (its `main` tells the two apart by `args.what`)
    "collapse": "duplexd.bench.collapse",
    "transport": "duplexd.bench.transport",
    "webrtc-tokens": "duplexd.bench.rtc_tokens",
    "chaos": "duplexd.bench.chaos",
    "cluster": "duplexd.bench.cluster",
    "threads": "duplexd.bench.threads",
    "tools": "duplexd.bench.tools",
}


def _cmd_bench(args: argparse.Namespace) -> int:
    # --sessions is shared; its default depends on the benchmark.
    if args.what == "collapse":
        args.sessions = args.sessions or 6
    if args.what == "overload" and args.sessions is None:
        args.sessions = 2 * args.n_star
    return importlib.import_module(BENCHMARKS[args.what]).main(args)


def _cmd_chat(args: argparse.Namespace) -> int:
    from duplexd.dialog.chat import run_chat
    from duplexd.dialog.engine import DialogEngine, EngineConfig
    from duplexd.errors import EngineError

    overrides = {"dialog": {"system_prompt": args.system, "model": args.model}}
    try:
        config = load_config(args.config, overrides=overrides)
    except (OSError, ValueError) as exc:
        log.error("bad configuration: %s", exc)
        return 2
    engine_config = dataclasses.replace(EngineConfig.from_config(config.dialog), max_sessions=1)
    try:
        engine = DialogEngine.load(engine_config)
    except EngineError as exc:
        log.error("could not load the dialog model: %s", exc)
        return 1
    try:
        return run_chat(engine, sys.stdin, sys.stdout, interactive=sys.stdin.isatty())
    except KeyboardInterrupt:
        print()
        return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from duplexd.asr.engine import default_asr_model
    from duplexd.asr.vad import default_vad_model
    from duplexd.dialog.models import cached_llm

    if args.action == "pull":
        return _pull_llm()
    gguf, converted = cached_llm()  # None until `duplexd models pull` (or the first dialog) fetched them
    paths = {"vad": default_vad_model(), "asr": default_asr_model(), "llm": gguf, "llm_converted": converted}
    print(json.dumps({name: None if path is None else str(path) for name, path in paths.items()}, indent=2))
    return 0


def _pull_llm() -> int:
    from duplexd.dialog.weights import pull
    from duplexd.errors import EngineError

    start_s = time.perf_counter()
    try:
        gguf, converted = pull()
    except EngineError as exc:
        log.error("could not pull the dialog LLM: %s", exc)
        return 1
    log.info("dialog LLM ready in %.1fs", time.perf_counter() - start_s)
    print(json.dumps({"llm": str(gguf), "llm_converted": str(converted)}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="duplexd", description="Real-time streaming speech and duplex dialogue server"
    )
    parser.add_argument("--version", action="version", version=f"duplexd {__version__}")
    _add_log_flags(parser, default=False)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the server")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--config", type=Path, default=None, help="TOML config file")
    p.add_argument(
        "--no-dialog",
        dest="dialog",
        action="store_const",
        const=False,
        default=None,
        help="transcription only: load no LLM or TTS",
    )
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("cluster", help="several `serve` processes behind HAProxy on this machine (to try scale-out)")
    p.add_argument("--workers", type=int, default=2, help="duplexd serve processes (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="address of the balancer and the workers")
    p.add_argument("--port", type=int, default=8000, help="the balancer's port (default 8000)")
    p.add_argument("--base-port", type=int, default=8100, help="workers listen on base+1, base+2, ... (default 8100)")
    p.add_argument("--stats-port", type=int, default=8404, help="HAProxy's statistics page (default 8404)")
    p.add_argument("--check-ms", type=int, default=500, help="how often HAProxy checks each /readyz")
    p.add_argument("--config", type=Path, default=None, help="TOML config file for every worker")
    p.add_argument(
        "--no-dialog", dest="dialog", action="store_const", const=False, default=None, help="transcription only"
    )
    p.add_argument("--print-config", action="store_true", help="print the HAProxy configuration and exit")
    p.set_defaults(func=_cmd_cluster)

    p = sub.add_parser("serve-llm", help="the dialog LLM alone, behind an OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8001, help="port (default 8001; 0 picks a free one)")
    p.add_argument("--config", type=Path, default=None, help="TOML config file (its [dialog] section)")
    p.add_argument("--model", default=None, help="smollm2 (default), a .gguf file, or a local HF model folder")
    p.add_argument("--max-sessions", type=int, default=None, help="requests decoded at once (default [dialog])")
    p.add_argument("--max-tokens", type=int, default=None, help="longest reply (default [dialog] max_reply_tokens)")
    p.add_argument("--api-key", default=None, help=f"require this bearer key (default ${_LLM_KEY_ENV}; empty: no key)")
    p.set_defaults(func=_cmd_serve_llm)

    p = sub.add_parser(
        "stream",
        help="stream an audio file to a server and print transcripts",
        description="Send an audio file to a running `duplexd serve` at real-time pace and print its transcript. "
        "It prints one line per utterance; speech the speaker goes on with after a breath is joined to the "
        "line it continues. On a terminal the line in progress, with the partial transcript, is rewritten in "
        "place; into a pipe or a file only final transcripts are printed, each line once it is over.",
    )
    p.add_argument("file", type=Path, help="the audio to send: a WAV or FLAC file (stereo is mixed to mono)")
    p.add_argument(
        "--url",
        default="ws://127.0.0.1:8000/v1/stream",
        help="the server's stream endpoint, ws:// or wss:// (default %(default)s)",
    )
    p.add_argument("--speed", type=float, default=1.0, help="times real time (default 1.0)")
    p.add_argument("--json", action="store_true", help="print every server event as one JSON line (but frame.ack)")
    p.add_argument("--acks", action="store_true", help="with --json, also the frame.ack sent for every audio frame")
    p.set_defaults(func=_cmd_stream)

    p = sub.add_parser("bench", help="run a benchmark and write JSON")
    p.add_argument("what", choices=list(BENCHMARKS))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--data", type=Path, default=None, help="speech clips (default $DUPLEXD_TEST_DATA or ../shared/data)"
    )
    p.add_argument("--quick", action="store_true", help="fewer clips and shorter streams (a smoke run)")
    p.add_argument("--device", default="cpu", help="llm: where the engine and its baselines run (cpu, cuda)")
    p.add_argument(
        "--remote-llm",
        action="store_true",
        help="speculation, voice: replies from a `duplexd serve-llm` (backend remote)",
    )
    p.add_argument(
        "--remote-url",
        default=None,
        help="relay: the remote model's OpenAI-compatible base URL, e.g. a bigger model's (default: a local "
        "`duplexd serve-llm`); its key from DUPLEXD_DIALOG__REMOTE_API_KEY",
    )
    p.add_argument("--remote-model", default="", help="relay: the model name to ask --remote-url for")
    p.add_argument("--delays", default=None, help="relay: the remote's added delays in ms (default 0,300,600)")
    p.add_argument("--tool-latencies", default=None, help="tools: the tool's latencies in ms (default 300,800)")
    p.add_argument("--streams", default="1,2,4", help="concurrency levels for the long streams (default 1,2,4)")
    p.add_argument("--no-per-clip", action="store_true", help="skip the clip-by-clip WER/latency run")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="voice: every scenario again with the turn-taking features off; relay: also with the remote "
        "model asked beside the prefix's decision (relay.remote_at_once = true)",
    )
    p.add_argument("--scenarios", default=None, help="voice: only these, e.g. echo,backchannel (default: all of them)")
    p.add_argument(
        "--echo-rooms",
        type=int,
        default=None,
        metavar="N",
        help="voice: N rooms at each of the two echo levels, the clips in turn (default: one per clip talked "
        "over, 5: one false barge-in is then 10 %%)",
    )
    p.add_argument(
        "--transport",
        default=None,
        help="voice: websocket (default), or websocket,webrtc: the question clips also as WebRTC calls",
    )
    p.add_argument(
        "--replay",
        default=None,
        metavar="MODELS",
        help="asr: also replay the clips in-process for these [asr] models, e.g. tiny,base (--streams '': only that)",
    )
    p.add_argument(
        "--clocks",
        default=None,
        metavar="FACTORS",
        help="asr: with --replay, replay again with each pass taking the fitted cost times each factor, "
        "e.g. 0.6,0.8,1,1.2 (WER over several pass clocks)",
    )
    p.add_argument(
        "--programs",
        type=int,
        default=0,
        metavar="N",
        help="asr: with --replay, also replay bench peer's first N one-stream programs (the clips 1 s apart) at "
        "those clocks, against offline on the same audio (9: 814 words)",
    )
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--duration", type=float, default=45.0, help="capacity/overload: seconds per load test")
    p.add_argument("--max-sessions", type=int, default=8, help="capacity, cluster: the largest N tried")
    p.add_argument("--workers", default="1,2,3", help="cluster: worker counts behind the balancer (default 1,2,3)")
    p.add_argument("--latency-s", type=float, default=30.0, help="cluster: seconds of the balancer-latency run")
    p.add_argument("--continuous", action="store_true", help="capacity: users talk all the time")
    p.add_argument("--n-star", type=int, default=2, help="overload: the N* measured by `bench capacity`")
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="overload: users (default 2 x N*); collapse: conversations (default 6)",
    )
    p.add_argument("--session-s", type=float, default=20.0, help="overload: length of each user's sessions")
    p.add_argument("--reply-lag-s", type=float, default=None, help="overload: the controller's reply-lag target")
    p.add_argument("--runs", type=int, default=20, help="collapse: runs per KV policy")
    p.add_argument("--turns", type=int, default=5, help="collapse: turns per conversation")
    p.add_argument("--reply-tokens", type=int, default=48, help="collapse: longest reply")
    p.add_argument("--window", type=int, default=252, help="collapse: bounded window W (pool = sessions x (4 + W))")
    p.add_argument("--unbounded-window", type=int, default=2044, help="collapse: slot rows of the unbounded baseline")
    p.add_argument("--timeout", type=float, default=120.0, help="collapse: a run not done by then collapsed")
    p.add_argument("--replicates", type=int, default=3, help="transport: loss seeds per reply stream")
    p.add_argument(
        "--tokens-per-s",
        type=float,
        default=None,
        help="transport: replay the replies at this even pace (a loaded server) instead of as they were decoded",
    )
    p.add_argument("--fuzz-messages", type=int, default=10_000, help="chaos: fuzzed messages over both endpoints")
    p.add_argument("--cycles", type=int, default=1000, help="chaos: abrupt disconnect/resume cycles")
    p.add_argument("--soak-s", type=float, default=600.0, help="chaos: soak length at --n-star sessions (0: none)")
    p.add_argument(
        "--slow-reader-s", type=float, default=300.0, help="chaos: longest wait for a non-reading client's close"
    )
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "relay", help="a UDP relay that simulates loss, delay and jitter (see `duplexd relay --help`)", add_help=False
    )

    p = sub.add_parser("loadtest", help="many real-time voice users against one server; JSON + HTML report")
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/stream")
    p.add_argument("--sessions", type=int, required=True, help="simulated users, each on its own session")
    p.add_argument("--duration", type=float, default=60.0, help="seconds each user talks and listens")
    p.add_argument("--ramp", action="store_true", help="start users spread over the first half of the run")
    p.add_argument("--continuous", action="store_true", help="users talk all the time (no pauses for replies)")
    p.add_argument("--no-retry", dest="retry", action="store_false", help="a refused user gives up (default: retries)")
    p.add_argument(
        "--clips", type=Path, default=None, help="speech clips (default $DUPLEXD_TEST_DATA or ../shared/data)"
    )
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=_cmd_loadtest)

    p = sub.add_parser("chat", help="talk to the dialog engine in the terminal (text only)")
    p.add_argument("--config", type=Path, default=None, help="TOML config file (its [dialog] section)")
    p.add_argument("--model", default=None, help="smollm2 (default), a .gguf file, or a local HF model folder")
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("models", help="show where the default models are, or pull the dialog LLM")
    p.add_argument(
        "action",
        nargs="?",
        choices=["list", "pull"],
        default="list",
        help="list: print the model paths (default); pull: fetch the dialog LLM and convert it once",
    )
    p.set_defaults(func=_cmd_models)
    for name, command in sub.choices.items():
        if name != "relay":  # the relay parses its own options (see main)
            _add_log_flags(command, default=argparse.SUPPRESS)
    return parser


def _add_log_flags(parser: argparse.ArgumentParser, *, default: object) -> None:
    """-v and --log-json, given before the command (`parser`, default False) or after it (each command's
    parser, default SUPPRESS: not given there leaves the value from before the command)."""
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="debug logging")
    parser.add_argument(
        "--log-json", action="store_true", default=default, help="structured logs: one JSON object per line"
    )


_exit_at_once = False  # set by a command that has stopped cleanly and leaves nothing to tear down


def run() -> None:
    """The console entry point (`duplexd`, `python -m duplexd`). After `serve` has closed its connections and
    stopped its workers, the interpreter's own teardown (the module and model destructors of torch,
    CTranslate2 and ONNX Runtime) took another 1.5-3 s on two cores, and a stopped server should be gone at
    once: nothing is left to flush but the logs and standard streams."""
    code = main()
    if _exit_at_once:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def openmp_setup() -> None:
    """How the models' OpenMP threads wait, set before torch or CTranslate2 is loaded (docs/benchmarks.md,
    "Threads"). Two things, both measured:

    - CTranslate2 is loaded before torch, so the recognizer keeps the OpenMP runtime its wheel ships.
      Loaded after, it binds to torch's (exported globally), and the two workers' thread teams count as
      one runtime's: more threads than cores, so libgomp throttles every wait to ~100 spins, and each of
      the ~1,500 small ops of a decode step pays a sleep and a wake-up (1.7x slower decode, alone or not).
    - Idle threads spin at most `GOMP_SPINCOUNT` = 10,000 times (~0.1 ms) before sleeping: the gaps between
      a step's ops are shorter, the gaps between steps and passes longer (libgomp's default spins ~3 ms,
      `OMP_WAIT_POLICY=PASSIVE` not at all).

    A user's own `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` is kept."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = "10000"
    if "torch" not in sys.modules:
        with contextlib.suppress(ImportError):  # (a dependency; absent only in a broken install)
            import ctranslate2  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    openmp_setup()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["relay"]:  # the relay has its own options (it also runs as `python -m duplexd.bench.relay`)
        from duplexd.bench import relay

        logs.setup()
        return relay.main(argv[1:])
    args = build_parser().parse_args(argv)
    logs.setup(verbose=args.verbose, json_lines=args.log_json)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        error = _cli_error(args, exc)
        if error is None:
            raise  # a bug: keep its traceback
        print(f"duplexd: error: {error}", file=sys.stderr)
        return error.exit_code


def _cli_error(args: argparse.Namespace, exc: BaseException) -> CliError | None:
    """`exc` as the one line a user reads: a `CliError` raised on purpose, a model that would not load, or
    (for a command with --url) a failure to reach the server; None for anything else."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:  # raised inside a TaskGroup
        exc = exc.exceptions[0]
    if isinstance(exc, CliError):
        return exc
    if isinstance(exc, EngineError):
        return CliError(f"model error: {exc}")
    url = getattr(args, "url", None)
    if isinstance(url, str):
        from duplexd.clients.stream import connect_error

        return connect_error(url, exc)
    return None
