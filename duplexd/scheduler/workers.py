"""The engine workers. One thread per engine; the asyncio side only submits work and awaits results.

- `VadWorker` gathers the VAD chunks of every session that has some and evaluates them in one batch.
- `AsrScheduler` owns the single ASR engine and orders the sessions' due passes by Highest Response Ratio
  Next (`hrrn.py`): short windows go first at equal waits, long ones win as their wait grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from duplexd.asr.echo import EchoCanceller
from duplexd.asr.engine import ASR_SAMPLE_RATE, AsrEngine, Transcription
from duplexd.asr.streaming import PassRequest
from duplexd.asr.turn_audio import TurnAudioModel
from duplexd.asr.vad import SileroVad, VadStream
from duplexd.errors import Overloaded
from duplexd.events import Event
from duplexd.scheduler.hrrn import Candidate, Choice, PassCosts, pick

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _VadJob:
    stream: VadStream
    chunks: np.ndarray
    done: asyncio.Future[VadResult]
    echo: EchoCanceller | None = None
    far: np.ndarray | None = None  # the echo canceller's reference for these chunks
    echo_only: np.ndarray | None = None  # per chunk: the reply's echo and nothing else (VAD: silence)
    echo_levels: np.ndarray | None = None  # per chunk: energy as heard, as cancelled (`EchoCanceller.levels`)


class VadResult(NamedTuple):
    probs: np.ndarray  # per chunk: P(speech)
    chunks: np.ndarray  # the chunks as the echo canceller returns them (as given without one)
    echo_levels: np.ndarray | None  # per chunk: energy as heard, as cancelled (None: no canceller ran)


class TurnAudioWorker:
    """Scores the sessions' pauses with the acoustic end-of-turn model (`asr.turn_audio`), one at a time on
    its own thread. Bounded: while `max_pending` wait, a pause goes unscored (None: the endpointer goes by
    the text alone, as without the model)."""

    def __init__(self, model: TurnAudioModel, max_pending: int) -> None:
        self.model = model
        self.max_pending = max_pending
        self._pending = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duplexd-turn-audio")
        self.calls = 0
        self.busy_s = 0.0
        self.skipped = 0

    async def probability(self, audio: np.ndarray) -> float | None:
        if self._pending >= self.max_pending:
            self.skipped += 1
            return None
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._score, audio)
        finally:
            self._pending -= 1

    def _score(self, audio: np.ndarray) -> float:
        t0 = time.perf_counter()
        p = self.model.probability(audio)
        self.busy_s += time.perf_counter() - t0
        self.calls += 1
        return p

    def report(self) -> dict[str, object]:
        """For /healthz: the model, pauses scored, its cost."""
        return {
            "model": self.model.name,
            "pauses": self.calls,
            "busy_s": round(self.busy_s, 3),
            "ms_per_pause": round(1000 * self.busy_s / self.calls, 1) if self.calls else None,
            "skipped": self.skipped,
        }

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class VadWorker:
    """Evaluates the sessions' VAD chunks in batches; a session's echo canceller runs first, in the same
    thread: its echo-only chunks are silence to VAD, and the chunks VAD and the recognizer get are what it
    returns (the cancelled audio only with `turn.echo_cancellation = "cancel"`)."""

    def __init__(self, engine: SileroVad, max_pending: int) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[_VadJob] = asyncio.Queue(maxsize=max_pending)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duplexd-vad")
        self.batch_samples: deque[int] = deque(maxlen=1024)  # sessions per VAD batch, for /metrics
        self.echo_s = 0.0  # time spent cancelling echo (the thread's), and the audio it covered
        self.echo_audio_s = 0.0
        self.echo_gated = 0  # chunks VAD took as silence: echo only

    async def probabilities(
        self,
        stream: VadStream,
        chunks: np.ndarray,
        *,
        echo: EchoCanceller | None = None,
        far: np.ndarray | None = None,
    ) -> VadResult:
        """The speech probability of each chunk, the chunks as `echo` returns them (as given without one), and
        what the canceller took out of each."""
        if len(chunks) == 0:
            return VadResult(np.zeros(0, np.float32), chunks, None)
        job = _VadJob(stream, chunks, asyncio.get_running_loop().create_future(), echo, far)
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            raise Overloaded("VAD queue is full") from None
        return await job.done

    def _evaluate(self, jobs: list[_VadJob]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        for job in jobs:
            if job.echo is not None and job.far is not None:
                shape = job.chunks.shape
                job.chunks = job.echo.process(job.chunks.reshape(-1), job.far).reshape(shape)
                job.echo_only = job.echo.echo_only(job.far.reshape(shape))
                job.echo_levels = job.echo.levels
                self.echo_gated += int(job.echo_only.sum())
                self.echo_audio_s += job.chunks.size / ASR_SAMPLE_RATE
        self.echo_s += time.perf_counter() - t0
        probs = self._engine.probabilities([j.stream for j in jobs], [j.chunks for j in jobs])
        for job, p in zip(jobs, probs, strict=True):
            if job.echo_only is not None:
                p[job.echo_only] = 0.0  # (the reply's echo, cancelled: no one is talking)
        return probs

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self._queue.get()]
            while not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            self.batch_samples.append(len(jobs))
            try:
                probs = await loop.run_in_executor(self._executor, self._evaluate, jobs)
            except Exception as exc:
                log.exception("VAD batch failed")
                for job in jobs:
                    if not job.done.done():
                        job.done.set_exception(exc)
                continue
            for job, p in zip(jobs, probs, strict=True):
                if not job.done.done():
                    job.done.set_result(VadResult(p, job.chunks, job.echo_levels))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class AsrJob(Protocol):
    """What the scheduler asks of a stream that needs recognizer passes (a `streaming.Session`)."""

    @property
    def id(self) -> str: ...
    @property
    def asr_lag_s(self) -> float: ...
    @property
    def pass_in_flight(self) -> bool: ...
    def wants_pass(self) -> bool: ...
    def next_window_s(self) -> float: ...
    def next_preview(self) -> bool: ...
    def prepare_pass(self) -> PassRequest: ...
    def apply_pass(self, request: PassRequest, result: Transcription) -> list[Event]: ...
    def abort_pass(self, request: PassRequest) -> list[Event]: ...


@dataclass(slots=True)
class _Client:
    session: AsrJob
    emit: Callable[[list[Event]], None]
    last_pass: float
    idle: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class AsrStats:
    passes: int = 0
    busy_s: float = 0.0
    audio_s: float = 0.0  # window audio fed to passes
    recent_pass_s: deque[float] = field(default_factory=lambda: deque(maxlen=256))


class AsrScheduler:
    def __init__(self, engine: AsrEngine, cores: threading.Lock | None = None) -> None:
        """`cores`: held for each pass (shared with the LLM worker's steps: they take turns)."""
        self._engine = engine
        self._cores = cores
        self._clients: dict[str, _Client] = {}
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duplexd-asr")
        self.stats = AsrStats()
        self.cost = PassCosts()
        self.schedule: deque[Choice] = deque(maxlen=256)  # recent choices, with every candidate's ratio
        self.busy = False  # a pass is running (low-priority work elsewhere waits for it)

    def register(self, session: AsrJob, emit: Callable[[list[Event]], None]) -> None:
        self._clients[session.id] = _Client(session, emit, time.monotonic())

    def unregister(self, session: AsrJob) -> None:
        self._clients.pop(session.id, None)

    def notify(self) -> None:
        self._wake.set()

    async def drained(self, session: AsrJob) -> None:
        """Wait until `session` has no pass due or in flight."""
        client = self._clients[session.id]
        while session.wants_pass() or session.pass_in_flight:
            client.idle.clear()
            self.notify()
            await client.idle.wait()

    def _next(self) -> _Client | None:
        due = sorted((c for c in self._clients.values() if c.session.wants_pass()), key=lambda c: c.last_pass)
        candidates = [
            Candidate(c.session.id, c.session.asr_lag_s, c.session.next_window_s(), c.session.next_preview())
            for c in due
        ]
        choice = pick(candidates, self.cost)
        if choice is None:
            return None
        self.schedule.append(choice)
        return self._clients[choice.key]

    def _transcribe(self, request: PassRequest) -> tuple[Transcription, float]:
        """A pass on the ASR thread, and its own time (not the wait for the cores)."""
        with self._cores if self._cores is not None else contextlib.nullcontext():
            t0 = time.monotonic()
            result = self._engine.transcribe(request.audio, request.prompt, request.preview)
            return result, time.monotonic() - t0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (client := self._next()) is not None:
                session = client.session
                request = session.prepare_pass()
                self.busy = True
                try:
                    result, elapsed = await loop.run_in_executor(self._executor, self._transcribe, request)
                except Exception:
                    log.exception("ASR pass failed for session %s", session.id)
                    client.emit(session.abort_pass(request))
                    client.idle.set()
                    continue
                finally:
                    self.busy = False
                    client.last_pass = time.monotonic()
                self.stats.passes += 1
                self.stats.busy_s += elapsed
                self.stats.audio_s += len(request.audio) / ASR_SAMPLE_RATE
                self.stats.recent_pass_s.append(elapsed)
                self.cost.observe(len(request.audio) / ASR_SAMPLE_RATE, elapsed, request.preview)
                log.debug(
                    "session %s: %s pass over %.2f s in %.3f s",
                    session.id,
                    "final" if request.final else "preview" if request.preview else "partial",
                    len(request.audio) / ASR_SAMPLE_RATE,
                    elapsed,
                )
                if self._clients.get(session.id) is client:
                    client.emit(session.apply_pass(request, result))
                    client.idle.set()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
