"""HRRN ordering of recognizer passes (pure): the choice rule, the cost line, and whole schedules."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import pytest

from duplexd.scheduler.hrrn import Candidate, PassCost, PassCosts, pick, ratio


def test_cost_line_is_learned_from_measurements() -> None:
    cost = PassCost(fixed_s=1.0, per_s=0.0)
    rng = random.Random(3)
    for _ in range(64):
        window = rng.uniform(1.0, 15.0)
        cost.observe(window, 0.3 + 0.05 * window + rng.gauss(0.0, 0.005))
    assert cost.fixed_s == pytest.approx(0.3, abs=0.02)
    assert cost.per_s == pytest.approx(0.05, abs=0.003)
    assert cost(10.0) == pytest.approx(0.8, abs=0.02)


def test_cost_keeps_its_prior_until_it_has_enough_samples_and_never_slopes_down() -> None:
    cost = PassCost(fixed_s=0.4, per_s=0.02, min_samples=8)
    for _ in range(7):
        cost.observe(5.0, 2.0)
    assert cost(5.0) == pytest.approx(0.5)
    cost.observe(5.0, 2.0)  # eight passes, all the same window: only their mean is known
    assert cost(5.0) == pytest.approx(2.0)
    cost = PassCost(min_samples=8)
    for window in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0):
        cost.observe(window, 1.0 - 0.01 * window)
    assert cost.per_s == 0.0


def test_equal_waits_shortest_window_first() -> None:
    cost = PassCost(fixed_s=0.3, per_s=0.05)
    choice = pick([Candidate("long", 1.0, 12.0), Candidate("short", 1.0, 2.0)], PassCosts(full=cost))
    assert choice is not None and choice.key == "short"
    assert choice.ratios["short"] > choice.ratios["long"]


def test_a_long_window_wins_once_it_has_waited_long_enough() -> None:
    cost = PassCost(fixed_s=0.3, per_s=0.05)
    short = Candidate("short", 0.5, 2.0)
    waits = [w / 10 for w in range(0, 100)]
    costs = PassCosts(full=cost)
    first_win = next(w for w in waits if pick([Candidate("long", w, 12.0), short], costs).key == "long")  # type: ignore[union-attr]
    # Its ratio passes the short one's exactly when waited/cost(long) > waited_short/cost(short).
    assert first_win == pytest.approx(0.5 * cost(12.0) / cost(2.0), abs=0.11)
    assert ratio(Candidate("x", 0.0, 3.0), costs) == 1.0


def test_previews_and_full_passes_each_learn_their_own_cost_line() -> None:
    costs = PassCosts()
    for window in (1.0, 2.0, 3.0, 4.0) * 4:
        costs.observe(window, 0.05 + 0.03 * window, preview=True)
        costs.observe(window, 0.30 + 0.03 * window)
    assert costs(2.0, preview=True) == pytest.approx(0.11)
    assert costs(2.0) == pytest.approx(0.36)
    # At equal waits the cheaper preview goes first, though its window is the longer.
    choice = pick([Candidate("full", 1.0, 2.0), Candidate("preview", 1.0, 3.0, preview=True)], costs)
    assert choice is not None and choice.key == "preview"


def test_ties_go_to_the_first_listed() -> None:
    costs = PassCosts()
    choice = pick([Candidate("a", 1.0, 4.0), Candidate("b", 1.0, 4.0)], costs)
    assert choice is not None and choice.key == "a"
    assert pick([], costs) is None


@dataclass
class _Job:
    name: str
    arrival: float
    window_s: float
    started: float = -1.0
    finished: float = -1.0


def _serve(jobs: list[_Job], policy: str, cost: PassCost) -> list[_Job]:
    """One server, non-preemptive; `policy` chooses among the jobs that have arrived."""
    pending = sorted(jobs, key=lambda j: j.arrival)
    costs = PassCosts(full=cost)
    clock, queue, done = 0.0, [], []
    while pending or queue:
        while pending and pending[0].arrival <= clock:
            queue.append(pending.pop(0))
        if not queue:
            clock = pending[0].arrival
            continue
        if policy == "fcfs":
            job = min(queue, key=lambda j: j.arrival)
        elif policy == "sjf":
            job = min(queue, key=lambda j: (j.window_s, j.arrival))
        else:
            candidates = [Candidate(j.name, clock - j.arrival, j.window_s) for j in queue]
            job = next(j for j in queue if j.name == pick(candidates, costs).key)  # type: ignore[union-attr]
        queue.remove(job)
        job.started, job.finished = clock, clock + cost(job.window_s)
        clock = job.finished
        done.append(job)
    return done


def _workload(seed: int, n: int, load: float, cost: PassCost) -> list[_Job]:
    """Partial passes (short windows) from many streams, mixed with long windows (final passes of long
    utterances), Poisson arrivals at the given utilization."""
    rng = random.Random(seed)
    windows = [rng.choice([1.0, 1.5, 2.0, 2.5]) if rng.random() < 0.8 else rng.uniform(10.0, 15.0) for _ in range(n)]
    mean_cost = statistics.fmean(cost(w) for w in windows)
    clock, jobs = 0.0, []
    for i, window in enumerate(windows):
        clock += rng.expovariate(load / mean_cost)
        jobs.append(_Job(f"j{i}", clock, window))
    return jobs


@pytest.mark.parametrize("seed", range(5))
def test_hrrn_cuts_median_response_against_fcfs_without_starving_long_passes(seed: int) -> None:
    # A pass-cost line with a large per-second share (a GPU-like recognizer), where ordering matters most.
    cost = PassCost(fixed_s=0.05, per_s=0.06)
    response = {}
    worst_long_wait = {}
    for policy in ("fcfs", "sjf", "hrrn"):
        done = _serve(_workload(seed, 600, 0.9, cost), policy, cost)
        assert len(done) == 600
        response[policy] = statistics.median(j.finished - j.arrival for j in done)
        worst_long_wait[policy] = max(j.started - j.arrival for j in done if j.window_s >= 10.0)
    assert response["hrrn"] < response["fcfs"]
    # SJF cuts the median further but lets long passes wait; HRRN's worst long wait stays below SJF's.
    assert worst_long_wait["hrrn"] <= worst_long_wait["sjf"]


def test_a_stream_of_short_passes_cannot_starve_a_long_one() -> None:
    cost = PassCost(fixed_s=0.1, per_s=0.05)
    # Short passes arrive back to back forever (utilization 1): SJF would never run the long one.
    jobs = [_Job("long", 0.0, 14.0)] + [_Job(f"s{i}", 0.99 * i * cost(1.0), 1.0) for i in range(400)]
    done = _serve(jobs, "hrrn", cost)
    long = next(j for j in done if j.name == "long")
    # It runs once its wait reaches (cost(long)/cost(short)) times a short pass's wait (about one pass).
    assert long.started <= 2 * cost(14.0) / cost(1.0) * cost(1.0) + cost(14.0)
    sjf = _serve([_Job(j.name, j.arrival, j.window_s) for j in jobs], "sjf", cost)
    assert next(j for j in sjf if j.name == "long").started >= 399 * cost(1.0)
