"""The loss simulator's pure core: loss models, specs, link delays. Deterministic (fixed seeds)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from duplexd.bench.loss import Bernoulli, GilbertElliott, Link, LinkConfig, LossModel, Trace, parse_loss

N = 200_000


def _loss_runs(pattern: list[bool]) -> list[int]:
    """Lengths of the runs of consecutive losses."""
    runs: list[int] = []
    n = 0
    for lost in pattern:
        if lost:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    if n:
        runs.append(n)
    return runs


@pytest.mark.parametrize("p", [0.0, 0.01, 0.1, 0.5, 1.0])
def test_bernoulli_rate(p: float) -> None:
    model = Bernoulli(p, seed=7)
    assert model.mean_loss == p
    rate = sum(Trace.record(model, N)) / N
    # 4 standard deviations of the binomial rate (0.0027 at p=0.5); exact at 0 and 1.
    assert abs(rate - p) <= 4 * math.sqrt(p * (1 - p) / N)


@pytest.mark.parametrize(("loss", "burst"), [(0.05, 4.0), (0.2, 2.0), (0.01, 1.0), (0.3, 10.0)])
def test_gilbert_elliott_from_mean_hits_loss_and_burst(loss: float, burst: float) -> None:
    model = GilbertElliott.from_mean(loss, burst, seed=3)
    assert model.mean_loss == pytest.approx(loss)
    assert model.mean_burst_packets == pytest.approx(burst)
    pattern = Trace.record(model, N)
    runs = _loss_runs(pattern)
    assert sum(pattern) / N == pytest.approx(loss, rel=0.08)
    assert sum(runs) / len(runs) == pytest.approx(burst, rel=0.06)
    if burst == 1.0:
        assert max(runs) == 1  # p_bad_good = 1: never two losses in a row


def test_gilbert_elliott_is_bursty_where_bernoulli_is_not() -> None:
    """Same mean loss, different structure: the invariant the GE model exists for."""
    ge = _loss_runs(Trace.record(GilbertElliott.from_mean(0.1, 5.0, seed=1), N))
    iid = _loss_runs(Trace.record(Bernoulli(0.1, seed=1), N))
    assert sum(ge) / len(ge) > 4.0
    assert sum(iid) / len(iid) < 1.2  # 1 / (1 - p) = 1.11


def test_gilbert_elliott_general_states() -> None:
    model = GilbertElliott(0.1, 0.3, seed=0, loss_good=0.02, loss_bad=0.5)
    assert model.bad_fraction == pytest.approx(0.25)
    assert model.mean_loss == pytest.approx(0.75 * 0.02 + 0.25 * 0.5)
    assert sum(Trace.record(model, N)) / N == pytest.approx(model.mean_loss, rel=0.05)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((1.0, 3.0), "loss"),
        ((-0.1, 3.0), "loss"),
        ((0.1, 0.5), "burst_packets"),
        ((0.1, math.inf), "burst_packets"),
        ((0.9, 1.0), "good runs"),  # needs p_good_bad = 9
    ],
)
def test_gilbert_elliott_from_mean_rejects(args: tuple[float, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GilbertElliott.from_mean(*args, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"p_good_bad": 1.5, "p_bad_good": 0.1}, "p_good_bad"),
        ({"p_good_bad": 0.1, "p_bad_good": -0.1}, "p_bad_good"),
        ({"p_good_bad": 0.0, "p_bad_good": 0.0}, "never moves"),
        ({"p_good_bad": 0.1, "p_bad_good": 0.1, "loss_bad": math.nan}, "loss_bad"),
    ],
)
def test_gilbert_elliott_rejects(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GilbertElliott(seed=0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("p", [-0.01, 1.01, math.nan])
def test_bernoulli_rejects(p: float) -> None:
    with pytest.raises(ValueError, match="p must be"):
        Bernoulli(p, seed=0)


@pytest.mark.parametrize(
    "make",
    [lambda seed: Bernoulli(0.3, seed), lambda seed: GilbertElliott.from_mean(0.2, 3.0, seed)],
)
def test_seeds_reproduce(make: Callable[[int], LossModel]) -> None:
    a = Trace.record(make(11), 5000)
    assert a == Trace.record(make(11), 5000)
    assert a != Trace.record(make(12), 5000)


def test_trace_replays_loops_or_ends_delivered() -> None:
    pattern = [True, False, False, True]
    assert Trace.record(Trace(pattern), 10) == pattern * 2 + pattern[:2]
    assert Trace.record(Trace(pattern, loop=False), 6) == pattern + [False, False]
    assert Trace(pattern).mean_loss == 0.5
    with pytest.raises(ValueError, match="empty"):
        Trace([])


def test_trace_save_load_round_trip(tmp_path: Path) -> None:
    pattern = Trace.record(GilbertElliott.from_mean(0.2, 3.0, seed=5), 1000)
    path = tmp_path / "t.trace"
    Trace.save(path, pattern, comment="ge:0.2:3 seed 5\nsecond line")
    text = path.read_text()
    assert text.startswith("# ge:0.2:3 seed 5\n# second line\n")
    loaded = Trace.load(path)
    assert list(loaded.pattern) == pattern
    assert Trace.record(loaded, 1000) == pattern


def test_trace_load_skips_blanks_and_comments(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    path.write_text("# recorded on wifi\n\n1\n0  # a comment after the value\n   \n  1\n#0\n0\n")
    assert Trace.load(path).pattern == (True, False, True, False)


@pytest.mark.parametrize(("bad", "line"), [("2", 4), ("yes", 4), ("0 1", 4), ("1.0", 4), ("-1", 4)])
def test_trace_load_bad_line_names_it(tmp_path: Path, bad: str, line: int) -> None:
    path = tmp_path / "t.trace"
    path.write_text(f"# header\n1\n\n{bad}\n0\n")
    with pytest.raises(ValueError, match=f"line {line}:.*{bad!r}"):
        Trace.load(path)


def test_trace_load_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    path.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no packets"):
        Trace.load(path)


def test_parse_loss_specs(tmp_path: Path) -> None:
    none = parse_loss("none", 0)
    assert isinstance(none, Bernoulli) and none.mean_loss == 0.0
    assert not any(Trace.record(none, 1000))
    bern = parse_loss("bernoulli:0.25", 0)
    assert isinstance(bern, Bernoulli) and bern.mean_loss == 0.25
    ge = parse_loss("ge:0.1:4", 0)
    assert isinstance(ge, GilbertElliott)
    assert ge.mean_loss == pytest.approx(0.1) and ge.mean_burst_packets == pytest.approx(4.0)
    path = tmp_path / "x:y.trace"  # a colon in the path is part of it
    Trace.save(path, [False, True])
    trace = parse_loss(f"trace:{path}", 0)
    assert isinstance(trace, Trace) and trace.pattern == (False, True)
    # The same spec and seed decide the same packets.
    assert Trace.record(parse_loss("ge:0.1:4", 9), 2000) == Trace.record(parse_loss("ge:0.1:4", 9), 2000)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "None",
        "none:0",
        "uniform:0.1",
        "bernoulli",
        "bernoulli:",
        "bernoulli:x",
        "bernoulli:1.5",
        "bernoulli:-0.1",
        "bernoulli:nan",
        "ge:0.1",
        "ge:0.1:0.5",
        "ge:1:3",
        "ge:0.1:3:4",
        "trace:",
        "trace:/nonexistent/duplexd.trace",
    ],
)
def test_parse_loss_rejects_naming_the_spec(spec: str) -> None:
    with pytest.raises(ValueError, match=f"bad loss spec {spec!r}"):
        parse_loss(spec, 0)


def test_loss_models_satisfy_the_protocol() -> None:
    models: list[LossModel] = [Bernoulli(0.1, 0), GilbertElliott.from_mean(0.1, 2.0, 0), Trace([True])]
    assert all(isinstance(m.lost(), bool) for m in models)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss": "bernoulli:2"}, r"link\.loss .*'bernoulli:2'"),
        ({"loss": "nope"}, r"link\.loss .*'nope'"),
        ({"rtt_ms": -1.0}, r"link\.rtt_ms .*-1\.0"),
        ({"rtt_ms": math.inf}, r"link\.rtt_ms"),
        ({"jitter_ms": -0.5}, r"link\.jitter_ms .*-0\.5"),
        ({"jitter_ms": math.nan}, r"link\.jitter_ms"),
        ({"seed": 1.5}, r"link\.seed .*1\.5"),
    ],
)
def test_link_config_rejects(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LinkConfig(**kwargs)  # type: ignore[arg-type]


def test_link_config_defaults_are_a_perfect_link() -> None:
    link = Link(LinkConfig(), 0)
    assert [link.admit(10.0) for _ in range(100)] == [10.0] * 100


def test_link_delay_without_jitter_is_half_the_rtt() -> None:
    link = Link(LinkConfig(rtt_ms=80.0), 0)
    for now in (0.0, 1.5, 1000.25):
        assert link.admit(now) == pytest.approx(now + 0.040)


def test_link_jitter_stays_in_bounds_and_spans_them() -> None:
    link = Link(LinkConfig(rtt_ms=100.0, jitter_ms=20.0, seed=4), 0)
    delays = [link.admit(5.0) - 5.0 for _ in range(20_000)]  # type: ignore[operator]
    assert all(0.030 - 1e-12 <= d <= 0.070 + 1e-12 for d in delays)
    assert min(delays) < 0.0305 and max(delays) > 0.0695  # uniform over the whole range, not a constant
    assert sum(delays) / len(delays) == pytest.approx(0.050, abs=0.0005)


def test_link_jitter_clips_at_zero_delay() -> None:
    link = Link(LinkConfig(rtt_ms=10.0, jitter_ms=20.0, seed=1), 0)  # 5 ms +- 20 ms
    times = [link.admit(2.0) for _ in range(10_000)]
    assert all(t is not None and t >= 2.0 for t in times)
    assert sum(t == 2.0 for t in times) > 2000  # P(5 + U(-20, 20) < 0) = 15 / 40
    assert max(times) > 2.024  # type: ignore[type-var]


def test_link_losses_follow_the_spec() -> None:
    assert all(t is None for t in (Link(LinkConfig(loss="bernoulli:1"), 0).admit(0.0) for _ in range(100)))
    link = Link(LinkConfig(loss="bernoulli:0.3", seed=2), 0)
    lost = sum(link.admit(0.0) is None for _ in range(N)) / N
    assert lost == pytest.approx(0.3, abs=0.005)


def test_link_directions_and_seeds_are_independent_but_reproducible() -> None:
    def fates(seed: int, offset: int) -> list[float | None]:
        link = Link(LinkConfig(loss="bernoulli:0.5", jitter_ms=10.0, rtt_ms=20.0, seed=seed), offset)
        return [link.admit(0.0) for _ in range(2000)]

    assert fates(1, 0) == fates(1, 0)
    assert fates(1, 0) != fates(1, 1)
    assert fates(1, 0) != fates(2, 0)


def test_outages_lose_the_stated_share_of_time_in_bursts_of_the_stated_length() -> None:
    from duplexd.bench.loss import Outages

    model = Outages(0.1, burst_ms=100, seed=5)
    dt = 0.001
    states = [model.lost_at(i * dt) for i in range(2_000_000)]  # 2000 s, one packet per millisecond
    assert sum(states) / len(states) == pytest.approx(0.1, abs=0.01)
    bursts, run = [], 0
    for lost in states:
        if lost:
            run += 1
        elif run:
            bursts.append(run * dt * 1000)
            run = 0
    assert sum(bursts) / len(bursts) == pytest.approx(100, rel=0.1)
    # Loss is decided by time, not by packet count: two packets at the same instant share their fate.
    again = Outages(0.1, burst_ms=100, seed=5)
    assert all(again.lost_at(t) == again.lost_at(t) for t in (0.0, 0.5, 1.0, 7.3))


def test_outage_specs_parse_and_reject_nonsense() -> None:
    from duplexd.bench.loss import Outages

    assert isinstance(parse_loss("outage:0.05:100", seed=1), Outages)
    for bad in ("outage:1:100", "outage:0.1:0", "outage:0.1", "outage:x:5"):
        with pytest.raises(ValueError, match="bad loss spec"):
            parse_loss(bad, seed=1)
