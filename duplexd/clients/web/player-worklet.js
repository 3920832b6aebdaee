// Reply audio player: a bounded ring of PCM at the server's output rate (24 kHz), resampled to the
// context rate by linear interpolation, behind a small jitter buffer. Runs on the audio rendering thread.
//
// Messages in (from the main thread):
//   {type: "audio", pcm: Int16Array}  append samples (what does not fit in the ring is dropped, counted)
//   {type: "begin"}                   a reply starts: wait for the jitter buffer again
//   {type: "end"}                     the reply's audio is complete: play out what is buffered
//   {type: "flush"}                   the reply was interrupted: drop what is buffered and not played
//   {type: "pause"} / {type: "resume"} the user may be talking over the reply: stop playing, keeping the
//                                     buffer / play on from where it paused
// Messages out: {type, played, skipped} with type "position" (every ~100 ms while it changes),
// "drained" (a reply's audio has been played to the end), "flushed", "overflow".
// `played` counts input samples actually played, `skipped` those dropped unplayed (flush, overflow);
// together they are the position in the server's output stream, in samples at the input rate.
class PlayerProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = options.processorOptions;
    this.inputRate = o.inputRate;
    this.ring = new Float32Array(Math.round(o.inputRate * o.capacityS));
    this.startSamples = Math.round((o.inputRate * o.jitterMs) / 1000);
    this.step = o.inputRate / sampleRate; // input samples per output sample
    this.read = 0; // ring index of the next unplayed sample
    this.count = 0; // buffered, unplayed samples
    this.phase = 0; // fractional position between ring[read] and the sample after it
    this.playing = false;
    this.held = false; // paused by the server (speech over the reply): silent, the buffer kept
    this.ended = true; // no reply audio expected until "begin"
    this.played = 0;
    this.skipped = 0;
    this.reported = 0;
    this.reportEverySamples = Math.round(sampleRate / 10); // ~100 ms of output
    this.sinceReport = 0;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  post(type, extra) {
    this.port.postMessage({ type, played: this.played, skipped: this.skipped, ...extra });
    this.reported = this.played + this.skipped;
  }

  onMessage(msg) {
    if (msg.type === "audio") {
      this.push(msg.pcm);
    } else if (msg.type === "begin") {
      this.ended = false;
      this.held = false; // a new reply is never paused
    } else if (msg.type === "end") {
      this.ended = true;
      if (this.count === 0 && !this.playing) this.post("drained");
    } else if (msg.type === "pause") {
      this.held = true;
      this.post("position");
    } else if (msg.type === "resume") {
      this.held = false;
    } else if (msg.type === "flush") {
      this.held = false;
      this.skipped += this.count;
      this.count = 0;
      this.phase = 0;
      this.playing = false;
      this.ended = true;
      this.post("flushed");
    }
  }

  push(pcm) {
    const cap = this.ring.length;
    const n = Math.min(pcm.length, cap - this.count);
    let w = (this.read + this.count) % cap;
    for (let i = 0; i < n; i++) {
      this.ring[w] = pcm[i] / 32768;
      w = w + 1 === cap ? 0 : w + 1;
    }
    this.count += n;
    if (n < pcm.length) {
      // The server paces audio to stay ~1 s ahead of playback; a full ring means it did not.
      this.skipped += pcm.length - n;
      this.post("overflow", { dropped: pcm.length - n });
    }
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    if (this.held) {
      out.fill(0);
      for (let c = 1; c < outputs[0].length; c++) outputs[0][c].fill(0);
      return true;
    }
    if (!this.playing && this.count > 0 && (this.count >= this.startSamples || this.ended)) {
      this.playing = true; // jitter buffer filled, or the reply is complete and shorter than it
    }
    const cap = this.ring.length;
    for (let j = 0; j < out.length; j++) {
      if (!this.playing) {
        out[j] = 0;
        continue;
      }
      if (this.count === 0 || (this.count === 1 && !this.ended)) {
        // Nothing (or no next sample to interpolate towards) buffered.
        this.playing = false;
        out[j] = 0;
        if (this.count === 0 && this.ended) {
          this.phase = 0;
          this.post("drained");
        } // else an underrun: wait for the jitter buffer to fill again
        continue;
      }
      const s0 = this.ring[this.read];
      const s1 = this.count > 1 ? this.ring[this.read + 1 === cap ? 0 : this.read + 1] : s0;
      out[j] = s0 + (s1 - s0) * this.phase;
      this.phase += this.step;
      while (this.phase >= 1 && this.count > 0) {
        this.phase -= 1;
        this.read = this.read + 1 === cap ? 0 : this.read + 1;
        this.count--;
        this.played++;
      }
    }
    this.sinceReport += out.length;
    if (this.sinceReport >= this.reportEverySamples) {
      this.sinceReport = 0;
      if (this.played + this.skipped !== this.reported) this.post("position");
    }
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    return true;
  }
}

registerProcessor("duplexd-player", PlayerProcessor);
