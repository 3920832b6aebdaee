"""The capacity/overload/cluster benchmarks' criteria, sweep and tables (the runs themselves are `duplexd bench
capacity` and `duplexd bench cluster`)."""

from __future__ import annotations

import json
from pathlib import Path

from duplexd.bench import cluster
from duplexd.bench.capacity import meets, sweep, table


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


def test_the_sweep_stops_after_two_failing_n_and_n_star_needs_every_smaller_n() -> None:
    first_audio = {1: 1.2, 2: 1.6, 3: 1.4, 4: 1.7, 5: 1.8, 6: 1.0}  # N = 2 fails, 3 passes, 4 and 5 fail
    tried: list[int] = []

    def measure(n: int) -> dict:
        tried.append(n)
        return result(sessions_offered=n, sessions_admitted=n, eos_to_first_audio_p90_s=first_audio[n])

    n_star, runs = sweep(8, measure)
    assert n_star == 1  # N = 3 passed, but N = 2 did not
    assert tried == [1, 2, 3, 4, 5]  # two failing N in a row end it
    assert [r["failed"] for r in runs][1] == ["eos_to_first_audio_p90_s"]
    assert sweep(2, lambda n: result(sessions_offered=n, sessions_admitted=n))[0] == 2


def test_the_cluster_table_reads_the_recorded_run() -> None:
    recorded = json.loads((Path(__file__).resolve().parents[1] / "docs" / "bench-cluster.json").read_text())
    text = cluster.table(recorded)
    assert "through HAProxy" in text and "added" in text
    assert [line.split()[0] for line in text.splitlines()[2:]] == [str(s["workers"]) for s in recorded["scale"]]
