"""The AIMD admission controller against a simulated plant whose capacity is known."""

from __future__ import annotations

import statistics

import pytest

from duplexd.scheduler.admission import Aimd, AimdConfig

TARGET_MS = 200.0


def plant_p99(active: int, capacity: int) -> float:
    """A server whose frame lag is flat up to `capacity` sessions and climbs steeply past it."""
    return 40.0 if active <= capacity else 40.0 * 6.0 ** (active - capacity)  # 240 ms at N* + 1


def run(controller: Aimd, capacity_at, periods: int, offered: int) -> list[tuple[int, float]]:
    """Sessions arrive whenever admitted (up to `offered`); none leave. Admitted sessions are never dropped,
    but as sessions end and return (here: every period a tenth of them) the limit takes effect."""
    active, trace = 0, []
    for t in range(periods):
        while active < offered and controller.admit(active):
            active += 1
        controller.update({"frame_lag_ms": plant_p99(active, capacity_at(t))}, active, now=float(t))
        trace.append((active, controller.limit))
        active -= max(1, active // 10)  # churn
    return trace


def test_converges_on_the_plant_s_capacity() -> None:
    controller = Aimd(AimdConfig({"frame_lag_ms": TARGET_MS}), capacity=64)
    trace = run(controller, lambda t: 12, periods=300, offered=40)
    late = [limit for _, limit in trace[100:]]
    assert abs(statistics.mean(late) - 12) <= 0.1 * 12  # the AIMD sawtooth settles around N* = 12
    assert max(active for active, _ in trace[100:]) <= 13  # overshoot is one session, then cut


def test_never_admits_past_the_kv_pool() -> None:
    controller = Aimd(AimdConfig({"frame_lag_ms": TARGET_MS}, initial=4), capacity=8)
    trace = run(controller, lambda t: 100, periods=100, offered=50)  # the plant could take far more
    assert max(active for active, _ in trace) == 8 and max(limit for _, limit in trace) == 8
    assert not controller.admit(8)


def test_follows_a_capacity_drop() -> None:
    controller = Aimd(AimdConfig({"frame_lag_ms": TARGET_MS}), capacity=64)
    trace = run(controller, lambda t: 20 if t < 150 else 6, periods=300, offered=60)
    before = statistics.mean(limit for _, limit in trace[100:150])
    after = statistics.mean(limit for _, limit in trace[200:])
    assert before > 14 and 0.7 * 6 <= after <= 7.5


def test_an_idle_server_does_not_raise_its_limit() -> None:
    controller = Aimd(AimdConfig({"frame_lag_ms": TARGET_MS}, initial=4), capacity=64)
    for t in range(50):
        assert controller.update({"frame_lag_ms": 20.0}, active=1, now=2.0 * t).changed == "hold"
        assert controller.update({"frame_lag_ms": None}, active=4, now=2.0 * t + 1).changed == "hold"  # no news
    assert controller.limit == 4


def test_any_signal_over_target_cuts_the_limit() -> None:
    controller = Aimd(AimdConfig({"frame_lag_ms": TARGET_MS, "asr_lag_s": 2.0}, initial=10), capacity=64)
    decision = controller.update({"frame_lag_ms": 30.0, "asr_lag_s": 3.5}, active=10, now=0.0)
    assert decision.changed == "decrease" and decision.over == ("asr_lag_s",) and controller.limit == pytest.approx(7)
    for t in range(1, 21):
        controller.update({"frame_lag_ms": 900.0}, active=1, now=float(t))
    assert controller.limit == 1.0 and controller.admit(0) and not controller.admit(1)  # the floor


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        AimdConfig({})
    with pytest.raises(ValueError):
        AimdConfig({"frame_lag_ms": 200.0}, beta=1.0)


def test_a_limit_already_below_the_active_sessions_is_not_cut_again() -> None:
    """Admitted sessions stay, so an overload outlasts the cut that answered it: the limit drops once to
    beta x the sessions that caused it, then waits for sessions to leave instead of sinking to the floor."""
    controller = Aimd(AimdConfig({"frame_lag_ms": TARGET_MS}), capacity=16)  # starts at the hard capacity
    assert controller.update({"frame_lag_ms": 900.0}, active=4, now=0.0).changed == "decrease"
    assert controller.limit == pytest.approx(2.8)  # 0.7 x the 4 sessions present, not 0.7 x 16
    for t in range(1, 11):
        assert controller.update({"frame_lag_ms": 900.0}, active=4, now=float(t)).changed == "hold"
    assert controller.limit == pytest.approx(2.8) and not controller.admit(3)
    assert controller.update({"frame_lag_ms": 900.0}, active=2, now=11.0).changed == "decrease"  # in force: cut
    assert controller.limit == pytest.approx(1.4)


def test_the_limit_rises_only_after_settle_periods_of_quiet() -> None:
    """Lag signals come in bursts (a reply's wait shows once per turn): one quiet period is no evidence of
    spare capacity. With settle_periods=5 the limit rises once per 5 quiet periods, and any period over
    target starts the count again."""
    controller = Aimd(AimdConfig({"reply_lag_s": 0.65}, initial=2, settle_periods=5), capacity=16)
    changes = [controller.update({"reply_lag_s": 0.3}, active=2, now=float(t)).changed for t in range(10)]
    assert changes == ["hold"] * 4 + ["increase"] + ["hold"] * 5  # (after it, the limit 3 is not in use)
    controller = Aimd(AimdConfig({"reply_lag_s": 0.65}, initial=2, settle_periods=5), capacity=16)
    for t in range(4):
        controller.update({"reply_lag_s": 0.3}, active=2, now=float(t))
    assert controller.update({"reply_lag_s": 0.9}, active=3, now=4.0).changed == "hold"  # over, already refusing
    changes = [controller.update({"reply_lag_s": 0.3}, active=2, now=float(t)).changed for t in range(5, 10)]
    assert changes[-1] == "increase"
    assert controller.limit == 3


def test_a_limit_not_in_use_recovers_toward_its_start_with_time() -> None:
    """A cut left by a past spike must not outlive it: with nobody (or fewer than the limit) connected and
    nothing over target, the limit climbs back to `initial`, the whole way from the floor in `recover_s`."""
    controller = Aimd(AimdConfig({"asr_lag_s": 3.0}, initial=16, recover_s=30.0), capacity=16)
    assert controller.update({"asr_lag_s": 9.0}, active=1, now=0.0).changed == "decrease"
    assert controller.limit == 1.0 and not controller.admit(1)
    limits = [controller.update({"asr_lag_s": None}, active=0, now=1.0).limit]  # everyone left: no samples
    for t in range(2, 40):
        decision = controller.update({"asr_lag_s": None}, active=0, now=float(t))
        limits.append(controller.limit)
    assert decision.changed == "hold" and controller.limit == 16.0  # back at the start, and no further
    assert limits == sorted(limits) and limits[0] == pytest.approx(1.5)  # steady: 0.5 sessions/s
    assert limits.index(16.0) == 29  # t = 30: 30 s after the cut


def test_a_lightly_used_limit_recovers_but_not_while_a_signal_is_over() -> None:
    controller = Aimd(AimdConfig({"frame_lag_ms": TARGET_MS}, initial=8, recover_s=7.0), capacity=8)
    controller.update({"frame_lag_ms": 900.0}, active=4, now=0.0)
    assert controller.limit == pytest.approx(2.8)
    # One user left (the limit of 2 is not in use) and lag is under target: 1 session/s back toward 8.
    assert controller.update({"frame_lag_ms": 30.0}, active=1, now=1.0).changed == "recover"
    assert controller.limit == pytest.approx(3.8)
    assert controller.update({"frame_lag_ms": 500.0}, active=1, now=2.0).changed == "decrease"
    assert controller.limit == 1.0  # over target with the limit in force: cut, not recovered
    assert controller.update({"frame_lag_ms": 30.0}, active=0, now=3.0).limit == pytest.approx(2.0)


def test_a_cut_needs_the_overload_to_persist() -> None:
    """With confirm_periods=2, one period over target (a compile, another process) is noise; two in a row
    are an overload, and a quiet period between them starts the count again."""
    controller = Aimd(AimdConfig({"frame_lag_ms": TARGET_MS}, initial=8, confirm_periods=2), capacity=8)
    changes = []
    for t, lag in enumerate([900.0, 30.0, 900.0, 30.0, 900.0, 900.0]):
        changes.append(controller.update({"frame_lag_ms": lag}, active=8, now=float(t)).changed)
    assert changes == ["hold", "hold", "hold", "hold", "hold", "decrease"]
    assert controller.limit == pytest.approx(5.6)


def test_recovery_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        AimdConfig({"frame_lag_ms": 200.0}, confirm_periods=0)
    with pytest.raises(ValueError):
        AimdConfig({"frame_lag_ms": 200.0}, recover_s=0.0)
