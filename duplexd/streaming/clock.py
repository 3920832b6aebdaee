"""Where the client's playback of the reply audio is. Pure: time is passed in.

The output stream is counted in samples (24 kHz), the client's `playback.played_ms` timeline. A client that
reports its playback anchors the clock; between reports (and for clients that never report, such as OpenAI
Realtime clients) playback is assumed to run in real time from the last anchor, never past what was sent.
"""

from __future__ import annotations

from duplexd.tts.engine import OUTPUT_SAMPLE_RATE


class PlaybackClock:
    def __init__(self, now: float, *, rate: int = OUTPUT_SAMPLE_RATE) -> None:
        """The same for every client: reports (the native protocol) and the server's anchors (`anchor`,
        `rebase`) correct the real-time assumption; a client that never reports has only the anchors."""
        self.rate = rate
        self._anchor: tuple[int, float] | None = None  # (samples played, when): a report, a known position
        # or, while held, the estimate where the pause began
        self._known: int | None = None  # the last report or known position (never an estimate)
        self._virtual = 0  # samples played by the assumed real-time client, before any anchor
        self._virtual_at = now
        self._held = False  # the client paused playback: its position stays where it was

    @property
    def reported(self) -> int | None:
        """Samples played at the last report or known position (None: none yet). Not the position estimated
        where a pause began: that runs ahead of the client whenever its last report is late, and the client's
        next report, which is the truth, may be below it."""
        return self._known

    def played(self, sent: int, now: float) -> int:
        """Samples played by `now`, of the `sent` sent so far."""
        if self._held:
            return min(sent, self._anchor[0] if self._anchor is not None else self._virtual)
        if self._anchor is not None:
            samples, at = self._anchor
            played = min(sent, samples + int((now - at) * self.rate))
            if played == sent:
                # Played to the end: from here the client waits, and the wait must not count as playing, or
                # the next reply's audio would be taken as played the moment it went out (it would be sent
                # all at once, and its reply over before the user heard it: nothing could interrupt it). A
                # client that reports does not report while it waits (its position does not move), so its
                # next report comes only once that audio plays: no report corrects the estimate in time.
                self._anchor = (played, now)
            return played
        self._virtual = min(sent, self._virtual + int((now - self._virtual_at) * self.rate))
        self._virtual_at = now
        return self._virtual

    def report(self, samples: int, now: float) -> None:
        """The client says it has played `samples` (never behind its last report or a known position)."""
        self._known = max(samples, self._known or 0)
        self._anchor = (self._known, now)

    def anchor(self, samples: int, now: float) -> None:
        """The server knows the client's position: `samples` played at `now` (a truncate, a reply the client
        takes as over)."""
        self._anchor = (samples, now)
        self._known = samples

    def rebase(self, sent: int, now: float) -> None:
        """The client skips what it had not played (a stopped reply): it is at the end of what it received."""
        self._virtual = sent
        if self._anchor is not None:
            self._anchor = (sent, now)
            self._known = sent

    def hold(self, sent: int, now: float) -> None:
        """The client pauses playback (`reply.paused`): the position stops where it is estimated now; reports
        move it, either way (the client stops a little after the server says so, and its last report may
        be older than the estimate)."""
        if not self._held:
            self._anchor = (self.played(sent, now), now)
            self._held = True

    def release(self, now: float) -> None:
        """The client plays on from where it paused."""
        if self._held:
            self._held = False
            self.resume(now)

    def resume(self, now: float) -> None:
        """A new connection: the client plays on from where it was; until it reports, real time from now."""
        played = self._anchor[0] if self._anchor is not None else self._virtual
        self._anchor = (played, now)
        self._virtual, self._virtual_at = played, now
