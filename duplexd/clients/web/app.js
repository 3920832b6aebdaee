// duplexd's web page, and its WebSocket client for wire protocol v1 (docs/protocol.md).
//
// The page: the conversation as one list of turns, an "assistant listening / thinking / speaking" indicator,
// the microphone's level and a device picker, a text box for typed turns, settings (spoken replies, the system
// prompt), and the latency of the last turns. The call itself goes over WebRTC by default (rtc.js), over this
// WebSocket client when WebRTC is not available or does not connect, or when the switch says so.
//
// WebSocket: mic -> capture worklet (20 ms Float32 blocks) -> PCM16 binary frames -> /v1/stream.
// Server events -> the conversation, latency; binary audio out -> player worklet -> speakers, whose play
// position goes back to the server as `playback` reports.
"use strict";

const FRAME_MS = 20;
const HEADER_BYTES = 8; // kind u8, 3 reserved zero bytes, seq u32 LE
const KIND_AUDIO_IN = 1;
const KIND_AUDIO_OUT = 2;
const PENDING_MAX_FRAMES = 100; // mic audio (2 s) held while the session starts; older blocks are dropped
const SENT_HISTORY_FRAMES = 1500; // send times of the last 30 s of frames, to time `turn.ended.eos`
const MAX_BUFFERED_BYTES = 1 << 20; // a stalled socket: drop mic frames rather than queue without bound
const PLAYER_CAPACITY_S = 4; // the server stays at most output.lead_ms (1 s) ahead of playback
const PLAYER_JITTER_MS = 100;
const END_TIMEOUT_MS = 15000; // after session.end, close ourselves if the server does not
const RESUME_ATTEMPTS = 5; // a dropped connection: reconnect with session.resume this many times ...
const RESUME_BACKOFF_MS = 250; // ... waiting this much longer before each
const HISTORY_TURNS = 8; // turns shown in the latency history
const TIMINGS_KEPT = 64; // turns whose timing is kept (a reply's first audio may come long after its turn)
const METER_MS = 50; // how often the microphone level is measured
const VOICE_DBFS = -45; // the level above which the microphone is taken to hear the user (end of speech, WebRTC)
const SETTINGS_KEY = "duplexd.settings";

const $ = (id) => document.getElementById(id);
const ui = {
  start: $("start"),
  stop: $("stop"),
  interrupt: $("interrupt"),
  status: $("status"),
  activity: $("activity"),
  conversation: $("conversation"),
  latency: $("latency"),
  history: document.querySelector("#history tbody"),
  mic: $("mic"),
  level: $("level"),
  transport: $("transport"),
  say: $("say"),
  sayText: $("sayText"),
  send: $("send"),
  voice: $("voice"),
  instructions: $("instructions"),
  apply: $("apply"),
};

// Everything worth checking from outside (tests, the console), plain data only.
const pub = (window.duplexd = {
  state: "idle", // idle | starting | connecting | live | reconnecting | ending | ended | error
  transport: null, // "webrtc" | "websocket": what the session in progress (or the last one) uses
  fallback: null, // why the page fell back from WebRTC to the WebSocket (null: it did not)
  activity: null, // listening | thinking | speaking (null: no session)
  micLevel: 0, // the loudest microphone level measured (0..1, -60..0 dBFS)
  mics: 0, // microphones the picker lists
  settings: null, // {instructions, voice} as the server confirmed them
  typed: [], // typed turns sent
  history: [], // per turn: {turn, waitMs, replyMs, voiceMs, totalMs} (see renderHistory), the newest last
  sessionId: null,
  sampleRate: null,
  dialog: null,
  transcriptFinal: [],
  // {reply, text, streamedText (from the tokens), done, interrupted, heardText, audioFramesReceived,
  //  audioMsReceived, audioMs (from reply.done)}
  replies: [],
  playedMs: 0, // reply audio actually played
  positionMs: 0, // position in the output stream (played + dropped unplayed), what `playback` reports
  framesSent: 0,
  framesDropped: 0,
  lastLagMs: null,
  maxLagMs: null,
  eosToFirstAudioMs: [],
  eosToFirstTextMs: [],
  errors: [], // {code, message}: server `error` messages and client-side failures
  closeCode: null,
  resumes: 0, // dropped connections the session survived (session.resume)
  replyPauses: [], // {reply, at}: speech over a reply paused it (reply.paused) ...
  replyResumes: [], // ... and it played on (reply.resumed): no words came of it
});

let session = null; // the live session (see start()), null when idle

function setState(state) {
  pub.state = state;
  document.body.dataset.state = state;
  const live = state === "live" && pub.dialog;
  ui.sayText.disabled = ui.send.disabled = !live;
  if (!["live", "reconnecting", "connecting", "starting"].includes(state)) setActivity(null);
}

// What the assistant is doing: listening, thinking (the turn ended, no reply audio yet), speaking.
function setActivity(activity) {
  pub.activity = activity;
  document.body.dataset.activity = activity ?? "";
  ui.activity.textContent = activity ? `Assistant ${activity}` : "";
}

function setStatus(text, isError = false) {
  ui.status.textContent = text;
  ui.status.classList.toggle("error", isError);
}

function fail(text, code = "client") {
  pub.errors.push({ code, message: text });
  setStatus(text, true);
  console.error(`duplexd: ${text}`);
}

// -- start / stop ---------------------------------------------------------------------------------

function micErrorText(e) {
  switch (e.name) {
    case "NotAllowedError":
    case "SecurityError":
      return "Microphone access was refused. Allow it in the site settings and press Start again.";
    case "NotFoundError":
    case "OverconstrainedError":
      return "No microphone was found.";
    case "NotReadableError":
    case "AbortError":
      return "The microphone could not be opened (is another application using it?).";
    default:
      return `The microphone could not be opened (${e.name}: ${e.message}).`;
  }
}

// The microphone the picker names (or the default), with the browser's echo canceller, noise suppression and
// gain control (null: refused, and the page says why).
async function openMic() {
  setStatus("Asking for the microphone…");
  try {
    const mic = await navigator.mediaDevices.getUserMedia({ audio: micConstraints() });
    listMics(); // (their names are known once the page may use one)
    return mic;
  } catch (e) {
    abortStart(micErrorText(e), "mic_refused");
    return null;
  }
}

function micConstraints() {
  const audio = { echoCancellation: true, noiseSuppression: true, autoGainControl: true, channelCount: 1 };
  if (ui.mic.value) audio.deviceId = { exact: ui.mic.value };
  return audio;
}

// The device picker: every microphone the browser lists, the choice kept across visits.
async function listMics() {
  if (!navigator.mediaDevices?.enumerateDevices) return;
  const devices = (await navigator.mediaDevices.enumerateDevices()).filter(
    (d) => d.kind === "audioinput" && d.deviceId && d.deviceId !== "default",
  );
  const chosen = ui.mic.value || localStorage.getItem("duplexd.mic") || "";
  const options = devices.map((d, i) => new Option(d.label || `Microphone ${i + 1}`, d.deviceId));
  ui.mic.replaceChildren(new Option("Default microphone", ""), ...options);
  ui.mic.value = devices.some((d) => d.deviceId === chosen) ? chosen : "";
  pub.mics = devices.length;
}

// Another microphone chosen: the session in progress goes on with it.
async function switchMic() {
  localStorage.setItem("duplexd.mic", ui.mic.value);
  const s = session;
  if (!s || s.ending || !s.mic) return;
  let mic;
  try {
    mic = await navigator.mediaDevices.getUserMedia({ audio: micConstraints() });
  } catch (e) {
    return fail(micErrorText(e), "mic_refused");
  }
  if (session !== s || s.ending) return mic.getTracks().forEach((t) => t.stop());
  const old = s.mic;
  s.mic = mic;
  if (s.rtc) {
    await s.pc.getSenders().find((x) => x.track?.kind === "audio")?.replaceTrack(mic.getAudioTracks()[0]);
  } else {
    s.source.disconnect();
    s.source = s.ctx.createMediaStreamSource(mic);
    s.source.connect(s.capture);
  }
  s.meter?.stop();
  s.meter = startMeter(mic, s.rtc ? null : s.ctx);
  old.getTracks().forEach((t) => t.stop());
}

// The microphone's level on the meter (an AnalyserNode on `ctx`, or on a context of its own), and when the
// microphone last heard something above VOICE_DBFS.
function startMeter(stream, ctx) {
  const own = !ctx;
  const context = ctx ?? new AudioContext();
  if (own) context.resume().catch(() => null);
  const source = context.createMediaStreamSource(stream);
  const analyser = context.createAnalyser();
  analyser.fftSize = 1024;
  source.connect(analyser);
  const buf = new Float32Array(analyser.fftSize);
  const meter = { lastLoudAt: null, timer: null, stop: null };
  meter.timer = setInterval(() => {
    analyser.getFloatTimeDomainData(buf);
    let sum = 0;
    for (let i = 0; i < buf.length; i++) sum += buf[i] * buf[i];
    const dbfs = 10 * Math.log10(sum / buf.length + 1e-12);
    const level = Math.max(0, Math.min(1, (dbfs + 60) / 60));
    ui.level.value = level;
    pub.micLevel = Math.max(pub.micLevel, level);
    if (dbfs > VOICE_DBFS) meter.lastLoudAt = performance.now();
  }, METER_MS);
  meter.stop = () => {
    clearInterval(meter.timer);
    source.disconnect();
    if (own) context.close();
    ui.level.value = 0;
  };
  return meter;
}

// -- the conversation and its latency ---------------------------------------------------------------

// A turn at the end of the conversation: "user" or "assistant".
function addLine(role, className = "") {
  const el = document.createElement("p");
  el.className = `${role} ${className}`.trim();
  ui.conversation.appendChild(el);
  el.scrollIntoView?.({ block: "nearest" });
  return el;
}

// Each turn's moments (performance.now()): end of speech (or the typed turn sent), the turn ended (the
// server's decision), the reply's first text, its first audio.
const timings = new Map();

function timing(turn) {
  let t = timings.get(turn);
  if (!t) {
    t = { turn, eos: null, end: null, text: null, audio: null };
    timings.set(turn, t);
    if (timings.size > TIMINGS_KEPT) timings.delete(timings.keys().next().value);
  }
  return t;
}

function mark(turn, moment, at = performance.now()) {
  const t = timing(turn);
  if (t[moment] !== null) return;
  t[moment] = at;
  if (t.eos !== null && moment === "text") pub.eosToFirstTextMs.push(Math.round(at - t.eos));
  if (t.eos !== null && moment === "audio") pub.eosToFirstAudioMs.push(Math.round(at - t.eos));
  if (t.eos !== null) historyRow(t);
  renderLatency();
}

function historyRow(t) {
  const ms = (a, b) => (a === null || b === null ? null : Math.round(b - a));
  const row = { turn: t.turn, waitMs: ms(t.eos, t.end), replyMs: ms(t.end, t.text), voiceMs: ms(t.text, t.audio),
    totalMs: ms(t.eos, t.audio) };
  const i = pub.history.findIndex((r) => r.turn === t.turn);
  if (i >= 0) pub.history[i] = row;
  else pub.history.push(row);
  if (pub.history.length > HISTORY_TURNS) pub.history.shift();
  renderHistory();
}

function renderHistory() {
  const cell = (x) => (x === null ? "–" : `${x}`);
  ui.history.replaceChildren(
    ...pub.history.map((r, i) => {
      const tr = document.createElement("tr");
      for (const x of [i + 1, cell(r.waitMs), cell(r.replyMs), cell(r.voiceMs), cell(r.totalMs)]) {
        const td = document.createElement("td");
        td.textContent = x;
        tr.appendChild(td);
      }
      return tr;
    }),
  );
}

// -- settings ---------------------------------------------------------------------------------------

function wantedSettings() {
  const saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) ?? "{}");
  return { voice: saved.voice ?? true, instructions: saved.instructions ?? "" };
}

function showSettings() {
  const w = wantedSettings();
  ui.voice.checked = w.voice;
  ui.instructions.value = w.instructions;
}

// Apply: kept for the next visits, and sent to the session in progress (session.update on either transport).
function applySettings() {
  localStorage.setItem(
    SETTINGS_KEY,
    JSON.stringify({ voice: ui.voice.checked, instructions: ui.instructions.value.trim() }),
  );
  const s = session;
  if (s && !s.ending && pub.state === "live") sendSettings(s, true);
}

// The settings wanted, where they differ from the session's (`always`: the instructions in any case). An
// empty system prompt is the server's own.
function sendSettings(s, always = false) {
  const w = wantedSettings();
  const current = pub.settings ?? {};
  const instructions = w.instructions || s.defaultInstructions;
  const update = {};
  if (w.voice !== current.voice) update.voice = w.voice;
  if (instructions && (always || instructions !== current.instructions)) update.instructions = instructions;
  if (!Object.keys(update).length) return;
  if (s.rtc) sendRtcSettings(s, update);
  else s.ws.send(JSON.stringify({ type: "session.update", ...update }));
}

// A typed turn: it interrupts a reply in progress, and is answered.
function say(e) {
  e.preventDefault();
  const s = session;
  const text = ui.sayText.value.trim();
  if (!s || s.ending || !text || pub.state !== "live") return;
  ui.sayText.value = "";
  pub.typed.push(text);
  const el = addLine("user", "final typed");
  el.textContent = text;
  pub.transcriptFinal.push(text);
  s.typedAt = performance.now();
  setActivity("thinking");
  if (s.rtc) return sayRtc(s, text);
  if (s.current) {
    s.ws.send(JSON.stringify({ type: "reply.cancel" }));
    s.cancelledForText = true;
  }
  s.ws.send(JSON.stringify({ type: "user.text", text }));
}

function streamUrl(node) {
  const query = new URLSearchParams();
  const token = new URLSearchParams(location.search).get("token");
  if (token) query.set("token", token);
  if (node) query.set("node", node);
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const q = query.toString();
  return `${scheme}://${location.host}/v1/stream${q ? "?" + q : ""}`;
}

async function start() {
  if (session) return;
  ui.start.disabled = true;
  setState("starting");
  resetPage("websocket");

  if (!navigator.mediaDevices?.getUserMedia) {
    return abortStart("The microphone needs a secure page (https, or http on localhost).");
  }
  if (!(await checkHealth())) return abortStart("The server is unreachable.", "unreachable");
  const mic = await openMic();
  if (!mic) return;

  const ctx = new AudioContext();
  try {
    await ctx.audioWorklet.addModule("capture-worklet.js");
    await ctx.audioWorklet.addModule("player-worklet.js");
    await ctx.resume();
  } catch (e) {
    mic.getTracks().forEach((t) => t.stop());
    ctx.close();
    return abortStart(`The audio worklets could not be loaded (${e.message}).`);
  }

  const s = {
    ctx,
    mic,
    ws: new WebSocket(streamUrl()),
    source: ctx.createMediaStreamSource(mic),
    capture: new AudioWorkletNode(ctx, "duplexd-capture", {
      numberOfInputs: 1,
      numberOfOutputs: 0, // a sink: runs without being connected to the destination
      processorOptions: { blockSamples: Math.round((ctx.sampleRate * FRAME_MS) / 1000) },
    }),
    player: null, // made on session.started, at the announced output rate
    outputRate: 24000,
    opened: false,
    started: false,
    ending: false,
    seq: 0,
    samplesSent: 0,
    pending: [], // mic blocks captured before session.started
    sentEnd: new Float64Array(SENT_HISTORY_FRAMES), // ring: stream sample count after frame i ...
    sentAt: new Float64Array(SENT_HISTORY_FRAMES), // ... and performance.now() when it was sent
    sentCount: 0,
    current: null, // the reply in progress (an entry of pub.replies)
    replyEls: new Map(), // reply number -> element
    utteranceEls: new Map(), // utterance number -> element
    finalLines: new Map(), // utterance number -> {el, text, index}: the newest finals, which speech may continue
    lastPlaybackMs: 0,
    endTimer: null,
    resume: null, // session.started.resume {token, grace_s}
    node: null, // session.started.node: the process to reconnect to behind a balancer
    tokenSeq: 0, // last reply token rendered (acked)
    eventSeq: 0, // last event `n` handled: a resume replays those after it, and repeats are skipped
    audioReceived: 0, // output-stream samples received
    resumeAttempts: 0,
    meter: null, // the microphone's level (startMeter)
    typedAt: null, // when the last typed turn was sent (its "end of speech")
    cancelledForText: false, // a reply.cancel went out before a typed turn (a no_reply answer is no error)
    defaultInstructions: null, // the server's system prompt (session.started)
  };
  session = s;
  pub.sampleRate = ctx.sampleRate;
  s.capture.onprocessorerror = () => fail("The audio capture worklet failed.");

  s.capture.port.onmessage = (e) => {
    if (s.ending) return;
    if (s.started) return sendFrame(s, e.data);
    s.pending.push(e.data);
    if (s.pending.length > PENDING_MAX_FRAMES) s.pending.shift();
  };
  s.source.connect(s.capture);
  s.meter = startMeter(mic, ctx);

  setState("connecting");
  setStatus("Connecting…");
  attach(s, s.ws, () =>
    s.ws.send(JSON.stringify({ type: "session.start", version: 1, sample_rate: ctx.sampleRate, dialog: true })),
  );
  ui.stop.disabled = false;
}

function attach(s, ws, hello) {
  s.ws = ws;
  ws.binaryType = "arraybuffer";
  ws.onopen = () => {
    s.opened = true;
    hello();
  };
  ws.onmessage = (m) => {
    if (typeof m.data === "string") onEvent(s, JSON.parse(m.data));
    else onAudio(s, m.data);
  };
  ws.onclose = (e) => onClose(s, e);
}

// The connection failed (no closing handshake: a network drop): continue the same session on a new one.
// The server resends the reply tokens after the last one shown and the audio after the last sample received.
function canResume(s, e) {
  return s.started && !s.ending && s.resume && e.code === 1006 && s.resumeAttempts < RESUME_ATTEMPTS;
}

function reconnect(s) {
  s.resumeAttempts++;
  setState("reconnecting");
  setStatus("The connection dropped; reconnecting…");
  setTimeout(() => {
    if (s.ending) return;
    attach(s, new WebSocket(streamUrl(s.node)), () =>
      s.ws.send(
        JSON.stringify({
          type: "session.resume",
          version: 1,
          session_id: pub.sessionId,
          resume_token: s.resume.token,
          token_seq: s.tokenSeq,
          event_seq: s.eventSeq,
          audio_ms: (1000 * s.audioReceived) / s.outputRate,
        }),
      ),
    );
  }, RESUME_BACKOFF_MS * s.resumeAttempts);
}

function onResumed(s, ev) {
  s.resumeAttempts = 0;
  pub.resumes++;
  setState("live");
  setStatus("Reconnected. Listening.");
  ev.tokens.forEach(([reply, text], i) => onReplyDelta(s, { reply, text, token_seq: ev.token_seq + i }));
}

// A new session: the page starts over (the conversation, its latency, what the page reports).
function resetPage(transport) {
  Object.assign(pub, {
    transport, sessionId: null, dialog: null, transcriptFinal: [], replies: [], playedMs: 0, positionMs: 0,
    framesSent: 0, framesDropped: 0, lastLagMs: null, maxLagMs: null, eosToFirstAudioMs: [],
    eosToFirstTextMs: [], errors: [], closeCode: null, replyPauses: [], replyResumes: [], settings: null,
    typed: [], history: [], micLevel: 0,
  });
  timings.clear();
  ui.conversation.replaceChildren();
  renderLatency();
  renderHistory();
}

function abortStart(text, code) {
  fail(text, code);
  setState("error");
  ui.start.disabled = false;
}

function stop() {
  const s = session;
  if (!s || s.ending) return;
  s.ending = true;
  setState("ending");
  ui.stop.disabled = true;
  ui.interrupt.disabled = true;
  stopMic(s);
  if (s.ws.readyState === WebSocket.OPEN && s.started) {
    // The server decodes what it has heard, sends the last transcript, session.ended, then closes.
    s.ws.send(JSON.stringify({ type: "session.end" }));
    setStatus("Finishing the transcript…");
    s.endTimer = setTimeout(() => s.ws.close(), END_TIMEOUT_MS);
  } else {
    s.ws.close();
  }
}

function interrupt() {
  const s = session;
  const reply = s?.current;
  if (!reply) return;
  if (!reply.done) {
    s.ws.send(JSON.stringify({ type: "reply.cancel" })); // the server answers with reply.interrupted
  } else {
    // The server has sent all of it already; only the buffered audio is left to drop.
    s.player?.port.postMessage({ type: "flush" });
    markInterrupted(s, reply, null);
  }
}

function stopMic(s) {
  s.meter?.stop();
  s.source.disconnect();
  s.mic.getTracks().forEach((t) => t.stop());
}

function teardown(s) {
  clearTimeout(s.endTimer);
  if (!s.ending) stopMic(s);
  s.ctx.close();
  session = null;
  ui.start.disabled = false;
  ui.stop.disabled = true;
  ui.interrupt.disabled = true;
}

async function onClose(s, e) {
  pub.closeCode = e.code;
  if (canResume(s, e)) return reconnect(s);
  teardown(s);
  if (e.code === 1013 || pub.errors.some((x) => x.code === "overloaded")) {
    setState("error");
    setStatus("The server is full. Try again in a moment.", true);
  } else if (!s.opened && !s.ending) {
    setState("error");
    const up = await checkHealth();
    fail(up ? `The server refused the stream (close code ${e.code}).` : "The server is unreachable.", "unreachable");
  } else if (s.ending || e.code === 1000) {
    setState("ended");
    if (!pub.errors.length) setStatus("Session ended.");
  } else {
    setState("error");
    fail(`The connection dropped (code ${e.code}${e.reason ? ": " + e.reason : ""}).`, "dropped");
  }
}

// -- audio in -------------------------------------------------------------------------------------

function sendFrame(s, block) {
  if (s.ws.readyState !== WebSocket.OPEN) return;
  if (s.ws.bufferedAmount > MAX_BUFFERED_BYTES) {
    pub.framesDropped++; // not counted in stream time: the server never hears it (seq gaps are allowed)
    return;
  }
  const buf = new ArrayBuffer(HEADER_BYTES + 2 * block.length);
  const view = new DataView(buf);
  view.setUint8(0, KIND_AUDIO_IN);
  view.setUint32(4, ++s.seq, true);
  for (let i = 0; i < block.length; i++) {
    const x = Math.max(-1, Math.min(1, block[i]));
    view.setInt16(HEADER_BYTES + 2 * i, Math.round(x < 0 ? x * 32768 : x * 32767), true);
  }
  s.samplesSent += block.length;
  const slot = s.sentCount++ % SENT_HISTORY_FRAMES;
  s.sentEnd[slot] = s.samplesSent;
  s.sentAt[slot] = performance.now();
  s.ws.send(buf);
  pub.framesSent = s.seq;
}

// When was stream time `t` (seconds) sent? The send time of the first frame that contains it.
function sentTimeOf(s, t) {
  const sample = t * pub.sampleRate;
  const oldest = Math.max(0, s.sentCount - SENT_HISTORY_FRAMES);
  let found = null;
  for (let i = s.sentCount - 1; i >= oldest; i--) {
    const slot = i % SENT_HISTORY_FRAMES;
    if (s.sentEnd[slot] < sample) break;
    found = s.sentAt[slot];
  }
  return found; // null: older than the history
}

// -- server events --------------------------------------------------------------------------------

function onEvent(s, ev) {
  if (ev.n) {
    if (ev.n <= s.eventSeq) return; // replayed after a resume, and handled already
    s.eventSeq = ev.n;
  }
  switch (ev.type) {
    case "session.started":
      onStarted(s, ev);
      break;
    case "session.resumed":
      onResumed(s, ev);
      break;
    case "frame.ack":
      pub.lastLagMs = ev.lag_ms;
      pub.maxLagMs = Math.max(pub.maxLagMs ?? 0, ev.max_lag_ms);
      renderLatency();
      break;
    case "vad.speech_started":
      document.body.classList.add("hearing");
      break;
    case "vad.speech_stopped":
      document.body.classList.remove("hearing");
      break;
    case "transcript.partial":
      showPartial(s, ev);
      break;
    case "transcript.final":
      showFinal(s, ev);
      break;
    case "turn.ended": {
      const typed = s.typedAt !== null;
      const at = typed ? s.typedAt : sentTimeOf(s, ev.eos);
      s.typedAt = null;
      if (at !== null) mark(ev.turn, "eos", at);
      mark(ev.turn, "end");
      setActivity("thinking");
      break;
    }
    case "session.updated":
      pub.settings = { instructions: ev.instructions, voice: ev.voice };
      break;
    case "reply.started":
      onReplyStarted(s, ev);
      break;
    case "reply.delta":
      onReplyDelta(s, ev);
      break;
    case "reply.done":
      onReplyDone(s, ev);
      break;
    case "reply.paused":
      s.player.port.postMessage({ type: "pause" }); // keep the buffer: it may play on
      pub.replyPauses.push({ reply: ev.reply, at: performance.now() });
      break;
    case "reply.resumed":
      s.player.port.postMessage({ type: "resume" });
      pub.replyResumes.push({ reply: ev.reply, at: performance.now() });
      break;
    case "reply.interrupted":
      onReplyInterrupted(s, ev);
      break;
    case "turn.continued":
      onTurnContinued(s, ev);
      break;
    case "session.ended":
      setStatus("Session ended.");
      break;
    case "error":
      if (ev.code === "no_reply" && s.cancelledForText) break; // (the reply had ended: nothing to cancel)
      pub.errors.push({ code: ev.code, message: ev.message });
      setStatus(ev.code === "overloaded" ? "The server is full. Try again in a moment." : `Server error (${ev.code}): ${ev.message}`, true);
      console.error(`duplexd server error ${ev.code}: ${ev.message}`);
      break;
    default:
      break; // newer servers may send more; ignore what this client does not know
  }
}

function onStarted(s, ev) {
  s.started = true;
  s.resume = ev.resume ?? null;
  s.node = ev.node ?? null;
  pub.sessionId = ev.session_id;
  pub.dialog = ev.dialog ?? false;
  s.outputRate = ev.output?.sample_rate ?? 24000;
  s.player = new AudioWorkletNode(s.ctx, "duplexd-player", {
    numberOfInputs: 0,
    numberOfOutputs: 1,
    outputChannelCount: [1],
    processorOptions: { inputRate: s.outputRate, capacityS: PLAYER_CAPACITY_S, jitterMs: PLAYER_JITTER_MS },
  });
  s.player.onprocessorerror = () => fail("The audio player worklet failed.");
  s.player.port.onmessage = (e) => onPlayer(s, e.data);
  s.player.connect(s.ctx.destination);
  for (const block of s.pending.splice(0)) sendFrame(s, block);
  s.defaultInstructions = ev.instructions ?? null;
  ui.instructions.placeholder = ev.instructions ?? ui.instructions.placeholder;
  if (pub.dialog) {
    pub.settings = { instructions: ev.instructions, voice: ev.voice };
    sendSettings(s);
  }
  setState("live");
  setActivity("listening");
  const via = pub.fallback ? ` (Over the WebSocket: WebRTC ${pub.fallback}.)` : "";
  setStatus((pub.dialog ? "Listening. Speak, and the assistant answers." : "Listening (transcription only).") + via);
}

// Committed words solid, the rest of the hypothesis dim.
function showPartial(s, ev) {
  const el = utteranceEl(s, ev.utterance);
  const solid = document.createElement("span");
  const dim = document.createElement("span");
  solid.className = "final";
  dim.className = "partial";
  solid.textContent = ev.words.slice(0, ev.committed).map((w) => w.w).join(" ");
  dim.textContent = ev.words.slice(ev.committed).map((w) => w.w).join(" ");
  el.replaceChildren(solid, solid.textContent && dim.textContent ? " " : "", dim);
}

function showFinal(s, ev) {
  const el = utteranceEl(s, ev.utterance);
  s.utteranceEls.delete(ev.utterance);
  if (!ev.text.trim()) return el.remove();
  const before = ev.continues !== undefined ? s.finalLines.get(ev.continues) : undefined;
  if (before) {
    // The speaker went on after a pause: one line, one sentence ("the best" + "part of the week.").
    el.remove();
    before.text = (ev.previous_text ?? before.text) + " " + ev.text;
    before.el.textContent = before.text;
    pub.transcriptFinal[before.index] = before.text;
    s.finalLines.delete(ev.continues);
    s.finalLines.set(ev.utterance, before);
    return;
  }
  el.className = "user final";
  el.textContent = ev.text;
  pub.transcriptFinal.push(ev.text);
  s.finalLines.set(ev.utterance, { el, text: ev.text, index: pub.transcriptFinal.length - 1 });
  for (const n of s.finalLines.keys()) if (s.finalLines.size > 4) s.finalLines.delete(n); // (only the newest continue)
}

function utteranceEl(s, n) {
  let el = s.utteranceEls.get(n);
  if (!el) {
    el = addLine("user", "utterance");
    el.dataset.utterance = n;
    s.utteranceEls.set(n, el);
  }
  return el;
}

function onReplyStarted(s, ev) {
  if (replyOf(ev.reply)) return; // its tokens came first, in session.resumed
  const reply = {
    reply: ev.reply, text: "", streamedText: "", done: false, interrupted: false, heardText: null,
    audioFramesReceived: 0, audioMsReceived: 0, audioMs: null,
  };
  pub.replies.push(reply);
  s.current = reply;
  const el = addLine("assistant");
  el.dataset.reply = ev.reply;
  s.replyEls.set(ev.reply, el);
  s.player.port.postMessage({ type: "begin" });
  ui.interrupt.disabled = false;
}

function replyOf(n) {
  return pub.replies.findLast((r) => r.reply === n);
}

function onReplyDelta(s, ev) {
  if (ev.token_seq) {
    if (ev.token_seq <= s.tokenSeq) return; // shown already (a resume resends what was not acknowledged)
    s.tokenSeq = ev.token_seq;
  }
  if (!replyOf(ev.reply)) onReplyStarted(s, ev); // (after a resume: reply.started may follow its tokens)
  const reply = replyOf(ev.reply);
  if (!reply.text) mark(ev.reply, "text");
  reply.text += ev.text;
  reply.streamedText += ev.text;
  s.replyEls.get(ev.reply).textContent = reply.text;
  // Tokens come in order on the socket: acknowledge each, so the server can forget it (and a resume
  // after a dropped connection would resend only what we have not shown).
  if (ev.token_seq && s.ws.readyState === WebSocket.OPEN) {
    s.ws.send(JSON.stringify({ type: "ack", token_seq: ev.token_seq, event_seq: s.eventSeq }));
  }
}

function onReplyDone(s, ev) {
  const reply = replyOf(ev.reply);
  if (!reply) return;
  reply.done = true;
  reply.text = ev.text;
  reply.audioMs = ev.audio_ms;
  s.replyEls.get(ev.reply).textContent = ev.text;
  s.player.port.postMessage({ type: "end" }); // play out the buffer; "drained" clears s.current
}

function onReplyInterrupted(s, ev) {
  const reply = replyOf(ev.reply);
  if (!reply) return;
  s.player.port.postMessage({ type: "flush" });
  markInterrupted(s, reply, ev.heard_text);
}

// The user went on: the reply to the turn they continued is withdrawn (the next turn answers all of it).
function onTurnContinued(s, ev) {
  const reply = replyOf(ev.turn);
  if (!reply) return;
  reply.withdrawn = true;
  const el = s.replyEls.get(reply.reply);
  const label = document.createElement("small");
  label.textContent = " (withdrawn: you went on)";
  const struck = document.createElement("s");
  struck.textContent = reply.text;
  el.classList.add("interrupted");
  el.replaceChildren(struck, label);
}

// What was heard solid, the rest struck through, and a label.
function markInterrupted(s, reply, heardText) {
  reply.interrupted = true;
  reply.heardText = heardText;
  const el = s.replyEls.get(reply.reply);
  el.classList.add("interrupted");
  const heard = heardText ?? "";
  const unheard = reply.text.startsWith(heard) ? reply.text.slice(heard.length) : "";
  const struck = document.createElement("s");
  const label = document.createElement("small");
  struck.textContent = unheard;
  label.textContent = " (interrupted)";
  el.replaceChildren(heardText === null ? reply.text : heard, struck, label);
  if (s.current === reply) s.current = null;
  ui.interrupt.disabled = true;
  if (s.typedAt === null) setActivity("listening"); // (else a typed turn is on its way: thinking)
}

// -- audio out ------------------------------------------------------------------------------------

function onAudio(s, buf) {
  const view = new DataView(buf);
  if (buf.byteLength < HEADER_BYTES || view.getUint8(0) !== KIND_AUDIO_OUT || !s.player) return;
  const reply = s.current;
  if (reply) {
    reply.audioFramesReceived++;
    if (reply.audioFramesReceived === 1) {
      mark(reply.reply, "audio");
      setActivity("speaking");
    }
  }
  // PCM16 LE; every platform browsers run on is little-endian, so a plain Int16Array view reads it.
  const pcm = new Int16Array(buf, HEADER_BYTES, (buf.byteLength - HEADER_BYTES) >> 1);
  s.audioReceived += pcm.length;
  if (reply) reply.audioMsReceived += (pcm.length / s.outputRate) * 1000;
  s.player.port.postMessage({ type: "audio", pcm }, [buf]);
}

function onPlayer(s, msg) {
  pub.playedMs = (msg.played / s.outputRate) * 1000;
  pub.positionMs = ((msg.played + msg.skipped) / s.outputRate) * 1000;
  if (msg.type === "overflow") fail(`Reply audio arrived faster than it plays; ${msg.dropped} samples dropped.`);
  if (msg.type === "drained" && s.current?.done) {
    s.current = null;
    ui.interrupt.disabled = true;
    if (s.typedAt === null) setActivity("listening");
  }
  sendPlayback(s);
  renderLatency();
}

// Report the output-stream position (samples played, plus those dropped unplayed after an interruption,
// so that the next reply's audio is counted from where the server sent it). Floored to 0.1 ms so that it
// never exceeds what was sent; never repeated or going backwards.
function sendPlayback(s) {
  const ms = Math.floor(pub.positionMs * 10) / 10;
  if (ms <= s.lastPlaybackMs || s.ending || s.ws.readyState !== WebSocket.OPEN) return;
  s.lastPlaybackMs = ms;
  s.ws.send(JSON.stringify({ type: "playback", played_ms: ms }));
}

// -- latency panel --------------------------------------------------------------------------------

function renderLatency() {
  const ms = (x) => (x === null || x === undefined ? "–" : `${Math.round(x)} ms`);
  const last = (list) => ms(list.at(-1));
  const rows = [
    ["Frame lag (last / max)", `${ms(pub.lastLagMs)} / ${ms(pub.maxLagMs)}`],
    ["End of speech → first reply text", last(pub.eosToFirstTextMs)],
    ["End of speech → first reply audio", last(pub.eosToFirstAudioMs)],
    ["Reply audio played", `${(pub.playedMs / 1000).toFixed(1)} s`],
  ];
  ui.latency.replaceChildren(
    ...rows.map(([k, v]) => {
      const row = document.createElement("div");
      const key = document.createElement("span");
      key.textContent = `${k}: `;
      row.append(key, v);
      return row;
    }),
  );
}

async function checkHealth() {
  try {
    const r = await fetch("/healthz", { cache: "no-store" });
    return r.ok ? await r.json() : null;
  } catch {
    return null;
  }
}

async function showHealth() {
  const h = await checkHealth();
  if (session) return; // a session started meanwhile; its status wins
  if (!h) return fail("The server is unreachable.", "unreachable");
  const models = Object.entries(h.models ?? {})
    .filter(([, v]) => v)
    .map(([k, v]) => `${k} ${v}`)
    .join(", ");
  setStatus(`Server ${h.version} is up (${models}); ${h.sessions} active session(s). Press Start.`);
}

ui.say.onsubmit = say;
ui.apply.onclick = applySettings;
ui.mic.onchange = switchMic;
navigator.mediaDevices?.addEventListener?.("devicechange", listMics);
showSettings();
listMics();
renderLatency();
renderHistory();
showHealth();
// (rtc.js sets the Start, Stop and Interrupt buttons: it picks the transport)
