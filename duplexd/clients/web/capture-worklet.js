// Microphone capture: cuts the input into fixed blocks (20 ms by default) and posts each one to the
// main thread as a Float32Array (its buffer transferred). Runs on the audio rendering thread.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.blockSamples = options.processorOptions.blockSamples;
    this.block = new Float32Array(this.blockSamples);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0][0]; // mono: the first channel of the first input (absent until connected)
    if (channel) {
      let i = 0;
      while (i < channel.length) {
        const n = Math.min(channel.length - i, this.blockSamples - this.filled);
        this.block.set(channel.subarray(i, i + n), this.filled);
        this.filled += n;
        i += n;
        if (this.filled === this.blockSamples) {
          this.port.postMessage(this.block, [this.block.buffer]);
          this.block = new Float32Array(this.blockSamples);
          this.filled = 0;
        }
      }
    }
    return true; // keep running while the node exists
  }
}

registerProcessor("duplexd-capture", CaptureProcessor);
