"""The transport benchmark's measurement: stall time, and one condition run through a real relay."""

from __future__ import annotations

import pytest

from duplexd.bench.transport import SCHEMES, TokenStream, run_condition, stall_time, summarize, table
from duplexd.transport.packetizer import SenderConfig


@pytest.mark.parametrize(
    ("due", "rendered", "expected"),
    [
        ([0.0, 1.0], [0.0, 1.0], 0.0),  # on time
        ([0.0, 1.0], [0.005, 1.005], 0.0),  # within the grace
        ([0.0, 1.0], [0.5, 1.0], 0.49),  # the first token late by 0.5 s
        ([0.0, 0.1, 0.2], [0.6, 0.6, 0.6], 0.59),  # one gap blocks three tokens: counted once
        ([0.0, 1.0], [0.3, 1.3], 0.58),  # two separate stalls
    ],
)
def test_stall_time_is_the_union_of_overdue_intervals(due, rendered, expected) -> None:
    assert stall_time(due, rendered, grace_s=0.01) == pytest.approx(expected)


async def test_one_condition_runs_every_scheme_through_the_relay() -> None:
    stream = TokenStream("q", tuple(f" w{i}" for i in range(30)), tuple(0.02 * i for i in range(30)))
    c = await run_condition([stream, stream], "bernoulli:0.2", rtt_ms=20, seed=3, config=SenderConfig())
    assert all(c["complete"][s] for s in SCHEMES)  # every token reached the receiver, whatever was lost
    assert all(c["measured_loss_down"][s] > 0 for s in SCHEMES)
    assert c["packets"]["duplicate"] > c["packets"]["retransmit"]  # every packet twice
    assert c["bytes_sent"]["eloquent"] > c["token_bytes"]
    summary = summarize([c])
    assert set(summary["bytes_overhead"]) == set(SCHEMES)
    assert "bernoulli:0.2" in table({"conditions": [c], "summary": summary})
