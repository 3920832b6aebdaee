"""The datagram path's wire format and the resume core: pure, no sockets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from duplexd.transport import datagram as dg
from duplexd.transport.packetizer import Ack, Packet, Token
from duplexd.transport.resume import SentAudio, new_resume_token, same_token

KEY = bytes(range(32))
TAG = b"8bytetag"


@given(
    number=st.integers(0, 2**32 - 1),
    first=st.integers(1, 2**31),
    items=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.text(max_size=20)), min_size=1, max_size=20),
)
def test_tokens_round_trip(number: int, first: int, items: list[tuple[int, str]]) -> None:
    packet = Packet(number, tuple(Token(first + i, r, t) for i, (r, t) in enumerate(items)))
    data = dg.encode(dg.Kind.TOKENS, TAG, 7, dg.encode_tokens(packet), KEY)
    got = dg.decode(data, KEY)
    assert (got.kind, got.tag, got.counter) == (dg.Kind.TOKENS, TAG, 7)
    assert dg.decode_tokens(got.payload) == packet


def test_a_datagram_with_a_wrong_key_or_a_flipped_bit_is_refused() -> None:
    data = dg.encode(dg.Kind.ACK, TAG, 1, dg.encode_ack(Ack(5, 9)), KEY)
    assert dg.decode_ack(dg.decode(data, KEY).payload) == Ack(5, 9)
    with pytest.raises(dg.DatagramError, match="MAC"):
        dg.decode(data, bytes(32))
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 1
        with pytest.raises(dg.DatagramError):
            dg.decode(bytes(flipped), KEY)


@given(junk=st.binary(max_size=200))
def test_junk_is_a_datagram_error_never_a_crash(junk: bytes) -> None:
    with pytest.raises(dg.DatagramError):
        dg.decode(junk, KEY)
    try:
        dg.decode_tokens(junk)
    except dg.DatagramError:
        pass


def test_a_payload_over_the_datagram_size_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        dg.encode(dg.Kind.TOKENS, TAG, 1, bytes(dg.MAX_PAYLOAD_BYTES + 1), KEY)


def test_sent_audio_resends_from_the_exact_sample() -> None:
    a = SentAudio(max_samples=10_000)
    for seq in range(1, 5):
        a.sent(seq, bytes([seq]) * 2 * 960)  # 4 frames of 960 samples
    frames, missing = a.since(1500)
    assert missing == 0 and [f.seq for f in frames] == [2, 3, 4]
    assert frames[0].start == 1500 and len(frames[0].pcm) == 2 * (1920 - 1500)
    assert sum(len(f.pcm) for f in frames) // 2 == a.end - 1500
    a.played(1920)  # frames 1 and 2 are played: not needed any more
    assert a.start == 1920
    frames, missing = a.since(1000)
    assert missing == 920 and frames[0].seq == 3


def test_sent_audio_is_bounded() -> None:
    a = SentAudio(max_samples=2000)
    for seq in range(1, 11):
        a.sent(seq, bytes(2 * 960))
    assert a.samples <= 2000 and a.end == 9600 and a.start == 9600 - 1920


def test_resume_tokens_are_random_and_compared_exactly() -> None:
    t = new_resume_token()
    assert len(t) >= 32 and t != new_resume_token()
    other = t[:-1] + ("y" if t.endswith("x") else "x")  # (a token ends in "x" one time in 64)
    assert same_token(t, t) and not same_token(other, t) and not same_token("", t)
