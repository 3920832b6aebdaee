"""A client killed mid-reply reconnects with `session.resume`: a real server with every real model, a real
recording, a real TCP connection torn down without a closing handshake."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from duplexd.bench import scenarios as sc
from duplexd.clients.stream import SessionRefused, StreamClient
from duplexd.transport.packetizer import Packet, Receiver, Token
from duplexd.transport.protocol import parse_audio_out

pytestmark = pytest.mark.slow

OUT_RATE = 24_000
LONG_REPLY = sc.storyteller(max_reply_tokens=80, speed=0.7)
SILENCE_16K_20MS = np.zeros(320, np.int16).tobytes()


class Listener:
    """One client's view of the session, across connections: tokens merged by sequence number, reply
    audio in arrival order (its position in the output stream is what it has received)."""

    def __init__(self) -> None:
        self.receiver = Receiver()
        self.tokens: list[Token] = []
        self.audio = bytearray()
        self.events: list[dict] = []
        self.event_seq = 0  # last event `n` taken
        self.gaps: list[tuple[int, int]] = []  # (expected n, received n) where events went missing

    @property
    def audio_ms(self) -> float:
        return 1000 * len(self.audio) / 2 / OUT_RATE

    def render(self, tokens: list[Token]) -> None:
        self.tokens += tokens

    def text(self, reply: int) -> str:
        return "".join(t.text for t in self.tokens if t.reply == reply)

    async def run(self, client: StreamClient, stop: asyncio.Event, until) -> None:
        """Receive, ack, report playback (as a player that plays at once), send silence; until `until()`."""

        async def mic() -> None:
            while not stop.is_set():
                await client.send_pcm(SILENCE_16K_20MS)
                await client.ws.send(json.dumps({"type": "playback", "played_ms": self.audio_ms}))
                await asyncio.sleep(0.02)

        async def receive() -> None:
            async for raw in client.ws:
                if isinstance(raw, bytes):
                    self.audio += parse_audio_out(raw).pcm
                else:
                    event = json.loads(raw)
                    if "n" in event:
                        if event["n"] <= self.event_seq:
                            continue  # replayed after the resume, and taken already
                        if event["n"] != self.event_seq + 1:
                            self.gaps.append((self.event_seq + 1, event["n"]))
                        self.event_seq = event["n"]
                    self.events.append(event)
                    if event["type"] == "reply.delta":
                        token = Token(event["token_seq"], event["reply"], event["text"])
                        self.render(self.receiver.receive(Packet(0, (token,))))
                        await client.ack(self.receiver.contiguous, self.event_seq)
                if until():
                    stop.set()
                    return

        async with asyncio.TaskGroup() as tg:
            tg.create_task(mic())
            await receive()


async def say(client: StreamClient, pcm: np.ndarray) -> None:
    t0 = time.monotonic()
    for i, start in enumerate(range(0, len(pcm), 320)):
        await asyncio.sleep(max(0.0, t0 + i * 0.02 - time.monotonic()))
        await client.send_pcm(pcm[start : start + 320].astype("<i2").tobytes())


async def detached(server, within_s: float) -> None:
    """Wait until the server has seen a killed client's socket go and kept its session for a resume (how
    soon depends on the machine's load: its event loop reads the reset)."""
    deadline = time.monotonic() + within_s
    while server.counters["detached"] == 0:
        links = {
            sid: {"attached": c.attached, "replying": c.busy_replying, "socket": c.link and str(c.link.ws.state)}
            for sid, c in server.handles.items()
        }
        assert time.monotonic() < deadline, f"the server did not see the socket go in {within_s} s: {links}"
        await asyncio.sleep(0.05)


async def test_a_client_killed_mid_reply_resumes_with_nothing_lost_or_repeated(make_server, clip_by_name) -> None:
    srv = await make_server(LONG_REPLY)
    me = Listener()
    client = await StreamClient.connect(srv.url)
    started = await client.start(sc.RATE, dialog=True)
    me.event_seq = started["n"]
    question = np.concatenate([sc.silence(0.3), sc.load(clip_by_name["clip22_deepspeech_new_home.wav"].path)])
    await say(client, question)

    def some_reply_heard() -> bool:  # a few tokens and some audio of reply 1: it is mid-reply
        return len(me.text(1)) >= 12 and me.audio_ms >= 400

    await asyncio.wait_for(me.run(client, asyncio.Event(), some_reply_heard), 90)
    assert not any(e["type"] == "reply.done" for e in me.events), "the reply ended before the kill"
    client.ws.transport.abort()  # killed: no closing handshake
    heard_before = (me.receiver.contiguous, me.audio_ms)
    await detached(srv.server, within_s=10.0)
    await asyncio.sleep(1.0)  # the reply goes on without the client
    assert srv.server.counters["detached"] == 1 and len(srv.server.sessions) == 1

    client, resumed = await StreamClient.resume(
        srv.url, started, token_seq=heard_before[0], audio_ms=heard_before[1], seq=client.seq, event_seq=me.event_seq
    )
    assert resumed["session_id"] == started["session_id"]
    assert resumed["tokens_lost"] == 0 and resumed["audio_lost_ms"] == 0 and resumed["events_lost"] == 0
    assert resumed["audio_ms"] == pytest.approx(heard_before[1], abs=0.05)  # audio continues where ours ends
    assert resumed["token_seq"] == heard_before[0] + 1 or not resumed["tokens"]
    tokens = tuple(Token(resumed["token_seq"] + i, r, t) for i, (r, t) in enumerate(resumed["tokens"]))
    if tokens:
        me.render(me.receiver.receive(Packet(0, tokens)))

    def reply_done() -> bool:
        return any(e["type"] == "reply.done" for e in me.events)

    await asyncio.wait_for(me.run(client, asyncio.Event(), reply_done), 120)
    done = next(e for e in me.events if e["type"] == "reply.done")
    # The text rendered across the kill is the whole reply, each token once, in order.
    assert me.text(1) == done["text"] and len(done["text"]) > len(me.text(1)[:12])
    assert [t.seq for t in me.tokens] == list(range(1, len(me.tokens) + 1))
    # Every event of the session arrived exactly once, across the kill (`n` 1, 2, 3, ... without a gap).
    assert me.gaps == [] and me.event_seq > 10
    # Every sample of the reply's audio arrived exactly once: the lengths agree to the sample.
    assert len(me.audio) // 2 == round(done["audio_ms"] * OUT_RATE / 1000)
    assert srv.server.counters["resumed"] == 1
    srv.server.control.collect()
    assert b"duplexd_session_resumes_total 1.0" in srv.server.metrics.render()
    await client.end()
    await client.close()


async def test_a_resume_token_that_is_not_the_sessions_own_is_refused(make_server) -> None:
    srv = await make_server()
    client = await StreamClient.connect(srv.url)
    started = await client.start(sc.RATE, dialog=False)
    await client.send_pcm(SILENCE_16K_20MS)
    client.ws.transport.abort()
    forged = {**started, "resume": {"token": "x" * len(started["resume"]["token"])}}
    with pytest.raises(SessionRefused) as refused:
        await StreamClient.resume(srv.url, forged, token_seq=0, audio_ms=0, seq=1)
    assert refused.value.reply["code"] == "resume_refused"
    unknown = {**started, "session_id": "0" * 32}
    with pytest.raises(SessionRefused):
        await StreamClient.resume(srv.url, unknown, token_seq=0, audio_ms=0, seq=1)
    # The session's own token still works (the refusals did not end it), and its stream continues.
    client, resumed = await StreamClient.resume(srv.url, started, token_seq=0, audio_ms=0, seq=1)
    assert resumed["tokens"] == [] and resumed["audio_ms"] == 0
    await client.send_pcm(SILENCE_16K_20MS)
    await client.end()
    events = [json.loads(m) async for m in client.ws if isinstance(m, str)]
    assert events[-1]["type"] == "session.ended" and client.ws.close_code == 1000


async def test_many_abrupt_disconnects_with_resume_lose_nothing(make_server, clip_by_name) -> None:
    from duplexd.bench.chaos import reconnect_cycles

    srv = await make_server()
    speech = sc.load(clip_by_name["clip22_deepspeech_new_home.wav"].path)
    # Asked once, then quiet while the reply streams through the cuts and plays out (repeated 3 s apart,
    # the question would interrupt its own reply whenever the reply speaks longer than the pause).
    r = await reconnect_cycles(srv.url, speech, sc.RATE, 40, seed=1, final_s=15.0, pause_s=60.0)
    assert r.cycles == 40 and r.resume_refused == 0
    assert r.lost_events == 0 and r.lost_tokens == 0 and r.replies_mismatched == 0, r
    assert r.finals >= 1 and r.replies >= 1, r  # the reply streamed through the cuts arrived whole
    assert srv.server.counters["resumed"] == 40
