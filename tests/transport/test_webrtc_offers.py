"""What a request to place a WebRTC call may carry (no models, no network): the offer as `application/sdp`
or as the multipart form OpenAI's SDK and `clients.rtc.post_offer` send, and client secrets' expiry."""

from __future__ import annotations

import json
import types

import pytest

pytest.importorskip("aiortc")

from duplexd.clients.rtc import _part
from duplexd.config import ServerConfig
from duplexd.transport import webrtc
from duplexd.transport.webrtc import CallError, Calls, _offer

OFFER = "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n"


def form(*parts: tuple[str, str, str]) -> tuple[bytes, str]:
    boundary = "b0undary"
    body = "".join(_part(boundary, *p) for p in parts) + f"--{boundary}--\r\n"
    return body.encode(), f"multipart/form-data; boundary={boundary}"


def test_the_offer_comes_as_sdp_or_as_a_form_with_the_sessions_settings() -> None:
    assert _offer(OFFER.encode(), "application/sdp") == (OFFER, None)
    session = {"type": "realtime", "instructions": "Be brief."}
    body, kind = form(("sdp", "application/sdp", OFFER), ("session", "application/json", json.dumps(session)))
    assert _offer(body, kind) == (OFFER, session)
    body, kind = form(("sdp", "application/sdp", OFFER))
    assert _offer(body, kind) == (OFFER, None)


@pytest.mark.parametrize(
    ("body", "kind", "status", "code"),
    [
        (OFFER.encode(), "text/plain", 415, "unsupported_media_type"),
        (b"not sdp", "application/sdp", 400, "invalid_offer"),
        (b"\xff\xfe", "application/sdp", 400, "invalid_offer"),
        (*form(("session", "application/json", "{}")), 400, "missing_required_parameter"),
        (*form(("sdp", "application/sdp", OFFER), ("session", "application/json", "[1]")), 400, "invalid_json"),
    ],
)
def test_an_offer_that_cannot_be_read_says_why(body: bytes, kind: str, status: int, code: str) -> None:
    with pytest.raises(CallError) as refused:
        _offer(body, kind)
    assert (refused.value.status, refused.value.code) == (status, code)


def test_a_client_secret_carries_its_settings_until_it_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(types.SimpleNamespace(config=ServerConfig()))  # type: ignore[arg-type]
    now = [1_000_000.0]
    monkeypatch.setattr(webrtc.time, "time", lambda: now[0])
    made = calls.new_secret(json.dumps({"expires_after": {"seconds": 60}, "session": {"instructions": "Hi."}}).encode())
    assert made["expires_at"] == 1_000_060 and made["session"]["instructions"] == "Hi."
    secret = calls.secret(made["value"])
    assert secret is not None and secret.session is not None and secret.session.instructions == "Hi."
    assert calls.secret("ek_not_one") is None and calls.secret(None) is None
    now[0] += 60
    assert calls.secret(made["value"]) is None  # (expired: forgotten)
    for seconds in (5, 7201, "60", True):
        with pytest.raises(CallError, match="expires_after"):
            calls.new_secret(json.dumps({"expires_after": {"seconds": seconds}}).encode())
    with pytest.raises(CallError) as bad:
        calls.new_secret(b"{not json")
    assert bad.value.code == "invalid_json"
