"""The TTS worker synthesizes a drafted reply's first piece ahead, and a later piece with the same text is
delivered from that (real hibari voice)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from duplexd.config import TtsConfig
from duplexd.scheduler.tts import TtsWorker
from duplexd.tts.engine import load_tts

pytestmark = pytest.mark.slow


async def test_a_prefetched_piece_is_delivered_without_synthesizing_again() -> None:
    worker = TtsWorker(load_tts(TtsConfig()))
    task = asyncio.create_task(worker.run())
    try:
        worker.prefetch("Paris is the")
        for _ in range(1000):
            if worker.stats.prefetched:
                break
            await asyncio.sleep(0.01)
        assert worker.stats.prefetched == 1 and worker.stats.pieces == 1
        got: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        worker.submit(("s", 1), "Paris is the", got.set_result, deadline=0.0)
        audio = await asyncio.wait_for(got, 30)
        assert worker.stats.prefetch_hits == 1 and worker.stats.pieces == 1  # no second synthesis
        assert len(audio) > 2400 and np.sqrt(np.mean(audio**2)) > 0.01  # real speech
        other: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        worker.submit(("s", 1), "Paris is the", other.set_result, deadline=0.0)  # used once: made again
        again = await asyncio.wait_for(other, 30)
        assert worker.stats.pieces == 2 and np.array_equal(again, audio)  # (synthesis is deterministic)
    finally:
        task.cancel()
        worker.close()
