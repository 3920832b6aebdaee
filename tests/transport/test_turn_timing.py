"""What an operator sees of a spoken turn on a real server: one INFO line with the words both ways and the
latency breakdown, and the same parts as `/metrics` histograms."""

from __future__ import annotations

import asyncio
import json
import logging

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect
from wire import get, speak

from duplexd.bench import scenarios as sc

pytestmark = pytest.mark.slow


async def test_a_spoken_turn_is_logged_once_and_counted_in_the_latency_histograms(
    make_server, clip_by_name, caplog
) -> None:
    srv = await make_server()
    clip = clip_by_name["clip14_sb_spk2_snt2.wav"]
    audio = np.concatenate([sc.silence(0.3), sc.load(clip.path), sc.silence(4)])
    pcm = audio.astype("<i2").tobytes()
    caplog.set_level(logging.INFO, logger="duplexd.transport.voice")
    async with connect(srv.url) as ws:
        await ws.send(json.dumps({"type": "session.start", "version": 1, "sample_rate": sc.RATE}))
        events = await speak(ws, pcm, "reply.done", keep_talking=True)
    turn = next(e for e in events if e["type"] == "turn.ended")
    done = next(e for e in events if e["type"] == "reply.done")
    lines = [r for r in caplog.records if getattr(r, "event", None) == "turn.timing"]
    assert len(lines) == 1
    record = lines[0]
    message = record.getMessage()
    assert " ".join(turn["text"].split()[:4]) in message and " ".join(done["text"].split()[:2]) in message
    parts = {k: getattr(record, k) for k in ("turn_detection_s", "first_token_s", "first_audio_s", "voice_to_voice_s")}
    assert all(v is not None and v >= 0 for v in parts.values()), parts
    assert parts["voice_to_voice_s"] == pytest.approx(
        parts["turn_detection_s"] + parts["first_token_s"] + parts["first_audio_s"], abs=0.002
    )
    assert 0.2 < parts["turn_detection_s"] < 10  # at least the endpointer's pause, and it did end
    status, _, body = await asyncio.to_thread(get, srv.http + "/metrics")
    samples = {s.name: s.value for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    for name in ("voice_to_voice", "turn_detection", "first_token", "first_audio"):
        assert samples[f"duplexd_{name}_seconds_count"] == 1, name
    assert samples["duplexd_voice_to_voice_seconds_sum"] == pytest.approx(parts["voice_to_voice_s"], abs=0.002)
