"""The capacity/overload benchmarks' criteria and table (the runs themselves are `duplexd bench capacity`)."""

from __future__ import annotations

from duplexd.bench.capacity import meets, table


def result(**over: object) -> dict:
    base = {
        "sessions_offered": 3,
        "sessions_admitted": 3,
        "refusals": 0,
        "collapsed": 0,
        "frame_lag_p99_ms": 40.0,
        "deadline_miss_ratio": 0.0,
        "partial_word_latency_p90_s": 1.2,
        "eos_to_first_audio_p90_s": 1.3,
    }
    return {**base, **over}


def test_a_result_within_every_bound_is_schedulable() -> None:
    assert meets(result(), continuous=False) == []


def test_each_bound_fails_on_its_own() -> None:
    assert meets(result(deadline_miss_ratio=0.02), continuous=False) == ["deadline_miss_ratio"]
    assert meets(result(partial_word_latency_p90_s=2.5), continuous=False) == ["partial_word_latency_p90_s"]
    assert meets(result(eos_to_first_audio_p90_s=1.6), continuous=False) == ["eos_to_first_audio_p90_s"]
    assert meets(result(eos_to_first_audio_p90_s=None), continuous=True) == []  # talkers get no replies
    assert meets(result(collapsed=1), continuous=False) == ["collapsed_or_refused"]
    assert meets(result(sessions_admitted=2), continuous=False) == ["collapsed_or_refused"]
    assert meets(result(deadline_miss_ratio=None), continuous=False) == ["deadline_miss_ratio"]  # no frames


def test_tables_name_every_run() -> None:
    runs = [{**result(sessions_offered=n), "failed": [] if n < 3 else ["deadline_miss_ratio"]} for n in (1, 2, 3)]
    text = table({"benchmark": "capacity", "runs": runs, "n_star": 2, "workload": "conversational"})
    assert "N=1" in text and "N=3" in text and "N* = 2" in text and "deadline_miss_ratio" in text
    on, off = {**result(), "failed": [], "settled_limit": 2.0}, {**result(), "failed": ["collapsed_or_refused"]}
    text = table({"benchmark": "overload", "on": on, "off": off, "n_star": 2})
    assert "admission on" in text and "admission off" in text and "settled limit 2.0 vs N* 2" in text
