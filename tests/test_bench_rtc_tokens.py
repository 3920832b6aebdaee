"""`duplexd bench webrtc-tokens`' pure parts: the answer routed through the loss relay, and the stall sums."""

from __future__ import annotations

import pytest

pytest.importorskip("aiortc")

from duplexd.bench.rtc_tokens import _summary, server_candidate, through

ANSWER = "\r\n".join(
    [
        "v=0",
        "m=audio 9 UDP/TLS/RTP/SAVPF 96",
        "a=candidate:a1 1 udp 2130706431 192.0.2.2 40000 typ host",
        "a=candidate:a2 1 udp 2130706431 fd00::2 40001 typ host",
        "a=end-of-candidates",
        "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
        "a=candidate:a1 1 udp 2130706431 192.0.2.2 40000 typ host",
        "",
    ]
)


def test_the_answer_goes_through_the_relay_only() -> None:
    assert server_candidate(ANSWER) == ("192.0.2.2", 40000)
    routed = through(ANSWER, ("192.0.2.2", 50000))
    candidates = [line for line in routed.split("\r\n") if line.startswith("a=candidate:")]
    assert candidates == ["a=candidate:1 1 udp 2130706431 192.0.2.2 50000 typ host"] * 2  # (one per section)
    assert routed.count("m=") == 2 and "40000" not in routed
    with pytest.raises(RuntimeError, match="IPv4"):
        server_candidate("v=0\r\n")


def test_the_summary_counts_how_far_the_events_channel_alone_falls_behind_the_merge() -> None:
    relay = {"down_lost": 3, "down_received": 100}
    runs = [
        # the second token's packet lost: the events channel waits for its retransmission (and holds the third
        # behind it), the next unreliable packet carried both
        {"tokens": 3, "events": [0.10, 0.50, 0.50], "merged": [0.10, 0.25, 0.30], "relay": relay},
        {"tokens": 1, "events": [1.0], "merged": [1.0], "relay": relay},
    ]
    summary = _summary(runs)
    assert (summary["replies"], summary["tokens"], summary["down_lost"]) == (2, 4, 6)
    assert summary["earlier_share"] == 0.5 and summary["lead_max_ms"] == 250.0
    assert summary["lead_p50_ms"] == pytest.approx(100.0)
    # behind from 0.26 to 0.5 (the third is due at 0.31, already covered), over spans 0.4 + 0.0
    assert summary["events_behind_ratio"] == pytest.approx((0.5 - 0.26) / 0.4, abs=1e-3)
    assert _summary([])["lead_p50_ms"] is None
