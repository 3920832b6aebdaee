"""The TTS worker: one thread synthesizes every session's reply pieces, the most urgent first.

A piece's deadline is when the audio already queued for its session runs out; the worker always takes
the piece with the earliest deadline, so a reply that is about to go silent is served before one that
has seconds of audio in hand.

Prefetch: text that will probably be spoken (the first piece of a drafted reply) is synthesized when
nothing else is queued, and kept in a small cache; a piece submitted later with the same text is
delivered from it at once (synthesis is deterministic in its text).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from duplexd.errors import Overloaded
from duplexd.tts.engine import OUTPUT_SAMPLE_RATE, TtsEngine

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (session id, reply number)


@dataclass(order=True, slots=True)
class _Job:
    deadline: float
    order: int
    key: Key = field(compare=False)
    text: str = field(compare=False)
    deliver: Callable[[np.ndarray], None] = field(compare=False)


@dataclass(slots=True)
class TtsStats:
    pieces: int = 0
    busy_s: float = 0.0
    audio_s: float = 0.0
    prefetched: int = 0  # pieces synthesized ahead (counted in `pieces` too)
    prefetch_hits: int = 0  # pieces delivered from the prefetch cache
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=1024))  # piece seconds, for /metrics


class TtsWorker:
    def __init__(self, engine: TtsEngine, max_pending: int = 1024, cache: int = 32) -> None:
        self.engine = engine
        self._heap: list[_Job] = []
        self._prefetch: deque[str] = deque(maxlen=cache // 2)  # (the oldest requests give way)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_size = cache
        self.busy = False  # synthesizing a piece that is to be played (not a prefetch)
        self._order = itertools.count()
        self._cancelled: set[Key] = set()
        self._max_pending = max_pending
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duplexd-tts")
        self.stats = TtsStats()

    def submit(self, key: Key, text: str, deliver: Callable[[np.ndarray], None], deadline: float) -> None:
        if len(self._heap) >= self._max_pending:
            raise Overloaded("TTS queue is full")
        self._cancelled.discard(key)
        heapq.heappush(self._heap, _Job(deadline, next(self._order), key, text, deliver))
        self._wake.set()

    def prefetch(self, text: str) -> None:
        """Synthesize `text` when idle, for a `submit` of the same text that may follow."""
        if text and text not in self._cache and text not in self._prefetch:
            self._prefetch.append(text)
            self._wake.set()

    def cancel(self, key: Key) -> None:
        """Drop the queued pieces of `key`; a piece being synthesized is discarded when done."""
        self._cancelled.add(key)
        self._heap = [j for j in self._heap if j.key != key]
        heapq.heapify(self._heap)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._heap or self._prefetch:
                if not self._heap:
                    text = self._prefetch.popleft()
                    if text not in self._cache:
                        self._remember(text, await self._synthesize(loop, text))
                        self.stats.prefetched += 1
                    continue
                job = heapq.heappop(self._heap)
                audio = self._cache.pop(job.text, None)  # (one use: nobody else shares the array)
                if audio is None:
                    self.busy = True
                    try:
                        audio = await self._synthesize(loop, job.text)
                    finally:
                        self.busy = False
                else:
                    self.stats.prefetch_hits += 1
                if job.key in self._cancelled:
                    continue
                try:
                    job.deliver(audio)
                except Exception:
                    log.exception("delivering TTS audio failed")
            self._cancelled.clear()

    async def _synthesize(self, loop: asyncio.AbstractEventLoop, text: str) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            audio = await loop.run_in_executor(self._executor, self.engine.synthesize, text)
        except Exception:
            log.exception("TTS failed for %r", text[:80])
            audio = np.zeros(0, np.float32)
        self.stats.pieces += 1
        elapsed = time.perf_counter() - t0
        self.stats.busy_s += elapsed
        self.stats.samples.append(elapsed)
        self.stats.audio_s += len(audio) / OUTPUT_SAMPLE_RATE
        return audio

    def _remember(self, text: str, audio: np.ndarray) -> None:
        self._cache[text] = audio
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
