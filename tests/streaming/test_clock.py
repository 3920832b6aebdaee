"""The playback clock: reports anchor it, real time runs on between them, never past what was sent."""

from __future__ import annotations

from duplexd.streaming.clock import PlaybackClock

R = 1000  # samples per second, for round numbers


def test_without_reports_playback_runs_in_real_time_up_to_what_was_sent() -> None:
    clock = PlaybackClock(0.0, rate=R)
    assert clock.played(sent=5000, now=2.0) == 2000
    assert clock.played(sent=5000, now=9.0) == 5000  # (not past the end)
    assert clock.reported is None


def test_a_report_anchors_the_clock_and_never_goes_back() -> None:
    clock = PlaybackClock(0.0, rate=R)
    clock.report(1500, now=3.0)  # (the client is behind the real-time guess)
    assert clock.played(sent=9000, now=4.0) == 2500
    clock.report(1000, now=5.0)
    assert clock.reported == 1500 and clock.played(sent=9000, now=5.0) == 1500


def test_a_client_that_never_reports_does_not_play_while_it_waits() -> None:
    """Played to the end, a Realtime client waits for more: the wait must not count as playback, or the
    next reply would be paced that much too fast."""
    waits = PlaybackClock(0.0, rate=R)
    waits.anchor(0, now=0.0)
    assert waits.played(sent=1000, now=5.0) == 1000  # (ended at 1 s, then waited 4 s)
    assert waits.played(sent=3000, now=6.0) == 2000  # the next reply starts now, not 4 s "played" already


def test_a_reporting_client_does_not_play_while_it_waits_either() -> None:
    """A client that reports its playback says nothing while it waits (its position does not move): its
    last report, before the wait, must not run on through it. The bench's client reports 0 ms as the
    session opens; a 3.9 s reply that came 4.7 s later was taken as played the moment it was sent, its
    reply over at once, and the user saying the question again over it paused nothing."""
    clock = PlaybackClock(0.0, rate=R)
    clock.report(0, now=0.0)
    assert clock.played(sent=0, now=4.5) == 0  # (the shell asks before it sends the reply's audio)
    assert clock.played(sent=3900, now=4.75) == 250  # not 3900: the reply began to play at 4.5 s
    clock.report(100, now=5.0)  # (the client's jitter buffer: it is behind the estimate, and says so)
    assert clock.played(sent=3900, now=5.25) == 350


def test_a_stopped_reply_jumps_the_client_to_the_end_of_what_it_received() -> None:
    clock = PlaybackClock(0.0, rate=R)
    assert clock.played(sent=4000, now=1.0) == 1000
    clock.rebase(4000, now=1.0)
    assert clock.played(sent=4000, now=1.0) == 4000
    anchored = PlaybackClock(0.0, rate=R)
    anchored.report(500, now=1.0)
    anchored.rebase(4000, now=2.0)
    assert anchored.reported == 4000 and anchored.played(sent=6000, now=3.0) == 5000


def test_a_resume_plays_on_from_the_last_position_in_real_time_from_then() -> None:
    clock = PlaybackClock(0.0, rate=R)
    clock.report(2000, now=2.0)
    clock.resume(now=10.0)  # (8 s away: the client played nothing meanwhile)
    assert clock.played(sent=9000, now=11.0) == 3000


def test_a_held_clock_stays_where_the_client_paused_and_plays_on_from_there() -> None:
    clock = PlaybackClock(0.0, rate=R)
    clock.anchor(0, now=0.0)
    clock.hold(sent=9000, now=1.5)
    assert clock.played(sent=9000, now=4.0) == 1500  # paused 2.5 s: nothing played
    clock.release(now=4.0)
    assert clock.played(sent=9000, now=5.0) == 2500
    reports = PlaybackClock(0.0, rate=R)
    reports.report(1000, now=1.0)
    reports.hold(sent=9000, now=1.2)
    reports.report(1300, now=1.5)  # (the client stopped a little after the server said so)
    assert reports.played(sent=9000, now=3.0) == 1300
    reports.release(now=3.0)
    assert reports.played(sent=9000, now=3.5) == 1800


def test_a_report_below_the_position_estimated_at_a_pause_is_the_truth() -> None:
    # The browser test's bad_playback: the server paused the reply at its real-time estimate (4374.9 ms),
    # ahead of the client's last report; the client then reported where it really stopped (4371.1 ms).
    clock = PlaybackClock(0.0, rate=R)
    clock.report(1000, now=1.0)
    clock.hold(sent=9000, now=1.5)  # estimated: 1500
    assert clock.reported == 1000  # (the bound a report is checked against: the client's own)
    clock.report(1400, now=1.6)
    assert clock.played(sent=9000, now=3.0) == 1400 and clock.reported == 1400
    clock.release(now=3.0)
    assert clock.played(sent=9000, now=3.5) == 1900
