// duplexd browser voice client over WebRTC (docs/protocol.md, "WebRTC calls"), beside app.js's WebSocket one.
//
// The microphone is a WebRTC audio track (the browser's echo canceller, noise suppression and gain control;
// Opus); the reply is the call's remote audio track, played by an <audio> element with the browser's jitter
// buffer. The JSON events of /v1/realtime come and go on the `oai-events` data channel. The call is placed
// as OpenAI's WebRTC guide places it: the SDP offer POSTed to /v1/realtime/calls, the answer in the body.
// Uses app.js's page helpers (ui, pub, setState, setActivity, setStatus, fail, openMic, startMeter, addLine,
// mark, checkHealth, ...). The page's default: when the browser has no WebRTC, or the call is refused for a
// reason other than the server's (auth, full) or does not connect, the page falls back to app.js's WebSocket.
//
// Reply tokens also come on duplexd's `eloquent` channel (unordered, no retransmissions) as Eloquent
// packets, each carrying the tokens not yet acknowledged (transport/packetizer.py); the events channel's
// transcript deltas carry the same `token_seq`. The page shows each token once, in order, from whichever channel brings it first, and
// acknowledges on the `eloquent` channel. `?drop=0.3` discards that share of its packets on arrival (a test
// of the merge, as a lossy network would).
"use strict";

const RTC_STATS_MS = 250; // how often the received reply audio is measured (getStats)
const RTC_GATHER_MS = 5000; // ICE gathering (host candidates) before the offer goes out anyway
const TOKENS_WINDOW = 1024; // tokens held past a gap (as the server's sender keeps at most this many)
const RTC_CONNECT_MS = 10000; // a call that has not connected (session.created) by then falls back
const LOUD_WITHIN_MS = 3000; // end of speech: the microphone's last loud moment, if this recent

// `?transport=` forces one (no fallback); else the switch, WebRTC by default.
function forcedTransport() {
  const asked = new URLSearchParams(location.search).get("transport");
  return ["webrtc", "websocket"].includes(asked) ? asked : null;
}

function transport() {
  return forcedTransport() ?? ui.transport.value;
}

// WebRTC could not carry the call (`why`): the same conversation over the WebSocket, unless forced.
function fallBack(why) {
  pub.fallback = why;
  ui.transport.value = "websocket";
  console.warn(`duplexd: WebRTC: ${why}; using the WebSocket`);
  return start(); // (its status says so once it listens)
}

function placeCall() {
  pub.fallback = null;
  if (transport() === "websocket") return start();
  if (!window.RTCPeerConnection) {
    if (forcedTransport()) return abortStart("This browser has no WebRTC.", "no_webrtc");
    return fallBack("is not available in this browser");
  }
  return startRtc();
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
  resetPage("webrtc");
  Object.assign(pub, {
    callId: null,
    rtc: {
      audioEnergy: 0, samplesReceived: 0, loudSince: null, bufferEvents: [],
      tokens: [], eloquentMessages: 0, eloquentDropped: 0, // tokens: [seq, "eloquent" | "events"], in order
    },
  });
  if (!navigator.mediaDevices?.getUserMedia) {
    return abortStart("The microphone needs a secure page (https, or http on localhost).");
  }
  if (!(await checkHealth())) return abortStart("The server is unreachable.", "unreachable");
  const mic = await openMic();
  if (!mic) return;
  const pc = new RTCPeerConnection({ iceServers: [] }); // host candidates: the server has no STUN or TURN
  const s = {
    rtc: true, pc, mic, ending: false, started: false, channel: null, audio: new Audio(), statsTimer: null,
    current: null, replyEls: new Map(), userEl: null, speechStoppedAt: null, responseAt: null,
    tokens: null, contiguous: 0, highestPacket: 0, held: new Map(), ready: [],
    drop: Number(new URLSearchParams(location.search).get("drop") ?? 0),
    meter: startMeter(mic, null), typedAt: null, speaking: false, defaultInstructions: null, connectTimer: null,
  };
  session = s;
  s.audio.autoplay = true;
  mic.getTracks().forEach((t) => pc.addTrack(t, mic));
  pc.ontrack = (e) => {
    s.audio.srcObject = e.streams[0] ?? new MediaStream([e.track]);
  };
  pc.onconnectionstatechange = () => {
    if (!["failed", "closed"].includes(pc.connectionState) || s.ending) return;
    if (!s.started && !forcedTransport()) {
      teardownRtc(s);
      return fallBack(`did not connect (${pc.connectionState})`);
    }
    endRtc(s, `connection ${pc.connectionState}`);
  };
  s.channel = pc.createDataChannel("oai-events");
  s.channel.onmessage = (m) => onRtcEvent(s, JSON.parse(m.data));
  s.channel.onclose = () => {
    if (!s.ending) endRtc(s, "the events channel closed");
  };
  s.tokens = pc.createDataChannel("eloquent", { ordered: false, maxRetransmits: 0 });
  s.tokens.binaryType = "arraybuffer";
  s.tokens.onmessage = (m) => onTokens(s, m.data);
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
      const e = new Error(body.error?.message ?? `HTTP ${r.status}`);
      e.status = r.status;
      throw e;
    }
    pub.callId = (r.headers.get("Location") ?? "").split("/").pop() || null;
    await pc.setRemoteDescription({ type: "answer", sdp: await r.text() });
  } catch (e) {
    teardownRtc(s);
    // The server's own refusals (a key, a full server, too many calls) would refuse a WebSocket too.
    if (forcedTransport() || [401, 403, 429, 503].includes(e.status)) {
      return abortStart(`The call could not be placed: ${e.message}`, "call_refused");
    }
    return fallBack(`could not place the call (${e.message})`);
  }
  s.connectTimer = setTimeout(() => {
    if (s.started || s.ending) return;
    teardownRtc(s);
    if (forcedTransport()) return abortStart("The call did not connect.", "call_failed");
    fallBack(`did not connect within ${RTC_CONNECT_MS / 1000} s`);
  }, RTC_CONNECT_MS);
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
    if (loud && s.responseAt !== null && pub.rtc.loudSince === null && s.current) {
      pub.rtc.loudSince = performance.now();
      mark(s.current.reply, "audio", pub.rtc.loudSince);
    }
  });
}

function onRtcEvent(s, ev) {
  switch (ev.type) {
    case "session.created":
      s.started = true;
      clearTimeout(s.connectTimer);
      pub.sessionId = ev.session.id;
      pub.dialog = true;
      s.defaultInstructions = ev.session.instructions ?? null;
      ui.instructions.placeholder = ev.session.instructions ?? ui.instructions.placeholder;
      onRtcSettings(ev.session);
      sendSettings(s);
      setState("live");
      setActivity("listening");
      setStatus("Listening. Speak, and the assistant answers.");
      break;
    case "session.updated":
      onRtcSettings(ev.session);
      break;
    case "input_audio_buffer.speech_started":
      document.body.classList.add("hearing");
      break;
    case "input_audio_buffer.speech_stopped": {
      document.body.classList.remove("hearing");
      // End of speech on the page's clock: the microphone's last loud moment (the event itself comes after
      // the server's VAD has heard enough silence).
      const now = performance.now();
      const loud = s.meter?.lastLoudAt;
      s.speechStoppedAt = loud !== null && loud !== undefined && now - loud < LOUD_WITHIN_MS ? loud : now;
      break;
    }
    case "input_audio_buffer.committed":
      setActivity("thinking");
      break;
    case "conversation.item.input_audio_transcription.delta":
      userLine(s).textContent += ev.delta;
      break;
    case "conversation.item.input_audio_transcription.completed": {
      const el = userLine(s);
      el.className = "user final";
      el.textContent = ev.transcript;
      if (!ev.transcript.trim()) el.remove();
      else pub.transcriptFinal.push(ev.transcript);
      s.userEl = null;
      break;
    }
    case "response.created": {
      const reply = { reply: ev.response.id, text: "", streamedText: "", done: false, interrupted: false, heardText: null };
      pub.replies.push(reply);
      s.current = reply;
      s.responseAt = performance.now();
      pub.rtc.loudSince = null;
      const eos = s.typedAt ?? s.speechStoppedAt;
      if (eos !== null) mark(reply.reply, "eos", eos);
      mark(reply.reply, "end", s.responseAt);
      s.typedAt = null;
      s.speechStoppedAt = null;
      s.replyEls.set(reply.reply, addLine("assistant"));
      setActivity("thinking");
      ui.interrupt.disabled = false;
      renderTokens(s); // (tokens of this reply the eloquent channel brought before the event)
      break;
    }
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      if (typeof ev.token_seq === "number") {
        holdToken(s, ev.token_seq, ev.delta, "events");
        renderTokens(s);
      } else {
        showToken(s, ev.delta);
      }
      break;
    case "response.done": {
      const reply = pub.replies.findLast((r) => r.reply === ev.response.id);
      if (!reply) break;
      const heard = ev.response.output?.[0]?.content?.[0]?.transcript ?? ev.response.output?.[0]?.content?.[0]?.text ?? reply.text;
      reply.done = true;
      if (ev.response.status === "cancelled") {
        markInterrupted(s, reply, heard); // (what was heard, then the rest struck through)
      } else {
        reply.text = heard;
        s.replyEls.get(reply.reply).textContent = heard;
      }
      if (!s.speaking && s.current === reply) {
        s.current = null; // (text only, or cut before its audio began)
        ui.interrupt.disabled = true;
        if (s.typedAt === null) setActivity("listening");
      }
      break;
    }
    case "output_audio_buffer.started":
      pub.rtc.bufferEvents.push("started");
      s.speaking = true;
      setActivity("speaking");
      break;
    case "output_audio_buffer.stopped":
    case "output_audio_buffer.cleared":
      pub.rtc.bufferEvents.push(ev.type.split(".")[1]);
      s.speaking = false;
      if (s.current?.reply === ev.response_id) {
        s.current = null;
        ui.interrupt.disabled = true;
      }
      if (s.typedAt === null) setActivity("listening");
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

function onRtcSettings(session) {
  pub.settings = { instructions: session.instructions, voice: (session.output_modalities ?? ["audio"]).includes("audio") };
}

// The page's settings as a Realtime session.update.
function sendRtcSettings(s, update) {
  const session = { type: "realtime" };
  if (update.instructions !== undefined) session.instructions = update.instructions;
  if (update.voice !== undefined) session.output_modalities = update.voice ? ["audio"] : ["text"];
  s.channel.send(JSON.stringify({ type: "session.update", session }));
}

// A typed turn, as a Realtime client sends one: a user message, then response.create; a reply in progress
// is stopped first.
function sayRtc(s, text) {
  if (s.channel?.readyState !== "open") return;
  if (s.current || s.speaking) s.channel.send(JSON.stringify({ type: "output_audio_buffer.clear" }));
  const item = { type: "message", role: "user", content: [{ type: "input_text", text }] };
  s.channel.send(JSON.stringify({ type: "conversation.item.create", item }));
  s.channel.send(JSON.stringify({ type: "response.create" }));
}

// -- reply tokens from two channels ------------------------------------------------------------------

// A TOKENS payload (transport/datagram.py): packet number u32, first seq u32, count u16; per token reply u32,
// text bytes u16, the UTF-8 text. Little-endian.
function onTokens(s, data) {
  if (!(data instanceof ArrayBuffer) || data.byteLength < 10) return;
  pub.rtc.eloquentMessages++;
  if (s.drop > 0 && Math.random() < s.drop) {
    pub.rtc.eloquentDropped++;
    return;
  }
  const v = new DataView(data);
  const number = v.getUint32(0, true);
  const first = v.getUint32(4, true);
  const count = v.getUint16(8, true);
  const utf8 = new TextDecoder();
  let at = 10;
  for (let i = 0; i < count && at + 6 <= data.byteLength; i++) {
    const n = v.getUint16(at + 4, true);
    at += 6;
    holdToken(s, first + i, utf8.decode(new Uint8Array(data, at, n)), "eloquent");
    at += n;
  }
  s.highestPacket = Math.max(s.highestPacket, number);
  renderTokens(s);
  if (s.tokens.readyState === "open") {
    const ack = new DataView(new ArrayBuffer(8)); // ACK payload: token_seq u32, packet number u32
    ack.setUint32(0, s.contiguous, true);
    ack.setUint32(4, s.highestPacket, true);
    s.tokens.send(ack.buffer);
  }
}

function holdToken(s, seq, text, path) {
  if (seq > s.contiguous && seq <= s.contiguous + TOKENS_WINDOW && !s.held.has(seq)) s.held.set(seq, [text, path]);
}

// The tokens that follow the last one shown, in order; they join the reply in progress (the eloquent
// channel may bring a reply's first tokens before its response.created: they wait for it).
function renderTokens(s) {
  while (s.held.has(s.contiguous + 1)) {
    const seq = ++s.contiguous;
    const [text, path] = s.held.get(seq);
    s.held.delete(seq);
    pub.rtc.tokens.push([seq, path]);
    s.ready.push(text);
  }
  if (!s.current || s.current.done) return;
  for (const text of s.ready.splice(0)) showToken(s, text);
}

function showToken(s, text) {
  const reply = s.current;
  if (!reply) return;
  if (!reply.text) mark(reply.reply, "text");
  reply.text += text;
  reply.streamedText += text;
  s.replyEls.get(reply.reply).textContent = reply.text;
}

function userLine(s) {
  s.userEl ??= addLine("user", "partial");
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
  clearTimeout(s.connectTimer);
  s.meter?.stop();
  s.mic.getTracks().forEach((t) => t.stop());
  s.pc.close();
  s.audio.srcObject = null;
  session = null;
  ui.start.disabled = false;
  ui.stop.disabled = true;
  ui.interrupt.disabled = true;
}

ui.start.onclick = placeCall;
ui.stop.onclick = () => (session?.rtc ? stopRtc() : stop());
ui.interrupt.onclick = () => (session?.rtc ? interruptRtc() : interrupt());
if (forcedTransport()) ui.transport.value = forcedTransport();
