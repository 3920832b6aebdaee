"""The Eloquent packetizer and its baselines, under every pattern of loss, reordering and duplication."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexd.transport.packetizer import (
    Ack,
    Duplicate,
    Eloquent,
    Packet,
    Receiver,
    Retransmit,
    SenderConfig,
    Token,
    make_sender,
)

SCHEMES = ["eloquent", "retransmit", "duplicate"]
WORDS = st.text(alphabet="abc xyz", min_size=0, max_size=12)

# One step of an adversarial network: the sender gets tokens, time passes, packets and acks are delivered
# (in any order, any number of times) or lost.
STEP = st.one_of(
    st.tuples(st.just("push"), st.lists(WORDS, min_size=1, max_size=4)),
    st.tuples(st.just("deliver"), st.integers(0, 1000), st.booleans()),  # (index, keep a copy in flight)
    st.tuples(st.just("drop"), st.integers(0, 1000)),
    st.tuples(st.just("ack"), st.integers(0, 1000), st.booleans()),  # (index, lost)
    st.tuples(st.just("time"), st.floats(0.0, 0.5)),
)


class Net:
    """Sender and receiver joined by an adversary that decides every packet's and ack's fate."""

    def __init__(self, scheme: str, config: SenderConfig) -> None:
        self.sender = make_sender(scheme, config)
        self.receiver = Receiver(window_tokens=config.max_tokens)
        self.now = 0.0
        self.sent: list[Token] = []  # every token pushed, in order
        self.rendered: list[Token] = []
        self.packets: list[Packet] = []
        self.acks: list[Ack] = []
        self.after_last: list[Packet] = []  # packets sent since the last push began

    def step(self, op: tuple) -> None:
        match op:
            case ("push", texts):
                reply = 1 + len(self.sent) // 5
                out = self.sender.push(reply, texts, self.now)
                first = self.sender.last_seq - len(texts) + 1
                self.sent.extend(Token(first + i, reply, t) for i, t in enumerate(texts))
                self.packets += out
                self.after_last = list(out)
            case ("deliver", i, keep) if self.packets:
                packet = self.packets[i % len(self.packets)] if keep else self.packets.pop(i % len(self.packets))
                self.deliver(packet)
            case ("drop", i) if self.packets:
                self.packets.pop(i % len(self.packets))
            case ("ack", i, lost) if self.acks:
                ack = self.acks.pop(i % len(self.acks))
                if not lost:
                    self.sender.ack(ack, self.now)
            case ("time", dt):
                self.now += dt
                out = self.sender.poll(self.now)
                self.packets += out
                self.after_last += out

    def deliver(self, packet: Packet) -> None:
        self.rendered += self.receiver.receive(packet)
        self.acks.append(self.receiver.ack())


def check_invariants(net: Net) -> None:
    # What the receiver renders is always a prefix of what was sent.
    assert net.rendered == net.sent[: len(net.rendered)]
    assert net.receiver.contiguous == len(net.rendered)
    c = net.sender.config
    assert net.sender.unacked <= c.max_tokens
    assert net.sender.buffered_bytes <= max(c.max_bytes, max((t.size_bytes for t in net.sent), default=0))


@pytest.mark.parametrize("scheme", SCHEMES)
@settings(max_examples=300, deadline=None)
@given(steps=st.lists(STEP, max_size=80), small=st.booleans())
def test_the_receiver_renders_a_prefix_of_what_was_sent(scheme: str, steps: list[tuple], small: bool) -> None:
    config = SenderConfig(max_tokens=6, max_bytes=96, max_packet_bytes=64) if small else SenderConfig()
    net = Net(scheme, config)
    for op in steps:
        net.step(op)
        check_invariants(net)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(STEP, max_size=80))
def test_eloquent_any_packet_after_the_last_token_completes_the_stream(steps: list[tuple]) -> None:
    net = Net("eloquent", SenderConfig())
    for op in steps:
        net.step(op)
    if not net.sent:
        return
    net.step(("time", 10.0))  # the tail timer: the unacknowledged tokens go out again
    assert net.after_last, "a push or the tail timer always sends the unacknowledged tokens"
    net.deliver(net.after_last[-1])  # any one of them: here the latest
    assert net.rendered == net.sent
    assert net.sender.evicted_through == 0


@pytest.mark.parametrize("scheme", SCHEMES)
@settings(max_examples=150, deadline=None)
@given(steps=st.lists(STEP, max_size=60), small=st.booleans())
def test_once_the_path_is_clean_every_scheme_delivers_everything(scheme: str, steps: list[tuple], small: bool) -> None:
    config = SenderConfig(max_tokens=64, max_bytes=4096, max_packet_bytes=64) if small else SenderConfig()
    net = Net(scheme, config)
    for op in steps:
        net.step(op)
    # From here every packet and ack gets through: timers and acks alone must finish the stream.
    net.packets.clear()
    for _ in range(200):
        if net.receiver.contiguous == len(net.sent) and not net.sender.unacked:
            break
        net.step(("time", net.sender.config.max_rto_s))
        for packet in net.packets:
            net.deliver(packet)
        net.packets.clear()
        for ack in net.acks:
            net.sender.ack(ack, net.now)
        net.acks.clear()
    assert net.rendered == net.sent
    assert net.sender.unacked == 0


def test_eloquent_carries_every_unacknowledged_token_until_it_went_twice() -> None:
    s = Eloquent()
    (p1,) = s.push(1, ["Hello"], now=0.0)
    (p2,) = s.push(1, [" there"], now=0.05)
    assert [t.text for t in p1.tokens] == ["Hello"] and [t.text for t in p2.tokens] == ["Hello", " there"]
    s.ack(Ack(1, p1.number), now=0.06)
    (p3,) = s.push(1, ["!"], now=0.1)
    assert [(t.seq, t.text) for t in p3.tokens] == [(2, " there"), (3, "!")]
    (p4,) = s.push(1, ["?"], now=0.12)
    assert [t.text for t in p4.tokens] == ["!", "?"]  # (" there" went out twice, and is not suspect)
    r = Receiver()
    assert [t.text for t in r.receive(p3)] == []  # token 1 missing: nothing renders past the gap
    assert [t.text for t in r.receive(p2)] == ["Hello", " there", "!"]


def test_retransmit_sends_each_token_once_until_its_rto() -> None:
    s = Retransmit(SenderConfig(initial_rto_s=0.2))
    (p1,) = s.push(1, ["a", "b"], now=0.0)
    (p2,) = s.push(1, ["c"], now=0.05)
    assert [t.text for t in p2.tokens] == ["c"]
    assert s.poll(0.19) == []
    s.ack(Ack(1, p1.number), now=0.1)  # RTT sample 0.1 s: RTO = 0.1 + 4 * 0.05 = 0.3 s
    assert s.rtt.rto_s == pytest.approx(0.3)
    assert s.poll(0.3) == []
    (again,) = s.poll(0.36)  # b (sent at 0) and c (sent at 0.05) are past 0.3 s
    assert [t.text for t in again.tokens] == ["b", "c"] and again.number > p2.number
    assert s.rtt.rto_s == pytest.approx(0.6)  # backed off


def test_duplicate_sends_every_packet_twice() -> None:
    s = Duplicate()
    out = s.push(1, ["a"], now=0.0)
    assert len(out) == 2 and out[0] == out[1]
    assert s.stats.packets == 2 and s.stats.bytes == 2 * out[0].size_bytes


def test_the_bound_forgets_the_oldest_and_the_receiver_stops_at_the_gap() -> None:
    s = Eloquent(SenderConfig(max_tokens=3))
    r = Receiver()
    packets = [s.push(1, [w], now=0.0)[0] for w in "abcde"]
    assert s.unacked == 3 and s.stats.evicted == 2 and s.evicted_through == 2
    (tail,) = s.poll(10.0)  # (the timeout: every unacknowledged token)
    assert [t.text for t in tail.tokens] == ["c", "d", "e"]
    assert r.receive(tail) == []  # a and b were lost for good: the prefix cannot grow past them
    assert r.receive(packets[0]) == [Token(1, 1, "a")]


def test_a_packet_never_exceeds_the_packet_size_and_carries_the_oldest_first() -> None:
    s = Eloquent(SenderConfig(max_packet_bytes=64))
    for i in range(10):
        (p,) = s.push(1, [f"word{i}"], now=0.0)
        assert p.size_bytes <= 64
    (tail,) = s.poll(10.0)
    assert tail.size_bytes <= 64 and tail.first_seq == 1


def test_acks_beyond_what_was_sent_are_clamped() -> None:
    s = Retransmit()
    s.push(1, ["a"], now=0.0)
    s.ack(Ack(99), now=0.01)
    assert s.unacked == 0
    s.push(1, ["b"], now=0.02)
    assert s.unacked == 1 and s.last_seq == 2


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SenderConfig(max_tokens=0)
    with pytest.raises(ValueError, match="RTO"):
        SenderConfig(min_rto_s=1.0, initial_rto_s=0.5)
    with pytest.raises(ValueError, match="repeat_after_s"):
        SenderConfig(repeat_after_s=0.01)  # (not below min_rto_s)
    with pytest.raises(ValueError, match="repeat_clean_packets"):
        SenderConfig(repeat_clean_packets=-1)
    with pytest.raises(ValueError, match="unknown transport scheme"):
        make_sender("carrier-pigeon")


def test_eloquent_repeats_the_newest_packet_unless_a_newer_one_goes_first() -> None:
    s = Eloquent(SenderConfig(repeat_after_s=0.005))
    (p1,) = s.push(1, ["a"], now=0.0)
    assert s.next_timer() == pytest.approx(0.005)
    assert s.poll(0.004) == []
    (again,) = s.poll(0.005)
    assert again.tokens == p1.tokens and again.number > p1.number and s.stats.repeats == 1
    assert s.poll(0.006) == [] and s.next_timer() == pytest.approx(0.005 + s.rtt.rto_s)  # (once: then the RTO)
    (p2,) = s.push(1, ["b"], now=0.05)
    assert [t.text for t in p2.tokens] == ["b"]  # (a, unacknowledged, went out twice and is not suspect yet)
    (p3,) = s.push(1, ["c"], now=0.052)  # before b's packet went again: c's packet carries b, and goes again
    (last,) = s.poll(0.057)
    assert [t.text for t in p3.tokens] == ["b", "c"] and s.stats.repeats == 2
    assert [t.text for t in last.tokens] == ["c"]  # (b has gone out twice)
    (p4,) = s.push(1, ["d"], now=0.3)  # a is suspect now (one RTO since it last went out): the packet has it
    assert [t.text for t in p4.tokens] == ["a", "b", "c", "d"]
    s.ack(Ack(4, p4.number), now=0.302)  # everything acknowledged before the repeat: nothing goes again
    assert s.poll(0.31) == [] and s.next_timer() is None


def test_eloquent_stops_repeating_on_a_clean_path_and_starts_again_at_a_loss() -> None:
    s = Eloquent(SenderConfig(repeat_clean_packets=3))
    r = Receiver()
    now = 0.0
    for word in "abc":  # each packet arrives and is acknowledged at once
        (p,) = s.push(1, [word], now)
        r.receive(p)
        s.ack(r.ack(), now + 0.001)
        now += 0.1
    assert not s.repeating and s.stats.repeats == 0
    s.push(1, ["d"], now)  # lost, and not repeated: the path had shown no loss
    assert s.next_timer() == pytest.approx(now + s.rtt.rto_s)
    (p,) = s.push(1, ["e"], now + 0.05)
    r.receive(p)
    s.ack(r.ack(), now + 0.06)  # the ack names a later packet than d's: d's was lost
    assert s.repeating and r.contiguous == 5
    s.push(1, ["f"], now + 0.1)
    assert len(s.poll(now + 0.105)) == 1 and s.stats.repeats == 1


def test_eloquent_never_repeats_with_repeats_off() -> None:
    s = Eloquent(SenderConfig(repeat_after_s=0))
    s.push(1, ["a"], now=0.0)
    assert not s.repeating and s.poll(0.01) == [] and s.next_timer() == pytest.approx(s.rtt.rto_s)


def test_eloquent_sends_more_copies_the_more_the_path_loses() -> None:
    s = Eloquent()
    assert s.token_copies == 2 and s.loss == 0.0
    now = 0.0
    for i in range(64):  # every other packet (or its ack) lost: the acks name every other packet
        (p,) = s.push(1, [f"w{i}"], now)
        if i % 2:
            s.ack(Ack(s.last_seq, p.number), now + 0.001)
        now += 0.1
    assert s.loss > 0.25 and s.token_copies == 4
    (first,) = s.push(1, ["x"], now)
    (repeat,) = s.poll(now + 0.005)
    (second,) = s.push(1, ["y"], now + 0.02)
    (third,) = s.push(1, ["z"], now + 0.04)
    assert [[t.text for t in p.tokens] for p in (first, repeat, second, third)] == [
        ["x"],
        ["x"],
        ["x", "y"],  # x's third and fourth copies ride in the next tokens' packets
        ["x", "y", "z"],
    ]
    for _ in range(100):  # a clean path again: the estimate decays, the copies come down to two
        (p,) = s.push(1, ["w"], now)
        s.ack(Ack(s.last_seq, p.number), now + 0.001)
        now += 0.1
    assert s.loss < 0.05 and s.token_copies == 2
