"""The web client in a real headless Chromium against a real server on port 0: the browser's fake microphone
plays a real recording, the page streams it from its capture worklet, shows the live transcript, and plays
the assistant's spoken reply through its player worklet; the page throws no JavaScript error on the way.

Chromium is driven over the DevTools protocol (tests/clients/cdp.py). Needs /usr/bin/chromium
(scripts/install-test-deps) and the shared speech data; skipped with the reason otherwise."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
from cdp import CdpError, Page, launch_chromium

from duplexd.bench import scenarios as sc
from duplexd.clients.clips import Clip

pytestmark = pytest.mark.slow

CLIP = "clip09_timit_ldc93s1.wav"  # "She had your dark suit in greasy wash water all year."
MIC_RATE = 48000
SILENCE_BEFORE_S = 0.5
SILENCE_AFTER_S = 8.0  # the turn ends and the reply plays while the microphone is silent
QUIET_AFTER_S = 40.0
TRANSCRIPT_TIMEOUT_S = 60
REPLY_TIMEOUT_S = 90  # model loading and CPU-only LLM + TTS


def _mic_wav(clip_by_name: dict[str, Clip], path: Path, after_s: float) -> Path:
    """The recording as Chromium's fake microphone plays it (in a loop): 16-bit mono 48 kHz, padded with
    silence, `after_s` of it after the speech."""
    clip = clip_by_name.get(CLIP)
    if clip is None:
        pytest.skip(f"{CLIP} is not in the speech data manifest")
    audio, rate = sf.read(clip.path, dtype="float32", always_2d=True)
    speech = soxr.resample(audio.mean(axis=1), rate, MIC_RATE)
    before = np.zeros(int(SILENCE_BEFORE_S * MIC_RATE), "float32")
    after = np.zeros(int(after_s * MIC_RATE), "float32")
    sf.write(path, np.concatenate([before, speech, after]), MIC_RATE, subtype="PCM_16")
    return path


@pytest.fixture
def fake_mic_wav(clip_by_name: dict[str, Clip], tmp_path: Path) -> Path:
    return _mic_wav(clip_by_name, tmp_path / "mic.wav", SILENCE_AFTER_S)


@pytest.fixture
def quiet_mic_wav(clip_by_name: dict[str, Clip], tmp_path: Path) -> Path:
    """The recording once, then silence long enough for its reply to play out before the loop says it again."""
    return _mic_wav(clip_by_name, tmp_path / "quiet-mic.wav", QUIET_AFTER_S)


FINAL_TRANSCRIPT_JS = "[...document.querySelectorAll('#conversation p.user.final')].map(p => p.textContent).join(' ')"
# The conversation as the page shows it: [role, text] per line, in order.
CONVERSATION_JS = (
    "JSON.stringify([...document.querySelectorAll('#conversation p')]"
    ".map(p => [p.classList.contains('user') ? 'user' : 'assistant', p.textContent]))"
)

# A complete reply with text in #reply, whose audio the player worklet has played to the end.
REPLY_PLAYED_JS = """(() => {
  const d = window.duplexd;
  const reply = d.replies.find(r => r.done && r.text.trim() && r.audioFramesReceived > 0);
  const receivedMs = d.replies.reduce((sum, r) => sum + r.audioMsReceived, 0);
  const text = [...document.querySelectorAll('#conversation p.assistant')].map(p => p.textContent).join(' ').trim();
  return reply && text && d.playedMs > 0 && d.playedMs >= receivedMs - 0.01 ? reply : null;
})()"""

# Over a call: a complete reply with text, whose audio the call's track played (loud, then its buffer stopped).
CALL_REPLY_PLAYED_JS = (
    "(d => d.replies.find(r => r.done && r.text.trim()) && d.rtc.bufferEvents.includes('stopped')"
    " && d.rtc.loudSince !== null ? d : null)(window.duplexd)"
)


async def _snapshot(page: Page) -> str:
    """The page's state for a failure message."""
    try:
        state = await page.evaluate(
            "JSON.stringify({status: document.querySelector('#status').textContent, duplexd: window.duplexd})"
        )
    except (CdpError, TimeoutError) as exc:
        state = f"(page state unavailable: {exc})"
    return f"{state}\nproblems: {page.problems}\nconsole: {page.console[-20:]}"


async def _wait(page: Page, expression: str, timeout_s: float, what: str) -> object:
    try:
        return await page.wait_for(expression, timeout_s=timeout_s)
    except TimeoutError:
        pytest.fail(f"{what} within {timeout_s} s\n{await _snapshot(page)}")


@pytest.fixture
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium", path="/usr/bin")
    if path is None:
        pytest.skip("chromium is not installed (scripts/install-test-deps installs Debian's chromium)")
    return path


async def _start(page: Page, url: str, what: str) -> None:
    """Open the page at `url`, wait until it has reached the server's /healthz, press Start, wait until live
    (`what`: the failure message)."""
    await page.navigate(url)
    await _wait(
        page,
        "window.duplexd && /Press Start/.test(document.querySelector('#status').textContent)",
        20,
        "the page did not load or did not reach the server's /healthz",
    )
    await page.evaluate("document.querySelector('#start').click()", user_gesture=True)
    await _wait(page, "window.duplexd.state === 'live'", 30, what)


async def _stop(page: Page, what: str) -> tuple[dict, list]:
    """Press Stop, wait until the session has ended (`what`: the failure message); the page's final state and
    the JavaScript problems it reported."""
    await page.evaluate("document.querySelector('#stop').click()", user_gesture=True)
    await _wait(page, "window.duplexd.state === 'ended'", 30, what)
    return json.loads(await page.evaluate("JSON.stringify(window.duplexd)")), list(page.problems)


async def test_voice_conversation_in_chromium(make_server, chromium: str, fake_mic_wav: Path, tmp_path: Path) -> None:
    srv = await make_server()
    async with launch_chromium(chromium, tmp_path, fake_mic_wav) as page:
        await _start(page, srv.http + "/?transport=websocket", "the session did not start")

        # The live transcript: a final line with the clip's words (Whisper tiny may miss one of them).
        await _wait(
            page,
            f"/dark suit|greasy/i.test({FINAL_TRANSCRIPT_JS})",
            TRANSCRIPT_TIMEOUT_S,
            "no final transcript with 'dark suit' or 'greasy' in #transcript",
        )

        # The conversation: the assistant answered, and its audio came out of the player worklet.
        if not await page.evaluate("window.duplexd.dialog"):
            pytest.fail(
                f"the server did not start a spoken conversation (session.started.dialog is not true)\n"
                f"{await _snapshot(page)}"
            )
        reply = await _wait(page, REPLY_PLAYED_JS, REPLY_TIMEOUT_S, "no reply played")
        await _wait(page, "window.duplexd.activity === 'listening'", 10, "the page did not go back to listening")

        # Settings (text-only replies: session.update), then a typed turn (user.text).
        typed = await _typed_turn_without_voice(page)

        state, problems = await _stop(page, "the session did not end cleanly")

    assert state["closeCode"] == 1000
    assert state["framesSent"] > 100 and state["lastLagMs"] is not None, state
    assert any("dark suit" in t.lower() or "greasy" in t.lower() for t in state["transcriptFinal"]), state
    assert isinstance(reply, dict) and reply["text"].strip(), reply
    # Every sample the server said it sent (reply.done.audio_ms) arrived, and the player played them all.
    assert reply["audioMsReceived"] == pytest.approx(reply["audioMs"], abs=0.1), reply
    assert state["playedMs"] == pytest.approx(sum(r["audioMsReceived"] for r in state["replies"]), abs=0.1), state
    assert state["playedMs"] > 0 and state["eosToFirstAudioMs"] and state["eosToFirstTextMs"], state
    assert state["errors"] == [], state["errors"]
    assert problems == [], problems
    _assert_typed_turn(state, typed)
    assert state["transport"] == "websocket" and state["fallback"] is None, state
    assert typed["state"]["replies"][-1]["audioFramesReceived"] == 0, typed["state"]["replies"]


async def _typed_turn_without_voice(page: Page) -> dict:
    """Spoken replies off and a system prompt (Settings, Apply), then a question typed in the text box: its
    reply comes as text only. Returns the page's state and conversation."""
    await page.evaluate(
        "document.querySelector('#voice').checked = false;"
        f"document.querySelector('#instructions').value = {json.dumps(PROMPT)};"
        "document.querySelector('#apply').click()",
        user_gesture=True,
    )
    await _wait(
        page,
        f"(s => s && s.voice === false && s.instructions === {json.dumps(PROMPT)})(window.duplexd.settings)",
        10,
        "the settings were not applied",
    )
    await page.evaluate(
        f"document.querySelector('#sayText').value = {json.dumps(TYPED)}; document.querySelector('#send').click()",
        user_gesture=True,
    )
    await _wait(
        page,
        "(d => d.replies.length >= 2 && d.replies.at(-1).done && d.activity === 'listening')(window.duplexd)",
        REPLY_TIMEOUT_S,
        "the typed turn was not answered",
    )
    return {
        "state": json.loads(await page.evaluate("JSON.stringify(window.duplexd)")),
        "conversation": json.loads(await page.evaluate(CONVERSATION_JS)),
        "history_rows": await page.evaluate("document.querySelectorAll('#history tbody tr').length"),
        "level": await page.evaluate("document.querySelector('#level').value"),
    }


def _assert_typed_turn(state: dict, typed: dict) -> None:
    """The typed turn shows in the conversation, after the spoken one and its reply, and is answered in
    text; the latency history has a row for each turn; the microphone's level was seen on the meter."""
    conversation = typed["conversation"]
    roles = [role for role, _ in conversation]
    assert roles[0] == "user" and "assistant" in roles[1:-2], conversation
    assert conversation[-2] == ["user", TYPED] and roles[-1] == "assistant", conversation
    assert conversation[-1][1].strip(), conversation
    answer = typed["state"]["replies"][-1]
    assert answer["text"].strip() and not answer["interrupted"], answer
    assert state["typed"] == [TYPED] and state["mics"] >= 1 and state["micLevel"] > 0.3, state
    history = typed["state"]["history"]
    assert len(history) == typed["history_rows"] >= 2, history
    spoken, written = history[0], history[-1]
    assert spoken["totalMs"] > 0 and spoken["waitMs"] >= 0 and spoken["replyMs"] >= 0, history
    assert written["totalMs"] is None and written["replyMs"] is not None, history  # (text only: no audio)


PROMPT = "You are a helpful pirate. Answer in one short sentence."
TYPED = "What is the capital of France?"
STORYTELLER = sc.storyteller(max_reply_tokens=40, speed=0.7)  # (~12 s of speech: time to drop and resume)


async def test_the_page_resumes_the_session_when_its_connection_drops(
    make_server, chromium: str, fake_mic_wav: Path, tmp_path: Path
) -> None:
    srv = await make_server(STORYTELLER)
    async with launch_chromium(chromium, tmp_path, fake_mic_wav) as page:
        await _start(page, srv.http + "/?transport=websocket", "the session did not start")
        # Mid-reply (text shown, audio playing), the network drops: the TCP connection dies without a close.
        await _wait(
            page,
            "(r => r && r.streamedText.length > 10 && r.audioFramesReceived > 5 && !r.done)(window.duplexd.replies[0])",
            REPLY_TIMEOUT_S,
            "no reply in progress",
        )
        (handle,) = srv.server.handles.values()
        assert handle.link is not None
        handle.link.abort()  # (the socket dies: no closing handshake)
        await _wait(page, "window.duplexd.resumes === 1 && window.duplexd.state === 'live'", 30, "no resume")
        reply = await _wait(page, REPLY_PLAYED_JS, REPLY_TIMEOUT_S, "the reply did not finish after the resume")
        state, problems = await _stop(page, "the session did not end cleanly")

    assert srv.server.counters["resumed"] == 1 and state["closeCode"] == 1000
    # The text streamed token by token across the drop is the whole reply, nothing lost or shown twice ...
    assert isinstance(reply, dict) and reply["streamedText"] == reply["text"] and reply["text"].strip(), reply
    # ... and every sample of its audio arrived exactly once, and was played.
    assert reply["audioMsReceived"] == pytest.approx(reply["audioMs"], abs=0.1), reply
    assert state["errors"] == [], state["errors"]
    assert problems == [], problems


BACKCHANNELS_AFTER_EOS_S = (5.0, 9.0, 13.0)  # while a storyteller's reply (~18 s) plays, whenever it began


@pytest.fixture
def mic_with_backchannels(clip_by_name: dict[str, Clip], tmp_path: Path) -> Path:
    """The question, then "Okay, okay." (a real meeting recording) three times while the reply plays."""
    clip = clip_by_name.get(CLIP)
    if clip is None:
        pytest.skip(f"{CLIP} is not in the speech data manifest")
    question = np.concatenate([sc.silence(SILENCE_BEFORE_S), sc.load(clip.path)]).astype(np.float32)
    eos = len(question)
    audio = np.zeros(eos + round((BACKCHANNELS_AFTER_EOS_S[-1] + 10) * sc.RATE), np.float32)
    audio[:eos] = question
    okay = sc.backchannel(clip.path.parent).astype(np.float32)
    for at_s in BACKCHANNELS_AFTER_EOS_S:
        i = eos + round(at_s * sc.RATE)
        audio[i : i + len(okay)] += okay
    path = tmp_path / "mic.wav"
    sf.write(path, soxr.resample(audio / 32768, sc.RATE, MIC_RATE), MIC_RATE, subtype="PCM_16")
    return path


async def test_a_backchannel_pauses_the_reply_in_the_page_and_it_plays_on(
    make_server, chromium: str, mic_with_backchannels: Path, tmp_path: Path
) -> None:
    """Speech over the reply pauses the page's player at once (`reply.paused`); "okay, okay" is no
    interruption, so the reply resumes (`reply.resumed`) and plays to its end, every sample of it."""
    srv = await make_server(sc.storyteller(max_reply_tokens=60, speed=0.7))
    async with launch_chromium(chromium, tmp_path, mic_with_backchannels) as page:
        await _start(page, srv.http + "/?transport=websocket", "the session did not start")
        await _wait(page, "window.duplexd.replyPauses.length > 0", REPLY_TIMEOUT_S, "the backchannel paused nothing")
        # Paused: the player holds (what it has played does not move) until the reply resumes.
        held_at = await page.evaluate("window.duplexd.playedMs")
        await asyncio.sleep(0.3)
        still = await page.evaluate("window.duplexd.replyResumes.length === 0 ? window.duplexd.playedMs : null")
        await _wait(page, "window.duplexd.replyResumes.length > 0", 30, "the paused reply did not resume")
        reply = await _wait(page, REPLY_PLAYED_JS, REPLY_TIMEOUT_S, "the resumed reply did not play to its end")
        state, problems = await _stop(page, "the session did not end cleanly")

    if still is not None:  # (not resumed within those 0.3 s)
        assert still == pytest.approx(held_at, abs=1.0), (held_at, still)
    first = state["replies"][0]
    assert not first["interrupted"] and first["done"], first
    assert len(state["replyResumes"]) == len(state["replyPauses"]) >= 1, state
    assert {p["reply"] for p in state["replyPauses"]} == {first["reply"]}, state
    assert isinstance(reply, dict) and reply["audioMsReceived"] == pytest.approx(reply["audioMs"], abs=0.1), reply
    assert state["playedMs"] == pytest.approx(sum(r["audioMsReceived"] for r in state["replies"]), abs=0.1), state
    assert state["errors"] == [], state["errors"]
    assert problems == [], problems


async def test_a_spoken_turn_over_webrtc_in_chromium(
    make_server, chromium: str, fake_mic_wav: Path, tmp_path: Path
) -> None:
    """The page's default, WebRTC, against the server's `/v1/realtime/calls`: Chromium's own WebRTC stack (its
    audio processing, Opus, ICE, SCTP) places the call; the transcript and the reply's text arrive on the
    `oai-events` channel, and the reply's audio on the call's track (its energy measured by the page). The
    reply's tokens also come on the `eloquent` channel, of which the page drops half (`?drop=0.5`): it still
    shows every token once, in order. Then the settings and a typed turn, as Realtime events."""
    srv = await make_server()
    async with launch_chromium(chromium, tmp_path, fake_mic_wav) as page:
        await _start(page, srv.http + "/?drop=0.5", "the call did not start")
        await _wait(
            page,
            f"/dark suit|greasy/i.test({FINAL_TRANSCRIPT_JS})",
            TRANSCRIPT_TIMEOUT_S,
            "no final transcript with 'dark suit' or 'greasy' in #transcript",
        )
        reply = await _wait(
            page,
            CALL_REPLY_PLAYED_JS,
            REPLY_TIMEOUT_S,
            "no reply played over the call",
        )
        assert srv.server.counters["calls"] == 1 and len(srv.server.calls.active) == 1
        await _wait(page, "window.duplexd.activity === 'listening'", 10, "the page did not go back to listening")
        typed = await _typed_turn_without_voice(page)
        state, problems = await _stop(page, "the call did not end cleanly")

    assert isinstance(reply, dict)
    assert state["transport"] == "webrtc" and state["closeCode"] == 1000 and state["callId"], state
    assert any("dark suit" in t.lower() or "greasy" in t.lower() for t in state["transcriptFinal"]), state
    assert state["replies"][0]["text"].strip() and state["rtc"]["bufferEvents"][:1] == ["started"], state
    # Every token once, in order, whichever channel brought it; some came first on the lossy one.
    rtc = state["rtc"]
    assert [seq for seq, _ in rtc["tokens"]] == list(range(1, len(rtc["tokens"]) + 1)) and rtc["tokens"], rtc
    paths = [path for _, path in rtc["tokens"]]
    assert set(paths) <= {"eloquent", "events"} and "eloquent" in paths, paths
    assert 0 < rtc["eloquentDropped"] < rtc["eloquentMessages"], rtc
    done = [r for r in state["replies"] if r["done"] and not r["interrupted"]]
    assert done and all(r["streamedText"] == r["text"] for r in done), state["replies"]
    # The reply's audio reached the page: Chromium decoded samples with energy in them (inbound-rtp stats).
    assert state["rtc"]["audioEnergy"] > 1e-3 and state["rtc"]["samplesReceived"] > 48_000, state["rtc"]
    assert state["eosToFirstTextMs"] and state["eosToFirstAudioMs"], state
    assert state["errors"] == [], state["errors"]
    assert problems == [], problems
    await asyncio.sleep(0.5)
    assert srv.server.calls.active == {} and srv.server.sessions == {}  # (the hangup ended the call)
    _assert_typed_turn(state, typed)
    assert state["fallback"] is None and typed["state"]["rtc"]["bufferEvents"].count("started") == 1, state


async def test_the_page_falls_back_to_the_websocket_without_webrtc(
    make_server, chromium: str, fake_mic_wav: Path, tmp_path: Path
) -> None:
    """A browser without WebRTC (RTCPeerConnection removed before the page loads): Start talks over the
    WebSocket instead, and says so."""
    srv = await make_server()
    async with launch_chromium(chromium, tmp_path, fake_mic_wav) as page:
        await page.send("Page.addScriptToEvaluateOnNewDocument", {"source": "delete window.RTCPeerConnection;"})
        await _start(page, srv.http + "/", "the session did not start")
        status = await page.evaluate("document.querySelector('#status').textContent")
        await _wait(
            page, f"/dark suit|greasy/i.test({FINAL_TRANSCRIPT_JS})", TRANSCRIPT_TIMEOUT_S, "no final transcript"
        )
        state, problems = await _stop(page, "the session did not end cleanly")

    assert state["transport"] == "websocket" and "not available" in state["fallback"], state
    assert "WebSocket" in status and state["framesSent"] > 50, status
    assert srv.server.counters["calls"] == 0 and state["errors"] == [], state
    assert [p for p in problems if "WebRTC" not in p] == [], problems


async def test_the_microphone_picker_moves_the_call_to_another_device(
    make_server, chromium: str, quiet_mic_wav: Path, tmp_path: Path
) -> None:
    """Chromium's fake microphones, several of them: the picker lists them, and choosing another during the
    call replaces the call's microphone track (`RTCRtpSender.replaceTrack`); the new device plays the
    recording again from its start, and the server hears it as a second question. (Chosen once the first
    reply has played: said over a reply that quotes it, the question would be that reply's echo by its text,
    and not a turn.)"""
    srv = await make_server()
    heard = "window.duplexd.transcriptFinal.filter(t => /dark suit|greasy/i.test(t)).length"
    async with launch_chromium(chromium, tmp_path, quiet_mic_wav) as page:
        await _start(page, srv.http + "/", "the call did not start")
        await _wait(page, f"{heard} >= 1", TRANSCRIPT_TIMEOUT_S, "no final transcript")
        await _wait(page, CALL_REPLY_PLAYED_JS, REPLY_TIMEOUT_S, "no reply played over the call")
        await _wait(page, "window.duplexd.activity === 'listening'", 10, "the page did not go back to listening")
        mics = await page.evaluate("window.duplexd.mics")
        assert mics >= 2, f"Chromium listed {mics} fake microphone(s)"
        before = await page.evaluate(heard)
        chosen = await page.evaluate(
            "(s => { s.value = s.options[s.options.length - 1].value; s.dispatchEvent(new Event('change'));"
            " return s.value; })(document.querySelector('#mic'))"
        )
        await _wait(page, f"{heard} > {before}", TRANSCRIPT_TIMEOUT_S, "the other microphone was not heard")
        kept = await page.evaluate("localStorage.getItem('duplexd.mic')")
        state, problems = await _stop(page, "the call did not end cleanly")

    assert chosen and kept == chosen, (chosen, kept)
    assert state["transport"] == "webrtc" and srv.server.counters["calls"] == 1, state
    assert state["errors"] == [], state["errors"]
    assert problems == [], problems
