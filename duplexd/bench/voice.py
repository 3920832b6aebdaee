"""`duplexd bench voice`: how fast the server answers, and how well it takes turns.

A real `duplexd serve` child process; one conversation at a time from a real-time client that plays the
reply audio and reports its playback (`clients.converse`), over scenarios composed from the shared clips:

- question: a clip, then silence. Latencies from the end of the speech (eos, where Silero VAD run offline
  over the composed audio last hears speech) to the first reply text and the first reply audio arriving
  at the client. A turn that ends before eos is a premature endpoint.
- pause: each question clip with a pause (0.4, 0.6, 0.8 and 1.0 s, from the last word to the next, as
  VAD hears it) at its quietest point between 40 % and 60 % of its length, where the speech goes on
  after it; ending the turn during the pause is a premature endpoint. After one, the microphone stays
  open for the turn the rest of the question makes and its reply (`PREMATURE_AFTER_S` at most): what
  the assistant then answered (`premature_answered_whole_rate`: the whole question, or only its end).
- backchannel: "okay, okay" (a real meeting recording) said while the reply plays; any interruption, or a
  turn of its own (the sound heard as the user, and answered), is a false barge-in.
- noise: sounds that are not words while the reply plays (`scenarios.noises`: a cough, a clatter, a
  throat clearing; synthesized, the set has no recording of them); as for a backchannel.
- echo: the reply's own audio reaches the microphone through a room (`bench.room`: clipping, an image-method
  impulse response with RT60 0.2-0.6 s, a drifting 50-200 ms playback delay) at -6 dB and at 0 dB; as for
  a backchannel (the echo of a reply's last words, heard after it has played out, can end a turn of its
  own). The echo canceller's ERLE on the same rooms is measured offline.
- talk-over: another clip said as soon as the reply's audio starts. From the start of its speech (Silero
  VAD offline) to the reply's audio stopping at the client (`reply.paused`, or `reply.interrupted` if no
  pause came first) is the barge-in stop time; to `reply.interrupted`, the confirmation (a reply that
  ends before the words are recognized is not interrupted, and counts against the barge-in rate).
  talk_over_echo: the same over the reply's own echo (-6 dB, through a room): the echo canceller must
  not take the user out with the echo.

In those three the microphone stays open `LISTEN_AFTER_S` after the last reply, as a user's would.
Replies paused by sound over them (backchannel, noise, echo) that then played on count towards
`resumed_after_false_interruption_rate`.

`--transport websocket,webrtc` asks the question clips again on the same server as WebRTC calls
(`clients.rtc`: OpenAI's call flow, Opus both ways, the events on `oai-events`), each after its WebSocket
run: `webrtc` holds their latencies beside the same clips' over the WebSocket. First reply audio heard
(`eos_to_first_loud`) is the first loud 20 ms the client plays: over WebRTC the first loud frame the call's
track delivers (after Opus, the network and aiortc's 80 ms jitter buffer), over the WebSocket the first loud
window of the reply as the client plays it on arrival (after `JITTER_S` buffered).

The server runs with the turn-taking features on (`FEATURES_ON`: `turn.echo_cancellation = "gate"`, the
reply paused on speech, the acoustic end-of-turn model);
`--baseline` runs every scenario again with them off (`BASELINE_OFF`), under `off`, in the same run.
`--remote-llm` runs the question and pause scenarios again with replies from a `duplexd serve-llm` child,
once per turn signal (`REMOTE_SIDES`), that child at the lowest CPU priority (a remote model takes none
of this machine's CPU), and once beside it at equal priority (`remote_colocated`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import platform
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duplexd.bench import room, write_result
from duplexd.bench import scenarios as sc
from duplexd.bench.data import wer
from duplexd.bench.server import health, serve_llm_process, server_process
from duplexd.clients.clips import Clip, load_clips
from duplexd.clients.converse import JITTER_S, ConversationResult, answered_after, converse_pcm, listening_after
from duplexd.clients.stats import percentile
from duplexd.config import TurnConfig
from duplexd.streaming.conversation import echo_score

QUESTION_MAX_S = 8.0  # single-speaker clips up to this long are the questions
PAUSES_S = (0.4, 0.6, 0.8, 1.0)  # mid-sentence pauses (--quick: the 0.6 s one only)
SCENARIOS = ("question", "pause", "backchannel", "noise", "echo", "talk_over", "talk_over_echo", "repeat")
ECHO_GAINS = (0.5, 1.0)  # -6 dB and 0 dB against the reply
# The turn-taking features measured (the `on` side), and what `--baseline` runs instead (`off`).
FEATURES_ON = {"turn.echo_cancellation": "gate", "turn.pause_on_speech_ms": "128", "turn.audio_model": "smart-turn"}
BASELINE_OFF = {"turn.echo_cancellation": "off", "turn.pause_on_speech_ms": "0", "turn.audio_model": "off"}
# `--remote-llm`: the turn signal a remote backend's endpointer gets. `remote` is the default (the acoustic
# model alone), `remote_turn_model` adds the local LLM scoring the text, `remote_no_turn_signal` has neither.
REMOTE_SIDES = {
    "remote": {"dialog.turn_model": ""},
    "remote_turn_model": {"dialog.turn_model": "smollm2"},
    "remote_no_turn_signal": {"dialog.turn_model": "", "turn.audio_model": "off"},
}
# The `serve-llm` child runs at the lowest CPU priority for those sides: a remote model takes none of the
# voice server's CPU, and on 2 cores one at equal priority (each early request decodes a whole reply)
# slowed the recognizer's final pass ~2x. `remote_colocated` is the default again, beside one at equal
# priority: what a user who runs both on one small machine gets.
REMOTE_NICENESS = 19
COLOCATED_SIDES = {"remote_colocated": {"dialog.turn_model": ""}}
FALSE_INTERRUPTIONS = ("backchannel", "noise", "echo")  # sound over the reply that must not stop it
# ... and the microphone stays open this long after the last reply of such a conversation, as a user's does:
# sound over a reply that the server takes for the user becomes a turn only after it (and a turn's silence,
# `turn.max_silence_ms`, and the recognizer's final). Ending the session as the reply ended hid those turns
# (clip06's echo through a 0 dB room, kept listening: six turns the assistant answered, its own echo each).
LISTEN_AFTER_S = 3.5
# After a turn that ended too soon: how long past the end of the speech its last turn may take to end and be
# answered (`turn.max_silence_ms`, the final pass, the first reply audio, with room to spare).
PREMATURE_AFTER_S = 6.0
# A turn "holds the whole question" when its words, as said, are this close to the clip's reference (WER):
# the question's end alone ("through the coat." of "The frosty air passed through the coat.") is far over.
WHOLE_QUESTION_WER = 0.25
LOUD_RMS, LOUD_WINDOW = 300.0, 480  # reply audio heard: a 20 ms window (24 kHz) louder than this (int16 RMS)


@dataclass(slots=True)
class Run:
    scenario: str
    clip: str
    eos_s: float
    turns: int
    premature: bool
    interrupted: bool
    eos_to_turn_end_s: float | None
    eos_to_first_token_s: float | None
    eos_to_first_audio_s: float | None
    reply_text: str
    reply_audio_s: float
    barge_in_s: float | None = None  # talk-over: from the start of the talk-over to reply.interrupted
    stop_s: float | None = None  # talk-over: from its speech onset to the reply's audio stopping (client)
    confirm_s: float | None = None  # talk-over: from its speech onset to reply.interrupted
    p_audio: float | None = None  # the first turn.ended's acoustic P(turn over) (None: not scored)
    paused: int = 0  # reply.paused events (speech over the reply stopped its audio)
    resumed: int = 0  # reply.resumed events (it played on: no words came of it)
    heard_over_reply: str = ""  # what the recognizer made of speech during the reply (last hypotheses)
    room: str = ""  # echo: the path from the loudspeaker to the microphone
    pause_s: float | None = None  # pause: how long the mid-sentence pause was
    eos_to_first_loud_s: float | None = None  # the first loud 20 ms of the reply, as the client plays it
    turn_text: str = ""  # the user's turns as the LLM read them (`turn.ended` texts)
    last_turn_text: str = ""  # the last of them: what the last reply answered
    quotes: float | None = None  # repeat: how well the reply matches the question (`echo_score`, 0..1)
    interrupted_by: str = ""  # the words that interrupted the reply (`reply.interrupted` `by`)


def _first_loud(result: ConversationResult) -> float | None:
    """When the client, playing the first reply's audio as it arrives (once `JITTER_S` is buffered, then in
    real time: it arrives ahead of playback), plays its first loud 20 ms (RMS over `LOUD_RMS`)."""
    if not result.audio:
        return None
    reply = result.audio[0].reply
    parts = [a for a in result.audio if a.reply == reply]
    pcm = np.concatenate([a.samples for a in parts]).astype(np.float32)
    n = len(pcm) // LOUD_WINDOW
    loud = np.nonzero(np.sqrt(np.mean(pcm[: n * LOUD_WINDOW].reshape(n, LOUD_WINDOW) ** 2, axis=1)) > LOUD_RMS)[0]
    if not len(loud):
        return None
    received, start = 0, parts[-1].t
    for a in parts:
        received += len(a.samples)
        if received >= JITTER_S * 24_000:
            start = a.t
            break
    return start + float(loud[0]) * LOUD_WINDOW / 24_000


def _first_at(result: ConversationResult, kind: str) -> float | None:
    found = result.of_type(kind)
    return found[0].t if found else None


def _measure(scenario: str, clip: Clip, result: ConversationResult, eos_s: float, resume_s: float | None) -> Run:
    eos_wall = result.wall_time(eos_s)
    turn_times = [r.t for r in result.of_type("turn.ended")]
    premature = any(t < eos_wall for t in turn_times)
    if resume_s is not None:  # a turn that ended during the pause ended too early
        premature = premature or any(t < result.wall_time(resume_s) for t in turn_times)
    turn = _first_at(result, "turn.ended")
    token = _first_at(result, "reply.delta")
    audio = result.audio[0].t if result.audio else None
    started = _first_at(result, "reply.started") or float("inf")
    over: dict[int, str] = {}
    for r in result.events:
        if r.t > started and r.event["type"] in ("transcript.partial", "transcript.final"):
            over[r.event["utterance"]] = r.event["text"]
    return Run(
        scenario=scenario,
        clip=clip.path.name,
        eos_s=round(eos_s, 3),
        turns=len(turn_times),
        premature=premature,
        interrupted=bool(result.of_type("reply.interrupted")),
        interrupted_by=" | ".join(e.event.get("by", "") for e in result.of_type("reply.interrupted")),
        eos_to_turn_end_s=None if turn is None else round(turn - eos_wall, 3),
        eos_to_first_token_s=None if token is None else round(token - eos_wall, 3),
        eos_to_first_audio_s=None if audio is None else round(audio - eos_wall, 3),
        reply_text="".join(r.event["text"] for r in result.of_type("reply.delta")),
        reply_audio_s=round(sum(len(a.samples) for a in result.audio) / 24_000, 3),
        heard_over_reply=" | ".join(over.values()),
        p_audio=ended[0].event.get("p_audio") if (ended := result.of_type("turn.ended")) else None,
        paused=len(result.of_type("reply.paused")),
        resumed=len(result.of_type("reply.resumed")),
        eos_to_first_loud_s=None if (loud := _first_loud(result)) is None else round(loud - eos_wall, 3),
        turn_text=" ".join(r.event.get("text", "") for r in result.of_type("turn.ended")),
        last_turn_text=ended[-1].event.get("text", "") if ended else "",
    )


def _questions(clips: list[Clip], quick: bool) -> list[Clip]:
    questions = [c for c in clips if c.speakers == 1 and c.text and c.duration_s <= QUESTION_MAX_S]
    return questions[:1] if quick else questions


def _pausable(questions: list[Clip]) -> list[tuple[Clip, np.ndarray]]:
    """The questions with a mid-sentence point between 40 % and 60 % of their length (every one but a clip
    whose speech is over by then), and their audio."""
    out = []
    for clip in questions:
        speech = sc.load(clip.path)
        d = len(speech) / sc.RATE
        if sc.mid_speech_cut(speech, 0.4 * d, 0.6 * d) is not None:
            out.append((clip, speech))
    return out


def echo_rooms_for(clips: list[Clip], rooms: int | None = None) -> list[tuple[Clip, room.RoomSpec]]:
    """The echo scenario's conversations: `rooms` rooms at each echo level (default one per clip), each
    with a clip, the clips in turn."""
    n = rooms or len(clips)
    return [(clips[i % len(clips)], spec) for gain in ECHO_GAINS for i, spec in enumerate(room.rooms(n, gain))]


def _overlapped(questions: list[Clip]) -> list[Clip]:
    """The questions whose replies are talked over, backchanneled, echoed (one room each)."""
    return questions[: max(1, len(questions) // 3)]


async def _webrtc_question(base_url: str, clip: Clip) -> Run:
    """One question clip as a WebRTC call: latencies from the end of its speech as the call's microphone
    sent it, to `response.created` (the turn's end), the first transcript delta, and the first loud frame
    the call's audio track played."""
    from duplexd.clients.rtc import RtcClient, post_offer  # (aiortc: only for this scenario)

    audio = np.concatenate([sc.silence(0.5), sc.load(clip.path)])
    eos_s = sc.speech_end_s(audio)
    client = RtcClient()
    try:
        answer, _ = await asyncio.to_thread(post_offer, base_url, await client.offer())
        await client.connect(answer)
        client.mic.say(audio, sc.RATE)
        with contextlib.suppress(TimeoutError):
            await client.wait_for(lambda e: any(x["type"] == "output_audio_buffer.stopped" for x in e), 60)
    finally:
        await client.close()
    said = client.mic.said_at
    eos_wall = (said if said is not None else float("nan")) + eos_s

    def after(t: float | None) -> float | None:
        return None if t is None or said is None else round(t - eos_wall, 3)

    loud = [t for t in client.speaker.voiced(LOUD_RMS) if t > eos_wall]
    done = client.of("response.done")
    transcript = done[0]["response"]["output"][0]["content"][0].get("transcript", "") if done else ""
    created = [t for e, t in zip(client.events, client.event_times, strict=True) if e["type"] == "response.created"]
    return Run(
        scenario="question_webrtc",
        clip=clip.path.name,
        eos_s=round(eos_s, 3),
        turns=len(created),
        premature=any(t < eos_wall for t in created),
        interrupted=bool(done) and done[0]["response"]["status"] == "cancelled",
        eos_to_turn_end_s=after(created[0] if created else None),
        eos_to_first_token_s=after(client.time_of("response.output_audio_transcript.delta")),
        eos_to_first_audio_s=after(loud[0] if loud else None),
        eos_to_first_loud_s=after(loud[0] if loud else None),
        reply_text=transcript,
        reply_audio_s=round(0.02 * len(client.speaker.voiced()), 3),
    )


async def _conversations(
    url: str,
    clips: list[Clip],
    quick: bool,
    scenarios: tuple[str, ...],
    webrtc: bool = False,
    echo_rooms: int | None = None,
) -> list[Run]:
    speech_dir = clips[0].path.parent
    questions = _questions(clips, quick)
    runs: list[Run] = []
    lead = sc.silence(0.5)
    if "question" in scenarios:
        for clip in questions:
            audio = np.concatenate([lead, sc.load(clip.path)])
            result = await converse_pcm(url, audio, sc.RATE, max_s=60)
            runs.append(_measure("question", clip, result, sc.speech_end_s(audio), None))
            print(f"  question {clip.path.name}: {asdict(runs[-1])}", flush=True)
            if webrtc:
                base = url.replace("ws://", "http://").removesuffix("/stream")
                runs.append(await _webrtc_question(base, clip))
                print(f"  question over WebRTC {clip.path.name}: {asdict(runs[-1])}", flush=True)
    if "pause" in scenarios:
        pausable = _pausable(questions)
        for pause_s in PAUSES_S[1:2] if quick else PAUSES_S:
            for clip, speech in pausable:
                d = len(speech) / sc.RATE
                paused, resume_s = sc.with_pause(speech, 0.4 * d, 0.6 * d, pause_s, len(lead) / sc.RATE)
                audio = np.concatenate([lead, paused])
                eos_s = sc.speech_end_s(audio)
                until = answered_after(eos_s, PREMATURE_AFTER_S)
                result = await converse_pcm(url, audio, sc.RATE, max_s=60, until=until)
                run = _measure("pause", clip, result, eos_s, len(lead) / sc.RATE + resume_s)
                run.pause_s = pause_s
                runs.append(run)
                print(f"  pause {pause_s} s {clip.path.name}: turns={run.turns} premature={run.premature}", flush=True)
    overlapped = _overlapped(questions)
    after = listening_after(LISTEN_AFTER_S)  # (sound over a reply, and its echo, may still become a turn)
    if "backchannel" in scenarios:
        for clip in overlapped:
            audio = np.concatenate([lead, sc.load(clip.path)])
            inject = sc.During(sc.backchannel(speech_dir), after_s=0.3)
            result = await converse_pcm(url, audio, sc.RATE, max_s=60, inject=inject, until=after)
            runs.append(_measure("backchannel", clip, result, sc.speech_end_s(audio), None))
            print(f"  backchannel {clip.path.name}: interrupted={runs[-1].interrupted}", flush=True)
    if "noise" in scenarios:
        for name, sound in sc.noises().items():
            for clip in overlapped:
                audio = np.concatenate([lead, sc.load(clip.path)])
                inject = sc.During(sound, after_s=0.3)
                result = await converse_pcm(url, audio, sc.RATE, max_s=60, inject=inject, until=after)
                runs.append(_measure("noise", clip, result, sc.speech_end_s(audio), None))
                runs[-1].room = name  # (the sound)
                print(f"  noise {name} {clip.path.name}: interrupted={runs[-1].interrupted}", flush=True)
    if "echo" in scenarios:
        for clip, spec in echo_rooms_for(overlapped, echo_rooms):
            audio = np.concatenate([lead, sc.load(clip.path)])
            path = room.EchoPath(spec)
            result = await converse_pcm(url, audio, sc.RATE, max_s=60, echo_path=path, until=after)
            runs.append(_measure("echo", clip, result, sc.speech_end_s(audio), None))
            runs[-1].room = spec.name
            print(f"  echo {clip.path.name} ({spec.name}): interrupted={runs[-1].interrupted}", flush=True)
    talk = sc.load(speech_dir / "clip16_sb_example1.wav")
    talk_onset_s = sc.speech_start_s(talk)
    for scenario in ("talk_over", "talk_over_echo"):
        if scenario not in scenarios:
            continue
        for clip, spec in zip(overlapped, room.rooms(len(overlapped), ECHO_GAINS[0]), strict=True):
            audio = np.concatenate([lead, sc.load(clip.path)])
            inject = sc.During(talk, after_s=0.0)
            path = room.EchoPath(spec) if scenario == "talk_over_echo" else None
            result = await converse_pcm(url, audio, sc.RATE, max_s=60, inject=inject, echo_path=path)
            run = _measure(scenario, clip, result, sc.speech_end_s(audio), None)
            stops = result.of_type("reply.interrupted")
            if stops and inject.said_at is not None:
                run.barge_in_s = round(stops[0].t - inject.said_at, 3)
            if inject.said_at is not None:
                onset = inject.said_at + talk_onset_s
                halts = [r.t for r in result.events if r.event["type"] in ("reply.paused", "reply.interrupted")]
                halts = [t for t in halts if t >= inject.said_at]
                run.stop_s = round(halts[0] - onset, 3) if halts else None
                run.confirm_s = round(stops[0].t - onset, 3) if stops else None
            run.room = spec.name if path is not None else ""
            runs.append(run)
            print(f"  {scenario} {clip.path.name}: interrupted={run.interrupted} after {run.barge_in_s}", flush=True)
    if "repeat" in scenarios:
        # The question said again a second into its reply (a user repeating a turn the reply misheard): the
        # user talking, to be heard as such even where the reply quotes the question (SmolLM2's often do).
        for clip in overlapped if quick else questions:
            speech = sc.load(clip.path)
            audio = np.concatenate([lead, speech])
            result = await converse_pcm(url, audio, sc.RATE, max_s=60, inject=sc.During(speech, after_s=1.0))
            run = _measure("repeat", clip, result, sc.speech_end_s(audio), None)
            run.quotes = round(echo_score(_normalized(run.turn_text), _normalized(run.reply_text)), 3)
            runs.append(run)
            print(f"  repeat {clip.path.name}: interrupted={run.interrupted}, quotes {run.quotes}", flush=True)
    return runs


def _normalized(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


def quoted(run: Run) -> bool:
    """A repeat whose reply matches the question as well as the text check takes for echo."""
    return run.quotes is not None and run.quotes >= TurnConfig().echo_similarity


def _transport_keys(calls: list[Run], questions: list[Run]) -> dict[str, Any]:
    """The question clips as WebRTC calls, beside the same clips over the WebSocket (`websocket`)."""
    keys: dict[str, Any] = {}
    for name, runs in (("webrtc", calls), ("websocket", questions)):
        for key in ("eos_to_turn_end", "eos_to_first_token", "eos_to_first_audio", "eos_to_first_loud"):
            stats = _stats([getattr(r, f"{key}_s") for r in runs])
            keys[f"{name}_{key}_p50_s"], keys[f"{name}_{key}_p90_s"] = stats["p50"], stats["p90"]
        keys[f"{name}_n"] = len(runs)
    rtc, ws = keys["webrtc_eos_to_first_loud_p50_s"], keys["websocket_eos_to_first_loud_p50_s"]
    keys["webrtc_over_websocket_first_heard_p50"] = round(rtc / ws, 3) if rtc and ws else None
    keys["unanswered"] = sum(r.eos_to_first_audio_s is None for r in calls)
    return keys


def _stats(values: list[float | None]) -> dict[str, float | None]:
    v = [x for x in values if x is not None]
    return {"p50": percentile(v, 50), "p90": percentile(v, 90), "n": len(v)}


def _rate(runs: list[Run], scenario: str) -> float | None:
    """Of the runs of `scenario`, those heard as the user: interrupted, or for sound that was not the user
    (`FALSE_INTERRUPTIONS`) also a turn of its own."""
    of = [r for r in runs if r.scenario == scenario]
    return sum(_heard_as_user(r) for r in of) / len(of) if of else None


def sentence_ends_inside(text: str, reference: str) -> int:
    """Sentence ends (".", "?", "!" after a word) inside `text`, not counting its last word, beyond those inside
    `reference`: where a question said with a pause was read as two sentences ("The child almost hurt.
    The small dog.")."""

    def inside(words: list[str]) -> int:
        return sum(w.endswith((".", "?", "!")) for w in words[:-1])

    return max(0, inside(text.split()) - inside(reference.split()))


def _heard_as_user(run: Run) -> bool:
    """The run's sound over the reply was taken for the user talking: it interrupted the reply, or (sound
    that was not the user) it ended a turn of its own after the question's, which the assistant answered."""
    return run.interrupted or (run.scenario in FALSE_INTERRUPTIONS and run.turns > 1)


def _side(
    data: Path | None,
    config: Path | None,
    quick: bool,
    scenarios: tuple[str, ...],
    settings: dict[str, str],
    webrtc: bool = False,
    echo_rooms: int | None = None,
) -> dict[str, Any]:
    """One server (with `settings` on top of `config`), every scenario: the keys, the runs, its health.
    `webrtc`: each question also as a WebRTC call. `echo_rooms`: rooms per echo level (default: one per
    clip talked over)."""
    clips = load_clips(data)
    with server_process(config, settings=settings) as port:
        url = f"ws://127.0.0.1:{port}/v1/stream"
        runs = asyncio.run(_conversations(url, clips, quick, scenarios, webrtc, echo_rooms))
        server = health(port)
    questions = [r for r in runs if r.scenario == "question"]
    calls = [r for r in runs if r.scenario == "question_webrtc"]
    turn_taking = [r for r in runs if r.scenario in ("question", "pause")]
    premature = [r for r in turn_taking if r.premature]
    paused = [r for r in runs if r.scenario == "pause"]
    overlapped = [r for r in runs if r.scenario in ("backchannel", "echo")]
    false_paused = [r for r in runs if r.scenario in FALSE_INTERRUPTIONS and r.paused]
    talk_over = [r for r in runs if r.scenario == "talk_over"]
    barge_in = _stats([r.barge_in_s for r in talk_over])
    barge_in_echo = _stats([r.barge_in_s for r in runs if r.scenario == "talk_over_echo"])
    first_token = _stats([r.eos_to_first_token_s for r in questions])
    first_audio = _stats([r.eos_to_first_audio_s for r in questions])
    turn_end = _stats([r.eos_to_turn_end_s for r in questions])
    tts = server.get("tts") or {}
    references = {c.path.name: c.text or "" for c in clips}
    return {
        "settings": settings,
        # (what the LLM answered: the question clips' turn texts against their references, corpus WER)
        "turn_text_wer": round(wer([references[r.clip] for r in questions], [r.turn_text for r in questions]), 4)
        if questions
        else None,
        # (... and of the questions said with a pause: the last turn's text, and the sentence ends read inside
        # it, per turn, where the speaker only paused)
        "pause_turn_text_wer": round(wer([references[r.clip] for r in paused], [r.last_turn_text for r in paused]), 4)
        if paused
        else None,
        "pause_turn_sentence_ends": round(
            sum(sentence_ends_inside(r.last_turn_text, references[r.clip]) for r in paused) / len(paused), 3
        )
        if paused
        else None,
        "eos_to_turn_end_p50_s": turn_end["p50"],
        "eos_to_turn_end_p90_s": turn_end["p90"],
        "eos_to_first_token_p50_s": first_token["p50"],
        "eos_to_first_token_p90_s": first_token["p90"],
        "eos_to_first_audio_p50_s": first_audio["p50"],
        "eos_to_first_audio_p90_s": first_audio["p90"],
        "tts_rtf": tts.get("rtf"),
        "premature_endpoint_rate": sum(r.premature for r in turn_taking) / len(turn_taking) if turn_taking else None,
        "premature_by_pause": {
            str(p): sum(r.premature for r in runs if r.pause_s == p) / n
            for p in PAUSES_S
            if (n := sum(r.pause_s == p for r in runs))
        },
        # (after a turn that ended too soon, the last reply answered the whole question, not only its end)
        "premature_answered_whole_rate": (
            sum(wer([references[r.clip]], [r.last_turn_text]) <= WHOLE_QUESTION_WER for r in premature) / len(premature)
            if premature
            else None
        ),
        "false_barge_in_rate": sum(map(_heard_as_user, overlapped)) / len(overlapped) if overlapped else None,
        "echo_false_barge_in_rate": _rate(runs, "echo"),
        "backchannel_false_barge_in_rate": _rate(runs, "backchannel"),
        "noise_false_barge_in_rate": _rate(runs, "noise"),
        # ... of those, the ones that were a turn of their own (the assistant answered the sound)
        "false_turns": {k: sum(r.scenario == k and r.turns > 1 for r in runs) for k in FALSE_INTERRUPTIONS},
        "false_pause_rate": len(false_paused) / n
        if (n := sum(r.scenario in FALSE_INTERRUPTIONS for r in runs))
        else None,
        "resumed_after_false_interruption_rate": (
            sum(bool(r.resumed) and not _heard_as_user(r) for r in false_paused) / len(false_paused)
            if false_paused
            else None
        ),
        "barge_in_stop_p50_s": _stats([r.stop_s for r in talk_over])["p50"],
        "barge_in_stop_p90_s": _stats([r.stop_s for r in talk_over])["p90"],
        "barge_in_confirm_p50_s": _stats([r.confirm_s for r in talk_over])["p50"],
        "barge_in_rate": _rate(runs, "talk_over"),
        "barge_in_latency_p50_s": barge_in["p50"],
        "echo_talk_over_barge_in_rate": _rate(runs, "talk_over_echo"),  # (the user talks over their own echo)
        "echo_talk_over_barge_in_p50_s": barge_in_echo["p50"],
        # The question said again over its reply: heard as the user (interrupted), of all and of those whose
        # reply quotes the question (`echo_score` >= turn.echo_similarity's default).
        "repeat_barge_in_rate": _rate(runs, "repeat"),
        "repeat_quoted": sum(quoted(r) for r in runs if r.scenario == "repeat"),
        "repeat_quoted_barge_in_rate": _rate([r for r in runs if quoted(r)], "repeat"),
        "counts": {k: sum(r.scenario == k for r in runs) for k in SCENARIOS},
        "webrtc": _transport_keys(calls, questions) if calls else None,
        "echo_cancellation": server.get("echo"),  # its cost on the server
        "turn_scorer": server.get("turn_scorer"),
        "turn_audio": server.get(
            "turn_audio"
        ),  # the acoustic end-of-turn model's cost  # (the remote backend's P(end of turn) from the local model)
        "max_rss_mb": server.get("max_rss_mb"),
        "llm_steps": server.get("llm_steps"),  # engine step p50 alone vs beside another model's work
        "threads": server.get("threads"),
        "server": {k: server.get(k) for k in ("asr", "llm", "tts", "models", "llm_engine")},
        "runs": [asdict(r) for r in runs],
    }


def erle(data: Path | None, quick: bool, echo_rooms: int | None = None) -> list[dict[str, Any]]:
    """The echo canceller's ERLE on the echo scenario's rooms (`echo_rooms_for`; each also without its
    drift), over 15 s of the lecture recording played as the reply. About 2.6 s a room here."""
    clips = load_clips(data)
    reply = sc.load(clips[0].path.parent / "clip24_lecture_60s.wav")[: 15 * sc.RATE]
    far = reply.astype(np.float32) / 32768.0
    rows = []
    for _, spec in echo_rooms_for(_overlapped(_questions(clips, quick)), echo_rooms):
        still = dataclasses.replace(spec, drift_ms=0.0)
        rows.append(
            {
                "room": spec.name,
                "erle_db": round(room.erle_db(far, spec), 1),
                "erle_no_drift_db": round(room.erle_db(far, still), 1),
            }
        )
    return rows


def run(
    data: Path | None,
    config: Path | None,
    quick: bool,
    *,
    baseline: bool = False,
    scenarios: tuple[str, ...] = SCENARIOS,
    remote: bool = False,
    webrtc: bool = False,
    echo_rooms: int | None = None,
) -> dict[str, Any]:
    on = _side(data, config, quick, scenarios, FEATURES_ON, webrtc=webrtc, echo_rooms=echo_rooms)
    off = _side(data, config, quick, scenarios, BASELINE_OFF, echo_rooms=echo_rooms) if baseline else None
    remote_sides: dict[str, Any] = {}
    if remote:  # the turn scenarios again, replies from a `duplexd serve-llm` (the same model, greedy)
        turns = tuple(x for x in scenarios if x in ("question", "pause")) or ("question",)
        for niceness, sides in ((REMOTE_NICENESS, REMOTE_SIDES), (0, COLOCATED_SIDES)):
            with serve_llm_process(niceness=niceness) as llm_port:
                backend = {"dialog.backend": "remote", "dialog.remote_url": f"http://127.0.0.1:{llm_port}/v1"}
                for side, settings in sides.items():
                    remote_sides[side] = _side(data, config, quick, turns, {**FEATURES_ON, **backend, **settings})
                    remote_sides[side]["serve_llm_niceness"] = niceness
    local_end, remote_end = on["eos_to_turn_end_p50_s"], remote_sides.get("remote", {}).get("eos_to_turn_end_p50_s")
    return {
        "benchmark": "voice",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "config_toml": None if config is None else config.read_text(),  # (`--config`; `settings` go on top)
        **on,  # (the server as configured: its keys at the top, as before `--baseline`)
        "on": {k: v for k, v in on.items() if k != "runs"},
        "off": off,
        **remote_sides,
        "remote_over_local_turn_end": round(remote_end / local_end, 3) if remote_end and local_end else None,
        "erle": erle(data, quick, echo_rooms) if "echo" in scenarios else None,
    }


def _side_table(result: dict[str, Any]) -> list[str]:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    rows = [
        ("end of speech -> turn ended", result["eos_to_turn_end_p50_s"], result["eos_to_turn_end_p90_s"]),
        ("end of speech -> first reply token", result["eos_to_first_token_p50_s"], result["eos_to_first_token_p90_s"]),
        ("end of speech -> first reply audio", result["eos_to_first_audio_p50_s"], result["eos_to_first_audio_p90_s"]),
    ]
    lines = ["| latency (client side) | p50 | p90 |", "|---|---|---|"]
    lines += [f"| {name} | {s(p50)} | {s(p90)} |" for name, p50, p90 in rows]
    c = result["counts"]
    lines += [
        "",
        f"TTS real-time factor: {result['tts_rtf']}",
        f"turn texts (question clips) against their references: WER {result.get('turn_text_wer')}; "
        f"said with a pause: WER {result.get('pause_turn_text_wer')}, "
        f"sentence ends inside {result.get('pause_turn_sentence_ends')} a turn",
        f"premature endpoints: {pct(result['premature_endpoint_rate'])} of {c['question'] + c['pause']} turns "
        f"(by pause: {', '.join(f'{p} s {pct(v)}' for p, v in result['premature_by_pause'].items()) or '-'}); "
        f"after them the whole question answered {pct(result.get('premature_answered_whole_rate'))}",
        f"false barge-ins: echo {pct(result['echo_false_barge_in_rate'])} of {c['echo']}, "
        f"backchannel {pct(result['backchannel_false_barge_in_rate'])} of {c['backchannel']}, "
        f"noise {pct(result.get('noise_false_barge_in_rate'))} of {c.get('noise', 0)}"
        f" (a turn of their own: {', '.join(f'{k} {n}' for k, n in (result.get('false_turns') or {}).items())})",
        f"replies paused by sound that was not the user talking (backchannel, noise, echo): "
        f"{pct(result.get('false_pause_rate'))}; "
        f"of those, resumed: {pct(result.get('resumed_after_false_interruption_rate'))}",
        f"talk-over: reply audio stopped p50 {s(result.get('barge_in_stop_p50_s'))} "
        f"(p90 {s(result.get('barge_in_stop_p90_s'))}) after its speech began, interruption confirmed p50 "
        f"{s(result.get('barge_in_confirm_p50_s'))}",
        f"talk-overs that interrupted: {pct(result['barge_in_rate'])} of {c['talk_over']}, "
        f"p50 {s(result['barge_in_latency_p50_s'])} after the talk-over began",
        f"talk-overs with the reply's echo (-6 dB) that interrupted: {pct(result['echo_talk_over_barge_in_rate'])} "
        f"of {c['talk_over_echo']}, p50 {s(result['echo_talk_over_barge_in_p50_s'])}",
        f"questions said again over their reply that interrupted it: {pct(result.get('repeat_barge_in_rate'))} "
        f"of {c.get('repeat', 0)}; of the {result.get('repeat_quoted', 0)} whose reply quotes the question: "
        f"{pct(result.get('repeat_quoted_barge_in_rate'))}",
    ]
    if rtc := result.get("webrtc"):
        lines += ["", "| question clips, client side | WebSocket p50 / p90 | WebRTC p50 / p90 |", "|---|---|---|"]
        for key, name in (
            ("eos_to_turn_end", "end of speech -> turn ended (WebRTC: response.created)"),
            ("eos_to_first_token", "end of speech -> first reply text"),
            ("eos_to_first_audio", "end of speech -> first reply audio (WebRTC: the first loud frame)"),
            ("eos_to_first_loud", "end of speech -> first loud reply audio, as played"),
        ):
            ws = f"{s(rtc[f'websocket_{key}_p50_s'])} / {s(rtc[f'websocket_{key}_p90_s'])}"
            lines.append(f"| {name} | {ws} | {s(rtc[f'webrtc_{key}_p50_s'])} / {s(rtc[f'webrtc_{key}_p90_s'])} |")
        lines.append(
            f"WebRTC over WebSocket, first reply audio heard p50: x{rtc['webrtc_over_websocket_first_heard_p50']} "
            f"({rtc['webrtc_n']} calls, {rtc['unanswered']} without reply audio)"
        )
    if turn_audio := result.get("turn_audio"):
        lines.append(
            f"acoustic end of turn: {turn_audio['model']}, {turn_audio['pauses']} pauses scored, "
            f"{turn_audio['ms_per_pause']} ms each"
        )
    if echo := result.get("echo_cancellation"):
        lines.append(f"echo cancellation: {echo['ms_per_s']} ms per s of microphone audio ({echo['audio_s']} s)")
    steps, threads = result.get("llm_steps"), result.get("threads")
    if steps:
        lines.append(
            f"LLM step p50: {steps['alone_p50_ms']} ms alone ({steps['alone_n']} steps), "
            f"{steps['beside_other_model_p50_ms']} ms beside a recognizer pass or synthesis "
            f"({steps['beside_other_model_n']} steps): x{steps['ratio']}"
        )
    if threads:
        lines.append("threads: " + ", ".join(f"{k} {v}" for k, v in threads.items()))  # (openmp: the env it ran with)
    return lines


def table(result: dict[str, Any]) -> str:
    lines = _side_table(result)
    if result.get("off"):
        lines += ["", f"**off** ({', '.join(f'{k} = {v}' for k, v in result['off']['settings'].items())}):", ""]
        lines += _side_table(result["off"])
    for side in (*REMOTE_SIDES, *COLOCATED_SIDES):
        if r := result.get(side):
            settings = ", ".join(f"{k} = {v}" for k, v in r["settings"].items() if k != "dialog.remote_url")
            niceness = f"; serve-llm at nice {r['serve_llm_niceness']}" if r.get("serve_llm_niceness") else ""
            lines += ["", f"**{side}** ({settings}{niceness}):", ""] + _side_table(r)
            if scorer := r.get("turn_scorer"):
                lines.append(
                    f"turn scorer: {scorer['model']}, {scorer['steps']} steps in {scorer['busy_s']} s, "
                    f"KV {scorer['kv_bytes'] / 2**20:.0f} MiB; server peak RSS {r['max_rss_mb']} MB"
                )
            else:
                lines.append(f"server peak RSS {r['max_rss_mb']} MB")
    if result.get("remote_over_local_turn_end"):
        lines.append(f"\nend of speech -> turn ended, remote over local: x{result['remote_over_local_turn_end']}")
    if result.get("erle"):
        lines += ["", "| echo path | ERLE | ERLE without the drift |", "|---|---|---|"]
        lines += [f"| {r['room']} | {r['erle_db']} dB | {r['erle_no_drift_db']} dB |" for r in result["erle"]]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    scenarios = tuple(args.scenarios.split(",")) if getattr(args, "scenarios", None) else SCENARIOS
    unknown = [x for x in scenarios if x not in SCENARIOS]
    if unknown:
        raise SystemExit(f"bench voice: unknown scenario {unknown[0]!r} (choose from {', '.join(SCENARIOS)})")
    if (rooms := getattr(args, "echo_rooms", None)) is not None and rooms < 1:
        raise SystemExit(f"bench voice: --echo-rooms must be 1 or more, not {rooms}")
    transports = set((getattr(args, "transport", None) or "websocket").split(","))
    if unknown := transports - {"websocket", "webrtc"}:
        raise SystemExit(f"bench voice: unknown transport {sorted(unknown)[0]!r} (choose from websocket, webrtc)")
    if "webrtc" in transports and "question" not in scenarios:
        raise SystemExit("bench voice: --transport webrtc asks the question clips: include the question scenario")
    result = run(
        args.data,
        args.config,
        args.quick,
        baseline=getattr(args, "baseline", False),
        scenarios=scenarios,
        remote=getattr(args, "remote_llm", False),
        webrtc="webrtc" in transports,
        echo_rooms=getattr(args, "echo_rooms", None),
    )
    write_result(args.out, result, table(result))
    return 0
