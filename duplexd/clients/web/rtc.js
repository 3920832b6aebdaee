// duplexd browser voice client over WebRTC (docs/protocol.md, "WebRTC calls"), beside app.js's WebSocket one.
//
// The microphone is a WebRTC audio track (the browser's echo canceller, noise suppression and gain control;
// Opus); the reply is the call's remote audio track, played by an <audio> element with the browser's jitter
// buffer. The JSON events of /v1/realtime come and go on the `oai-events` data channel. The call is placed
// as OpenAI's WebRTC guide places it: the SDP offer POSTed to /v1/realtime/calls, the answer in the body.
// Uses app.js's page helpers (ui, pub, setState, setStatus, fail, openMic, checkHealth, renderLatency, ...).
"use strict";

const RTC_STATS_MS = 250; // how often the received reply audio is measured (getStats)
const RTC_GATHER_MS = 5000; // ICE gathering (host candidates) before the offer goes out anyway

function transport() {
  const asked = new URLSearchParams(location.search).get("transport");
  return asked === "webrtc" || $("transport")?.value === "webrtc" ? "webrtc" : "websocket";
}

function callsUrl(path = "") {
  return `${location.protocol}//${location.host}/v1/realtime/calls${path}`;
}

function authHeaders() {
  const token = new URLSearchParams(location.search).get("token");
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function startRtc() {
  if (session) return;
  ui.start.disabled = true;
  setState("starting");
  Object.assign(pub, {
    transport: "webrtc", sessionId: null, dialog: null, transcriptFinal: [], replies: [], playedMs: 0,
    eosToFirstAudioMs: [], eosToFirstTextMs: [], errors: [], closeCode: null, callId: null,
    rtc: { audioEnergy: 0, samplesReceived: 0, loudSince: null, bufferEvents: [] },
  });
  ui.transcript.replaceChildren();
  ui.reply.replaceChildren();
  renderLatency();
  if (!navigator.mediaDevices?.getUserMedia || !window.RTCPeerConnection) {
    return abortStart("WebRTC and the microphone need a browser that has them, on a secure page.");
  }
  if (!(await checkHealth())) return abortStart("The server is unreachable.", "unreachable");
  const mic = await openMic();
  if (!mic) return;
  const pc = new RTCPeerConnection({ iceServers: [] }); // host candidates: the server has no STUN or TURN
  const s = {
    rtc: true, pc, mic, ending: false, started: false, channel: null, audio: new Audio(), statsTimer: null,
    current: null, replyEls: new Map(), userEl: null, speechStoppedAt: null, responseAt: null,
  };
  session = s;
  s.audio.autoplay = true;
  mic.getTracks().forEach((t) => pc.addTrack(t, mic));
  pc.ontrack = (e) => {
    s.audio.srcObject = e.streams[0] ?? new MediaStream([e.track]);
  };
  pc.onconnectionstatechange = () => {
    if (["failed", "closed"].includes(pc.connectionState) && !s.ending) endRtc(s, `connection ${pc.connectionState}`);
  };
  s.channel = pc.createDataChannel("oai-events");
  s.channel.onmessage = (m) => onRtcEvent(s, JSON.parse(m.data));
  s.channel.onclose = () => {
    if (!s.ending) endRtc(s, "the events channel closed");
  };
  setState("connecting");
  setStatus("Placing the call…");
  try {
    await pc.setLocalDescription(await pc.createOffer());
    await gathered(pc);
    const r = await fetch(callsUrl(), {
      method: "POST",
      headers: { "Content-Type": "application/sdp", ...authHeaders() },
      body: pc.localDescription.sdp,
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error(body.error?.message ?? `HTTP ${r.status}`);
    }
    pub.callId = (r.headers.get("Location") ?? "").split("/").pop() || null;
    await pc.setRemoteDescription({ type: "answer", sdp: await r.text() });
  } catch (e) {
    teardownRtc(s);
    return abortStart(`The call could not be placed: ${e.message}`, "call_refused");
  }
  s.statsTimer = setInterval(() => measureRtc(s), RTC_STATS_MS);
  ui.stop.disabled = false;
}

// The answer carries every candidate the server has: send the offer with all of ours too (no trickle ICE).
function gathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      if (pc.iceGatheringState === "complete") resolve();
    };
    pc.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, RTC_GATHER_MS);
  });
}

// The reply audio the page received and played: the inbound track's energy and samples (getStats).
async function measureRtc(s) {
  if (s.ending) return;
  const stats = await s.pc.getStats();
  stats.forEach((r) => {
    if (r.type !== "inbound-rtp" || r.kind !== "audio") return;
    const loud = (r.totalAudioEnergy ?? 0) > pub.rtc.audioEnergy + 1e-4;
    pub.rtc.audioEnergy = r.totalAudioEnergy ?? 0;
    pub.rtc.samplesReceived = r.totalSamplesReceived ?? 0;
    if (loud && s.responseAt !== null && pub.rtc.loudSince === null) {
      pub.rtc.loudSince = performance.now();
      if (s.speechStoppedAt !== null) pub.eosToFirstAudioMs.push(Math.round(pub.rtc.loudSince - s.speechStoppedAt));
      renderLatency();
    }
  });
}

function onRtcEvent(s, ev) {
  switch (ev.type) {
    case "session.created":
      s.started = true;
      pub.sessionId = ev.session.id;
      pub.dialog = true;
      setState("live");
      setStatus("Listening. Speak, and the assistant answers.");
      break;
    case "input_audio_buffer.speech_started":
      document.body.classList.add("hearing");
      break;
    case "input_audio_buffer.speech_stopped":
      document.body.classList.remove("hearing");
      s.speechStoppedAt = performance.now();
      break;
    case "conversation.item.input_audio_transcription.delta":
      userLine(s).textContent += ev.delta;
      break;
    case "conversation.item.input_audio_transcription.completed": {
      const el = userLine(s);
      el.className = "final";
      el.textContent = ev.transcript;
      pub.transcriptFinal.push(ev.transcript);
      s.userEl = null;
      break;
    }
    case "response.created": {
      const reply = { reply: ev.response.id, text: "", done: false, interrupted: false, heardText: null };
      pub.replies.push(reply);
      s.current = reply;
      s.responseAt = performance.now();
      pub.rtc.loudSince = null;
      const el = document.createElement("p");
      el.className = "reply";
      ui.reply.appendChild(el);
      s.replyEls.set(reply.reply, el);
      ui.interrupt.disabled = false;
      break;
    }
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta": {
      const reply = pub.replies.findLast((r) => r.reply === ev.response_id);
      if (!reply) break;
      if (!reply.text && s.speechStoppedAt !== null) pub.eosToFirstTextMs.push(Math.round(performance.now() - s.speechStoppedAt));
      reply.text += ev.delta;
      s.replyEls.get(reply.reply).textContent = reply.text;
      renderLatency();
      break;
    }
    case "response.done": {
      const reply = pub.replies.findLast((r) => r.reply === ev.response.id);
      if (!reply) break;
      const heard = ev.response.output?.[0]?.content?.[0]?.transcript ?? reply.text;
      reply.done = true;
      if (ev.response.status === "cancelled") {
        markInterrupted(s, reply, heard); // (what was heard, then the rest struck through)
      } else {
        reply.text = heard;
        s.replyEls.get(reply.reply).textContent = heard;
      }
      break;
    }
    case "output_audio_buffer.started":
    case "output_audio_buffer.stopped":
    case "output_audio_buffer.cleared":
      pub.rtc.bufferEvents.push(ev.type.split(".")[1]);
      if (ev.type !== "output_audio_buffer.started" && s.current?.reply === ev.response_id) {
        s.current = null;
        ui.interrupt.disabled = true;
      }
      break;
    case "error":
      pub.errors.push({ code: ev.error?.code, message: ev.error?.message });
      setStatus(`Server error (${ev.error?.code}): ${ev.error?.message}`, true);
      console.error(`duplexd server error ${ev.error?.code}: ${ev.error?.message}`);
      break;
    default:
      break;
  }
}

function userLine(s) {
  if (!s.userEl) {
    s.userEl = document.createElement("p");
    s.userEl.className = "partial";
    ui.transcript.appendChild(s.userEl);
  }
  return s.userEl;
}

function interruptRtc() {
  const s = session;
  if (!s?.rtc || !s.current || s.channel?.readyState !== "open") return;
  s.channel.send(JSON.stringify({ type: "output_audio_buffer.clear" })); // stops the reply and its audio
}

async function stopRtc() {
  const s = session;
  if (!s?.rtc || s.ending) return;
  s.ending = true;
  setState("ending");
  ui.stop.disabled = true;
  ui.interrupt.disabled = true;
  if (pub.callId) {
    await fetch(callsUrl(`/${pub.callId}/hangup`), { method: "POST", headers: authHeaders() }).catch(() => null);
  }
  endRtc(s, null);
}

function endRtc(s, why) {
  teardownRtc(s);
  pub.closeCode = why ? 1006 : 1000;
  setState(why ? "error" : "ended");
  if (why) fail(`The call ended: ${why}.`, "call_ended");
  else setStatus("Call ended.");
}

function teardownRtc(s) {
  s.ending = true;
  clearInterval(s.statsTimer);
  s.mic.getTracks().forEach((t) => t.stop());
  s.pc.close();
  s.audio.srcObject = null;
  session = null;
  ui.start.disabled = false;
  ui.stop.disabled = true;
  ui.interrupt.disabled = true;
}

ui.start.onclick = () => (transport() === "webrtc" ? startRtc() : start());
ui.stop.onclick = () => (session?.rtc ? stopRtc() : stop());
ui.interrupt.onclick = () => (session?.rtc ? interruptRtc() : interrupt());
if ($("transport") && new URLSearchParams(location.search).get("transport") === "webrtc") $("transport").value = "webrtc";
