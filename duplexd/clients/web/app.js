// duplexd browser voice client for wire protocol v1 (docs/protocol.md).
//
// Mic -> capture worklet (20 ms Float32 blocks) -> PCM16 binary frames -> /v1/stream.
// Server events -> transcript, reply text, latency panel; binary audio out -> player worklet -> speakers,
// whose play position goes back to the server as `playback` reports.
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

const $ = (id) => document.getElementById(id);
const ui = {
  start: $("start"),
  stop: $("stop"),
  interrupt: $("interrupt"),
  status: $("status"),
  transcript: $("transcript"),
  reply: $("reply"),
  latency: $("latency"),
};

// Everything worth checking from outside (tests, the console), plain data only.
const pub = (window.duplexd = {
  state: "idle", // idle | starting | connecting | live | reconnecting | ending | ended | error
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

// `node`: the process that owns the session behind a balancer (session.started.node), for a resume.
// The microphone, with the browser's echo canceller, noise suppression and gain control (null: refused,
// and the page says why).
async function openMic() {
  setStatus("Asking for the microphone…");
  try {
    return await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true, channelCount: 1 },
    });
  } catch (e) {
    abortStart(micErrorText(e), "mic_refused");
    return null;
  }
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
  Object.assign(pub, {
    sessionId: null, dialog: null, transcriptFinal: [], replies: [], playedMs: 0, positionMs: 0,
    framesSent: 0, framesDropped: 0, lastLagMs: null, maxLagMs: null, eosToFirstAudioMs: [],
    eosToFirstTextMs: [], errors: [], closeCode: null, replyPauses: [], replyResumes: [],
  });
  ui.transcript.replaceChildren();
  ui.reply.replaceChildren();
  renderLatency();

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
    turnEosAt: new Map(), // turn -> performance.now() when its end of speech was sent
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
      const at = sentTimeOf(s, ev.eos);
      if (at !== null) s.turnEosAt.set(ev.turn, at);
      break;
    }
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
    case "session.ended":
      setStatus("Session ended.");
      break;
    case "error":
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
  setState("live");
  setStatus(pub.dialog ? "Listening. Speak, and the assistant answers." : "Listening (transcription only).");
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
  el.className = "final";
  el.textContent = ev.text;
  pub.transcriptFinal.push(ev.text);
  s.finalLines.set(ev.utterance, { el, text: ev.text, index: pub.transcriptFinal.length - 1 });
  for (const n of s.finalLines.keys()) if (s.finalLines.size > 4) s.finalLines.delete(n); // (only the newest continue)
}

function utteranceEl(s, n) {
  let el = s.utteranceEls.get(n);
  if (!el) {
    el = document.createElement("p");
    el.className = "utterance";
    el.dataset.utterance = n;
    ui.transcript.appendChild(el);
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
  const el = document.createElement("p");
  el.className = "reply";
  el.dataset.reply = ev.reply;
  ui.reply.appendChild(el);
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
  if (!reply.text) recordLatency(s, ev.reply, pub.eosToFirstTextMs);
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
}

// -- audio out ------------------------------------------------------------------------------------

function onAudio(s, buf) {
  const view = new DataView(buf);
  if (buf.byteLength < HEADER_BYTES || view.getUint8(0) !== KIND_AUDIO_OUT || !s.player) return;
  const reply = s.current;
  if (reply) {
    reply.audioFramesReceived++;
    if (reply.audioFramesReceived === 1) recordLatency(s, reply.reply, pub.eosToFirstAudioMs);
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

function recordLatency(s, turn, list) {
  const eosAt = s.turnEosAt.get(turn);
  if (eosAt !== undefined) list.push(Math.round(performance.now() - eosAt));
  renderLatency();
}

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

ui.start.onclick = start;
ui.stop.onclick = stop;
ui.interrupt.onclick = interrupt;
renderLatency();
showHealth();
