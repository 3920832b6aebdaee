from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from duplexd.clients.clips import DATA_ENV, Clip, data_dir, load_clips
from duplexd.config import ServerConfig


@pytest.fixture(autouse=True)
def _restore_logging() -> object:
    """`cli.main` installs a handler on the root logger bound to this test's captured stderr: put the previous
    handlers back, or later tests' server threads log into a closed file ("--- Logging error ---")."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quieted = {
        name: logging.getLogger(name).level for name in ("faster_whisper", "websockets.server", "aioice", "aiortc")
    }
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, was in quieted.items():  # (`logs.setup` quiets these)
        logging.getLogger(name).setLevel(was)


@pytest.fixture(scope="session")
def clips() -> list[Clip]:
    try:
        return load_clips()
    except FileNotFoundError:
        pytest.skip(f"speech data not found at {data_dir()} (set {DATA_ENV} to the shared data folder)")


@pytest.fixture(scope="session")
def clip_by_name(clips: list[Clip]) -> dict[str, Clip]:
    return {c.path.name: c for c in clips}


@pytest.fixture(scope="session")
def engines() -> object:
    """The real embedded models, loaded once for the whole test run."""
    from duplexd.cli import load_engines

    return load_engines(ServerConfig())


class RunningServer:
    def __init__(self, server: object, port: int) -> None:
        self.server = server
        self.port = port
        self.url = f"ws://127.0.0.1:{port}/v1/stream"
        self.http = f"http://127.0.0.1:{port}"


@pytest.fixture
async def make_server(engines: object) -> AsyncIterator[object]:
    """Start real servers on port 0 (in this event loop, models on their worker threads)."""
    from duplexd.transport.server import Server

    stops: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(config: ServerConfig | None = None) -> RunningServer:
        import dataclasses

        config = config or ServerConfig()
        config = dataclasses.replace(config, transport=dataclasses.replace(config.transport, port=0))
        server = Server(config, engines)
        stop = asyncio.Event()
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(server.run(stop, ready=ready))
        stops.append((stop, task))
        return RunningServer(server, await asyncio.wait_for(ready, 30))

    yield start
    for stop, task in stops:
        stop.set()
        await asyncio.wait_for(task, 30)


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]
