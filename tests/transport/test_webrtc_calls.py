"""WebRTC calls (`/v1/realtime/calls`) placed as OpenAI's documented flow does: the official `openai` package
posts the SDP offer (and the session's settings, or takes a client secret first), an aiortc peer connection
carries the microphone and the reply as Opus tracks and the JSON events on `oai-events`. Real server, every
real model, a real recording. Every event on the channel is validated against the openai package's models."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.error
import urllib.request

import numpy as np
import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("aiortc")
openai = pytest.importorskip("openai")
ifaddr = pytest.importorskip("ifaddr")
from openai.types.realtime import RealtimeServerEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from duplexd.bench import scenarios as sc  # noqa: E402
from duplexd.bench.data import wer  # noqa: E402
from duplexd.clients.rtc import RtcClient, post_offer  # noqa: E402
from duplexd.config import ServerConfig  # noqa: E402

SERVER_EVENT = TypeAdapter(RealtimeServerEvent)
CLIP = "clip22_deepspeech_new_home.wav"
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."


@pytest.fixture(autouse=True)
def _host_candidates() -> None:
    """ICE pairs host candidates; aioice leaves the loopback address out, so a machine needs another one."""
    if not any(isinstance(ip.ip, str) and ip.ip != "127.0.0.1" for a in ifaddr.get_adapters() for ip in a.ips):
        pytest.skip("no network interface other than loopback: WebRTC has no host candidate to pair")


def validated(client: RtcClient) -> list[str]:
    for event in client.events:
        SERVER_EVENT.validate_python(event)  # raises on any shape the GA protocol does not allow
    return [e["type"] for e in client.events]


def _post_raw(url: str, body: bytes, content_type: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, body, {"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def ended(server, calls: int = 0, timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while len(server.calls.active) != calls or len(server.sessions) != calls:  # noqa: ASYNC110 (the server's counts)
            await asyncio.sleep(0.05)


async def test_the_openai_client_places_a_call_and_a_spoken_turn_gets_transcript_text_and_audio(
    make_server, clip_by_name
) -> None:
    srv = await make_server()
    api = openai.AsyncOpenAI(api_key="not-checked", base_url=f"{srv.http}/v1")
    client = RtcClient()
    try:
        answer = await api.realtime.calls.create(
            sdp=await client.offer(),
            session={
                "type": "realtime",
                "instructions": INSTRUCTIONS,
                "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 800}}},
            },
        )
        call_id = answer.response.headers["location"].rsplit("/", 1)[-1]
        assert answer.response.status_code == 201 and answer.response.headers["content-type"] == "application/sdp"
        await client.connect(answer.text)
        await client.wait_for(lambda e: any(x["type"] == "session.created" for x in e), 10)
        created = client.of("session.created")[0]["session"]
        assert created["instructions"] == INSTRUCTIONS  # (the call's `session`, in effect from the start)
        assert created["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 800

        clip = clip_by_name[CLIP]
        client.mic.say(np.concatenate([sc.silence(0.3), sc.load(clip.path)]), sc.RATE)
        await client.wait_for(lambda e: any(x["type"] == "output_audio_buffer.stopped" for x in e), 60)
        kinds = validated(client)
        assert "error" not in kinds
        assert "response.output_audio.delta" not in kinds  # (the audio is on the track)
        assert kinds.index("input_audio_buffer.speech_started") < kinds.index("response.created")
        assert kinds.index("output_audio_buffer.started") < kinds.index("output_audio_buffer.stopped")
        assert kinds.index("response.done") < kinds.index("output_audio_buffer.stopped")
        (heard,) = client.of("conversation.item.input_audio_transcription.completed")
        assert wer([clip.text], [heard["transcript"]]) <= 0.4, heard
        (done,) = client.of("response.done")
        assert done["response"]["status"] == "completed"
        transcript = client.of("response.output_audio_transcript.done")[0]["transcript"]
        assert transcript.strip() and done["response"]["output"][0]["content"][0]["transcript"] == transcript
        started = {e["response_id"] for e in client.of("output_audio_buffer.started")}
        assert started == {done["response"]["id"]}

        # The reply played on the call's audio track: speech-loud frames, after the user's words.
        voiced = client.speaker.voiced()
        assert len(voiced) * 0.02 >= 0.5, f"{len(voiced)} voiced frames"
        assert voiced[0] > client.time_of("input_audio_buffer.speech_stopped")

        assert list(srv.server.calls.active) == [call_id] and len(srv.server.sessions) == 1
        # The microphone's frames are decoded as soon as they are whole (aiortc would hold 4, 80 ms, for a
        # playout the server does not do): its private buffer, so an aiortc upgrade that moves it fails here.
        (receiver,) = [r for r in srv.server.calls.active[call_id].pc.getReceivers() if r.track.kind == "audio"]
        assert receiver._RTCRtpReceiver__jitter_buffer._prefetch == 1
        await api.realtime.calls.hangup(call_id)
        await ended(srv.server)
        assert srv.server.counters["calls"] == 1
    finally:
        await client.close()


async def test_talking_over_the_reply_stops_its_audio_on_the_track(make_server, clip_by_name) -> None:
    """The server plays the reply on the track itself: speech over it pauses the track at once, and the
    words that follow cut the reply where it was heard (`output_audio_buffer.cleared`, `response.done`
    cancelled), with no `conversation.item.truncate` from the client."""
    srv = await make_server()
    client = RtcClient()
    try:
        answer, call_id = await asyncio.to_thread(post_offer, f"{srv.http}/v1", await client.offer())
        await client.connect(answer)
        text = "Tell me about the ocean and the animals that live in it."
        client.send({"type": "conversation.item.create", "item": _typed(text)})
        client.send({"type": "response.create"})
        async with asyncio.timeout(30):
            while not client.speaker.voiced():  # noqa: ASYNC110 (the track's frames, as they are heard)
                await asyncio.sleep(0.02)
        client.mic.say(sc.load(clip_by_name[CLIP].path), sc.RATE)  # the user talks over the reply
        await client.wait_for(lambda e: any(x["type"] == "output_audio_buffer.cleared" for x in e), 30)
        kinds = validated(client)
        assert "error" not in kinds
        first = client.of("response.created")[0]["response"]["id"]
        (cleared,) = client.of("output_audio_buffer.cleared")
        assert cleared["response_id"] == first and "output_audio_buffer.stopped" not in kinds
        done = client.of("response.done")[0]["response"]
        assert (done["status"], done["status_details"]["reason"]) == ("cancelled", "turn_detected")
        heard = done["output"][0]["content"][0]["transcript"]
        assert heard and len(heard) < 40, heard  # (the part played before the user's words came)
        # Paused as the speech began: nothing loud from half a second after its onset (for a second
        # after the cut; the next reply, to the talk-over, starts later).
        onset = client.time_of("input_audio_buffer.speech_started")
        await asyncio.sleep(1.0)
        starts = [
            t
            for e, t in zip(client.events, client.event_times, strict=True)
            if e["type"] == "output_audio_buffer.started"
        ]
        until = starts[1] if len(starts) > 1 else float("inf")
        late = [round(t - onset, 2) for t in client.speaker.voiced() if onset + 0.5 < t < until]
        assert late == [], f"loud frames this long after the talk-over began: {late}"
    finally:
        await client.close()
    await ended(srv.server)  # (the peer connection closed: the call and its session end)


def _typed(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def test_a_client_secret_places_a_call_with_its_settings(make_server) -> None:
    config = ServerConfig()
    config = dataclasses.replace(config, security=dataclasses.replace(config.security, api_key="sk-duplexd-test"))
    srv = await make_server(config)
    api = openai.AsyncOpenAI(api_key="sk-duplexd-test", base_url=f"{srv.http}/v1")
    secret = await api.realtime.client_secrets.create(
        session={"type": "realtime", "instructions": INSTRUCTIONS, "output_modalities": ["text"]},
        expires_after={"anchor": "created_at", "seconds": 60},
    )
    assert secret.value.startswith("ek_") and secret.session.instructions == INSTRUCTIONS
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(api_key="wrong", base_url=f"{srv.http}/v1").realtime.calls.create(sdp="v=0\r\n")
    browser = openai.AsyncOpenAI(api_key=secret.value, base_url=f"{srv.http}/v1")  # (all a browser holds)
    client = RtcClient()
    try:
        answer = await browser.realtime.calls.create(sdp=await client.offer())
        await client.connect(answer.text)
        await client.wait_for(lambda e: any(x["type"] == "session.created" for x in e), 10)
        session = client.of("session.created")[0]["session"]
        assert session["instructions"] == INSTRUCTIONS and session["output_modalities"] == ["text"]
        client.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello!"}]},
            }
        )
        client.send({"type": "response.create"})
        await client.wait_for(lambda e: any(x["type"] == "response.done" for x in e), 30)
        kinds = validated(client)
        assert "error" not in kinds and "response.output_text.done" in kinds
        assert client.of("response.done")[0]["response"]["status"] == "completed"
        await browser.realtime.calls.hangup(answer.response.headers["location"].rsplit("/", 1)[-1])
        await ended(srv.server)
    finally:
        await client.close()


async def test_a_call_that_cannot_be_placed_gets_a_readable_http_error(make_server) -> None:
    srv = await make_server()
    api = openai.AsyncOpenAI(api_key="not-checked", base_url=f"{srv.http}/v1")
    with pytest.raises(openai.BadRequestError, match="must start with `v=0`") as bad:
        await api.realtime.calls.create(sdp="not an offer")
    assert bad.value.code == "invalid_offer"
    with pytest.raises(openai.BadRequestError, match="no audio section") as bad:
        await api.realtime.calls.create(sdp="v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n")
    assert bad.value.code == "invalid_offer"
    with pytest.raises(openai.NotFoundError) as missing:
        await api.realtime.calls.hangup("rtc_nothing")
    assert missing.value.code == "call_not_found"
    with pytest.raises(openai.BadRequestError, match="expires_after"):
        await api.realtime.client_secrets.create(expires_after={"anchor": "created_at", "seconds": 5})
    refused = await asyncio.to_thread(_post_raw, f"{srv.http}/v1/realtime/calls", b"v=0\r\n", "text/plain")
    assert refused[0] == 415 and b"application/sdp" in refused[1]
    assert srv.server.calls.active == {} and srv.server.sessions == {}


async def test_reply_tokens_come_once_and_in_order_over_the_eloquent_channel_that_loses_half(make_server) -> None:
    """With duplexd's `eloquent` channel (unordered, no retransmissions) open, every reply token also goes
    as Eloquent packets; the client drops half of what that channel brings, and still renders every token
    once, in order, from whichever channel brought it first, and acknowledges them all."""
    srv = await make_server()
    client = RtcClient(tokens=True, drop=0.5, seed=7)
    try:
        answer, call_id = await asyncio.to_thread(post_offer, f"{srv.http}/v1", await client.offer())
        await client.connect(answer)
        client.send({"type": "conversation.item.create", "item": _typed("Tell me about the ocean and its animals.")})
        client.send({"type": "response.create"})
        await client.wait_for(lambda e: any(x["type"] == "response.done" for x in e), 30)
        kinds = validated(client)  # (`token_seq` is duplexd's field: the openai models allow it)
        assert "error" not in kinds
        deltas = client.of("response.output_audio_transcript.delta")
        assert [d["token_seq"] for d in deltas] == list(range(1, len(deltas) + 1)) and len(deltas) > 3
        assert client.text == "".join(d["delta"] for d in deltas)  # every token once, in order
        assert [r.token.seq for r in client.tokens] == list(range(1, len(deltas) + 1))
        assert 0 < client.dropped < client.eloquent_messages
        assert any(r.path == "eloquent" for r in client.tokens), [r.path for r in client.tokens]
        sender = srv.server.calls.active[call_id].conn.tokens.sender
        async with asyncio.timeout(10):  # (Eloquent repeats the unacknowledged tail until an ack comes)
            while sender.unacked:  # noqa: ASYNC110 (the server's sender state)
                await asyncio.sleep(0.05)
    finally:
        await client.close()
