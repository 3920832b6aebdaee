"""Who may connect and how much they may send: pure checks the HTTP/WebSocket shell applies.

- `authorized`: the bearer key, from `Authorization: Bearer KEY` or (browsers cannot set headers on a
  WebSocket) the `token` / `api_key` query parameter; compared in constant time.
- `origin_allowed`: browsers send `Origin`; a non-empty allow-list refuses the others (clients that are not
  browsers send none and are judged by the key alone).
- `AudioRateLimit`: input audio may run ahead of real time by at most `burst_s`; beyond that a frame is
  refused with an error instead of growing a backlog.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs, urlsplit


def request_key(authorization: str | None, path: str) -> str | None:
    """The key a request presents (header first), or None."""
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    query = parse_qs(urlsplit(path).query)
    for name in ("token", "api_key"):
        if query.get(name):
            return query[name][0]
    return None


def authorized(expected: str, authorization: str | None, path: str) -> bool:
    if not expected:
        return True
    given = request_key(authorization, path)
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def origin_allowed(allowed: frozenset[str], origin: str | None) -> bool:
    return not allowed or origin is None or origin.rstrip("/") in allowed


class AudioRateLimit:
    """Audio seconds accepted may exceed wall-clock seconds since the first frame by at most `burst_s`."""

    def __init__(self, burst_s: float) -> None:
        if burst_s < 0:
            raise ValueError(f"burst_s must be >= 0, got {burst_s!r}")
        self.burst_s = burst_s
        self._start: float | None = None
        self.audio_s = 0.0
        self.refused = 0

    def allow(self, duration_s: float, now: float) -> bool:
        """Take `duration_s` of audio arriving at `now`, or refuse it (nothing is taken then)."""
        if self.burst_s == 0:
            return True
        if self._start is None:
            self._start = now
        if self.audio_s + duration_s > (now - self._start) + self.burst_s:
            self.refused += 1
            return False
        self.audio_s += duration_s
        return True

    def ahead_s(self, now: float) -> float:
        return 0.0 if self._start is None else self.audio_s - (now - self._start)
