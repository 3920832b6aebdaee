"""Reply tokens over the UDP datagram path, through the loss simulator: a real server with every real model,
real sockets, a relay dropping a fifth of the packets each way."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest

from duplexd.bench import scenarios as sc
from duplexd.bench.loss import LinkConfig
from duplexd.bench.relay import UdpRelay
from duplexd.clients.stream import StreamClient
from duplexd.transport.datagram import DatagramClient
from duplexd.transport.packetizer import Packet, Receiver, Token
from duplexd.transport.protocol import parse_audio_out

pytestmark = pytest.mark.slow

SILENCE_16K_20MS = np.zeros(320, np.int16).tobytes()


async def test_tokens_over_a_lossy_datagram_path_render_the_whole_reply(make_server, clip_by_name) -> None:
    # A story, not a two-sentence answer: the loss must hit tokens both ways (a 4-token reply, "A new home.",
    # sent 4 packets down and none was lost at this seed).
    srv = await make_server(sc.storyteller(max_reply_tokens=40, speed=1.0))
    client = await StreamClient.connect(srv.url)
    started = await client.start(sc.RATE, dialog=True, datagram=True)
    d = started["datagram"]
    assert d is not None and d["port"] > 0
    lossy = LinkConfig(loss="bernoulli:0.2", rtt_ms=40, seed=7)
    relay = await UdpRelay.start(upstream=(d["host"], d["port"]), up=lossy, down=lossy)
    over_udp = Receiver()  # only what the datagram path brings
    merged = Receiver()  # both paths, as a client would render
    merged_tokens: list[Token] = []
    udp_tokens: list[Token] = []

    def from_udp(tokens: list[Token]) -> None:
        udp_tokens.extend(tokens)
        merged_tokens.extend(merged.receive(Packet(0, tuple(tokens))))

    udp = await DatagramClient.connect(
        "127.0.0.1", relay.port, bytes.fromhex(d["tag"]), base64.b64decode(d["key"]), over_udp, from_udp
    )
    for _ in range(10):  # the first HELLO may be lost too
        udp.hello()
        await asyncio.sleep(0.02)

    question = np.concatenate([sc.silence(0.3), sc.load(clip_by_name["clip22_deepspeech_new_home.wav"].path)])
    audio_ms = 0.0
    events: list[dict] = []

    async def mic() -> None:
        t0 = time.monotonic()
        for i, start in enumerate(range(0, len(question), 320)):
            await asyncio.sleep(max(0.0, t0 + i * 0.02 - time.monotonic()))
            await client.send_pcm(question[start : start + 320].astype("<i2").tobytes())
        while True:
            await client.send_pcm(SILENCE_16K_20MS)
            await client.ws.send(json.dumps({"type": "playback", "played_ms": audio_ms}))
            await asyncio.sleep(0.02)

    async def receive() -> None:
        nonlocal audio_ms
        async for raw in client.ws:
            if isinstance(raw, bytes):
                audio_ms += len(parse_audio_out(raw).pcm) / 48
                continue
            event = json.loads(raw)
            events.append(event)
            if event["type"] == "reply.delta":  # (not acked over the WebSocket: the UDP acks must do)
                merged_tokens.extend(merged.receive(Packet(0, (Token(event["token_seq"], 1, event["text"]),))))
            if event["type"] == "reply.done":
                return

    async with asyncio.TaskGroup() as tg:
        talking = tg.create_task(mic())
        await asyncio.wait_for(receive(), 120)
        await asyncio.sleep(1.0)  # the sender's tail timer repeats what a lost packet held
        talking.cancel()
    done = next(e for e in events if e["type"] == "reply.done")
    # The datagram path alone rendered the whole reply, despite the loss; merged with the WebSocket's copy
    # it is the same text, each token once.
    assert "".join(t.text for t in udp_tokens) == done["text"] and over_udp.held == 0
    assert "".join(t.text for t in merged_tokens) == done["text"]
    assert [t.seq for t in merged_tokens] == list(range(1, len(merged_tokens) + 1))
    assert relay.stats.down.lost > 0 and relay.stats.up.lost > 0  # the path did lose packets, both ways
    health = srv.server.health()["datagram"]
    assert health["dropped"] == 0 and health["received"] > 0 and health["sent"] > 0
    udp.close()
    relay.close()
    await client.end()
    await client.close()
