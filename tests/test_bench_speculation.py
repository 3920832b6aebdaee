"""`duplexd bench speculation`'s arithmetic: per-mode percentiles, hit rate, reductions and the table."""

from __future__ import annotations

from dataclasses import replace

from duplexd.bench import speculation as spec


def run(mode: str, eos_audio: float, endpoint_token: float, hit: bool = False, drafts: int = 0) -> spec.Run:
    return spec.Run(
        mode=mode,
        clip="c.wav",
        turn_text="hi",
        reply_text="hello",
        eos_to_turn_end_s=1.0,
        endpoint_to_first_token_s=endpoint_token,
        eos_to_first_token_s=1.0 + endpoint_token,
        eos_to_first_audio_s=eos_audio,
        drafts=drafts,
        hit=hit,
        draft_tokens=5 if hit else 0,
    )


def test_summary_and_reductions() -> None:
    on = [run("on", 1.0, 0.01, hit=True, drafts=2), run("on", 1.2, 0.1, drafts=2), run("on", 1.1, 0.02, hit=True)]
    s = spec._summary(on)
    assert s["eos_to_first_audio_p50_s"] == 1.1 and s["endpoint_to_first_token_p50_s"] == 0.02
    assert s["drafted_turns"] == 2 and s["hit_rate"] == 0.5  # the third made no draft: not counted
    assert spec._reduction(0.02, 0.1) == 0.8 and spec._reduction(None, 0.1) is None
    result = {m: spec._summary([replace(r, mode=m) for r in on]) for m in spec.MODES}
    result |= {
        "hit_rate": 0.5,
        "wasted_draft_tokens": 7,
        "draft_compute_share": 0.2,
        "lossless": True,
        "lossless_compared": 3,
        "reduction_vs_off": {},
        "asr_pass_p50_s": {},
    }
    table = spec.table(result)
    assert "| end of speech -> first audio | 1.10 / " in table and "lossless: True (3 replies" in table
