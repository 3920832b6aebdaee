"""LocalAgreement-n: what a sequence of window hypotheses commits, and when."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplexd.asr.commit import LocalAgreement, norm
from duplexd.events import Word


def hyp(spec: str, start: float = 0.0, step: float = 0.5, dur: float = 0.3) -> list[Word]:
    """Words of `spec` (space separated), the i-th starting at start + i*step."""
    return [Word(t, round(start + i * step, 6), round(start + i * step + dur, 6)) for i, t in enumerate(spec.split())]


def texts(words: list[Word]) -> list[str]:
    return [w.text for w in words]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Americans,", "americans"),
        ("Hello", "hello"),
        ("don't", "don't"),
        ("U.S.", "us"),
        ("...", ""),
        ("¿Qué?", "qué"),
        ("42%", "42"),
    ],
)
def test_norm_drops_case_and_punctuation(raw: str, expected: str) -> None:
    assert norm(raw) == expected


def test_n_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="n must be >= 1"):
        LocalAgreement(0)


# Each case: n, the hypotheses (all starting at the window start, 0.5 s per word), and what each commits.
AGREEMENT_CASES = [
    pytest.param(2, ["the cat sat"], [[]], id="n2-first-hypothesis-alone-commits-nothing"),
    pytest.param(2, ["the cat sat", "the cat sits on"], [[], ["the", "cat"]], id="n2-common-prefix-only"),
    pytest.param(2, ["the cat sat", "a cat sat"], [[], []], id="n2-first-word-differs"),
    pytest.param(
        2,
        ["the cat sat", "the cat sits on", "the cat sits on the", "the cat sits on the mat"],
        [[], ["the", "cat"], ["sits", "on"], ["the"]],
        id="n2-progressive",
    ),
    pytest.param(1, ["the cat sat"], [["the", "cat", "sat"]], id="n1-commits-everything"),
    pytest.param(1, ["the cat", "the cat sat on"], [["the", "cat"], ["sat", "on"]], id="n1-commits-new-words"),
    pytest.param(3, ["the cat sat", "the cat sat"], [[], []], id="n3-two-agreeing-are-not-enough"),
    pytest.param(3, ["the cat sat", "the cat sat", "the cat sat on"], [[], [], ["the", "cat", "sat"]], id="n3-three"),
    pytest.param(3, ["the cat", "the dog", "the dog"], [[], [], ["the"]], id="n3-prefix-of-all-three"),
    pytest.param(
        2,
        ["Hello, World", "hello world!"],
        [[], ["hello", "world!"]],
        id="n2-punctuation-and-case-agree-latest-spelling-wins",
    ),
]


@pytest.mark.parametrize(("n", "hypotheses", "commits"), AGREEMENT_CASES)
def test_agreement(n: int, hypotheses: list[str], commits: list[list[str]]) -> None:
    la = LocalAgreement(n)
    got = [texts(la.insert(hyp(h))) for h in hypotheses]
    assert got == commits


def test_tentative_is_the_uncommitted_rest_of_the_latest_hypothesis() -> None:
    la = LocalAgreement(2)
    la.insert(hyp("a b c"))
    assert texts(la.tentative) == ["a", "b", "c"]
    assert texts(la.insert(hyp("a b c d e"))) == ["a", "b", "c"]
    assert texts(la.tentative) == ["d", "e"]
    assert la.committed_end_s == pytest.approx(1.3)
    assert texts(la.insert(hyp("a b c d x"))) == ["d"]
    assert texts(la.tentative) == ["x"]


def test_committed_word_keeps_its_time_from_the_latest_hypothesis() -> None:
    la = LocalAgreement(2)
    la.insert([Word("hi", 0.10, 0.40)])
    assert la.insert([Word("hi", 0.12, 0.42), Word("there", 0.6, 0.9)]) == [Word("hi", 0.12, 0.42)]
    assert la.committed_end_s == pytest.approx(0.42)


def test_words_starting_before_the_committed_end_are_ignored() -> None:
    la = LocalAgreement(1)
    assert texts(la.insert([Word("one", 0.0, 0.5), Word("two", 0.5, 1.0)])) == ["one", "two"]
    # committed end 1.0; tolerance 0.1: a word must start after 0.9 to count.
    late = [Word("x", 0.5, 0.8), Word("y", 0.85, 1.2), Word("z", 0.95, 1.3), Word("w", 1.4, 1.7)]
    assert texts(la.insert(late)) == ["z", "w"]


def test_old_words_do_not_block_agreement_on_new_ones() -> None:
    # The window still starts at 0: each pass re-recognises committed words, which must not count.
    la = LocalAgreement(2)
    la.insert(hyp("a b"))
    la.insert(hyp("a b c"))  # commits a b
    assert texts(la.insert(hyp("A B c d"))) == ["c"]
    assert texts(la.insert(hyp("a b c d e"))) == ["d"]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_rerecognised_committed_tail_is_not_committed_twice(size: int) -> None:
    # Committed: w0..w5, ending at 2.8. The next pass re-hears the last `size` words with times that start
    # after the committed end (a shifted window), then says one new word.
    la = LocalAgreement(1)
    first = hyp("w0 w1 w2 w3 w4 w5")
    assert la.insert(first) == first
    tail = [w.text.upper() + "," for w in first[-size:]]
    again = hyp(" ".join([*tail, "new"]), start=2.75, step=0.05, dur=0.04)
    assert texts(la.insert(again)) == ["new"]


def test_rerecognised_tail_with_n2_commits_only_the_new_word() -> None:
    la = LocalAgreement(2)
    la.insert(hyp("sat on the mat"))
    la.insert(hyp("sat on the mat"))  # commits all four, end 1.8
    shifted = [Word("the", 1.75, 1.9), Word("mat", 1.95, 2.2), Word("today", 2.4, 2.8)]
    assert la.insert(shifted) == []
    assert texts(la.insert(shifted)) == ["today"]


def test_a_real_repetition_later_is_committed() -> None:
    # The dedup only looks at the hypothesis' head within 1 s of the committed end.
    la = LocalAgreement(1)
    la.insert([Word("no", 0.0, 0.4)])
    assert texts(la.insert([Word("no", 2.0, 2.4)])) == ["no"]


def test_a_non_matching_head_is_kept() -> None:
    la = LocalAgreement(1)
    la.insert(hyp("a b c"))
    assert texts(la.insert(hyp("b d", start=1.35))) == ["b", "d"]  # "b d" is not a tail of "a b c"


def test_commit_all_commits_the_latest_hypothesis() -> None:
    la = LocalAgreement(2)
    la.insert(hyp("one two three"))
    assert texts(la.commit_all()) == ["one", "two", "three"]
    assert la.tentative == []
    assert la.committed_end_s == pytest.approx(1.3)
    assert la.commit_all() == []


def test_commit_all_after_a_partial_commit() -> None:
    la = LocalAgreement(2)
    la.insert(hyp("a b"))
    assert texts(la.insert(hyp("a b c d"))) == ["a", "b"]
    assert texts(la.commit_all()) == ["c", "d"]


@pytest.mark.parametrize(
    ("t_s", "expected"),
    [
        (0.0, []),
        (0.29, []),
        (0.3, ["a"]),  # a word ending exactly at t counts
        (1.29, ["a", "b"]),
        (1.3, ["a", "b", "c"]),
        (99.0, ["a", "b", "c"]),
    ],
)
def test_commit_until(t_s: float, expected: list[str]) -> None:
    la = LocalAgreement(2)
    la.insert(hyp("a b c"))
    assert texts(la.commit_until(t_s)) == expected
    assert texts(la.tentative) == ["a", "b", "c"][len(expected) :]


def test_commit_until_stops_at_the_first_word_ending_late() -> None:
    la = LocalAgreement(2)
    la.insert([Word("long", 0.0, 2.0), Word("short", 0.5, 0.8)])
    assert la.commit_until(1.0) == []


def test_commit_until_forgets_earlier_hypotheses() -> None:
    la = LocalAgreement(2)
    la.insert(hyp("a b c d"))
    assert texts(la.commit_until(0.8)) == ["a", "b"]
    # Only one hypothesis is seen after the forced commit: nothing agrees yet.
    assert la.insert(hyp("a b c d")) == []
    assert texts(la.insert(hyp("a b c d"))) == ["c", "d"]


def test_reset_forgets_hypotheses_but_not_the_committed_end() -> None:
    la = LocalAgreement(2)
    la.insert(hyp("a b c"))
    la.insert(hyp("a b x"))  # commits a b (end 0.8)
    la.reset()
    assert la.tentative == []
    assert la.committed_end_s == pytest.approx(0.8)
    assert la.insert(hyp("a b x y")) == []  # agreement starts over
    assert texts(la.tentative) == ["x", "y"]  # a b start before the committed end
    assert texts(la.insert(hyp("a b x y"))) == ["x", "y"]


def test_reset_before_agreement_means_no_commit() -> None:
    la = LocalAgreement(2)
    la.insert(hyp("a b"))
    la.reset()
    assert la.insert(hyp("a b")) == []


# -- properties ---------------------------------------------------------------------------------------

# A "true" transcript: word k lives around 0.5*k s. Each hypothesis is a slice of it, seen with per-word
# jitter (<= 50 ms), a random spelling variant, or a wrong word; sometimes the window restarts at 0.
_VOCAB = ["the", "a", "cat", "sat", "on", "mat", "no", "yes"]
_STEP = 0.5


@st.composite
def noisy_hypotheses(draw: st.DrawFn) -> tuple[int, list[list[Word]]]:
    n_truth = draw(st.integers(1, 24))
    truth = draw(st.lists(st.sampled_from(_VOCAB), min_size=n_truth, max_size=n_truth))
    durations = draw(st.lists(st.floats(0.2, 0.35), min_size=n_truth, max_size=n_truth))
    hyps: list[list[Word]] = []
    for _ in range(draw(st.integers(1, 10))):
        lo = draw(st.integers(0, n_truth - 1))
        hi = draw(st.integers(lo, n_truth))
        jitters = draw(st.lists(st.sampled_from([-0.05, -0.02, 0.0, 0.03, 0.05]), min_size=hi - lo, max_size=hi - lo))
        variants = draw(st.lists(st.integers(0, 3 + len(_VOCAB)), min_size=hi - lo, max_size=hi - lo))
        words = []
        for k, jitter, variant in zip(range(lo, hi), jitters, variants, strict=True):
            # 0: as is, 1: capitalised, 2: with a comma, 3: as is again, 4+: a (likely) wrong word
            text = [truth[k], truth[k].capitalize(), truth[k] + ",", truth[k], *_VOCAB][variant]
            start = _STEP * k + jitter
            words.append(Word(text, start, start + durations[k]))
        hyps.append(words)
    return draw(st.integers(1, 3)), hyps


def _index(word: Word) -> int:
    return round(word.start_s / _STEP)


@settings(max_examples=100, deadline=None)
@given(noisy_hypotheses(), st.booleans())
def test_commits_are_final_ordered_and_unique(case: tuple[int, list[list[Word]]], finish: bool) -> None:
    n, hyps = case
    la = LocalAgreement(n)
    committed: list[Word] = []
    last_end = 0.0
    for h in hyps:
        newly = la.insert(h)
        assert all(w in h for w in newly)  # only words the hypothesis said
        committed.extend(newly)
        assert la.committed_end_s >= last_end  # never un-committed
        last_end = la.committed_end_s
        if committed:
            # what is tentative lies after everything committed
            assert all(_index(w) > _index(committed[-1]) for w in la.tentative)
    if finish:
        committed.extend(la.commit_all())
    starts = [w.start_s for w in committed]
    assert starts == sorted(starts)
    indices = [_index(w) for w in committed]
    assert len(indices) == len(set(indices))  # each true word committed at most once


@st.composite
def growing_windows(draw: st.DrawFn) -> tuple[int, list[int], int]:
    n_truth = draw(st.integers(1, 25))
    ends = draw(st.lists(st.integers(0, n_truth), min_size=1, max_size=12))
    return draw(st.integers(1, 3)), ends, n_truth


@settings(max_examples=150, deadline=None)
@given(growing_windows())
def test_committed_plus_tentative_is_the_latest_hypothesis(case: tuple[int, list[int], int]) -> None:
    """With exact hypotheses (all from the window start 0), nothing is lost or duplicated between the
    committed words and the tentative rest."""
    n, ends, n_truth = case
    truth = hyp(" ".join(f"w{k}" for k in range(n_truth)))
    la = LocalAgreement(n)
    committed: list[Word] = []
    for end in ends:
        committed.extend(la.insert(truth[:end]))
        assert committed == truth[: len(committed)]
        if end >= len(committed):
            assert committed + la.tentative == truth[:end]
        else:
            assert la.tentative == []
    before = len(committed)
    committed.extend(la.commit_all())
    assert committed == truth[: max(before, ends[-1])]


def test_a_word_whose_start_jittered_before_the_committed_end_is_kept() -> None:
    """Timestamps move between passes: 'circumstances' now starts before where 'the' used to end."""
    la = LocalAgreement(2)
    first = [Word("nor", 4.6, 4.7), Word("of", 4.7, 4.88), Word("the", 4.88, 5.26)]
    la.insert(first)
    assert texts(la.insert(first)) == ["nor", "of", "the"]
    assert la.committed_end_s == pytest.approx(5.26)
    moved = [Word("nor", 4.58, 4.7), Word("of", 4.7, 4.84), Word("the", 4.84, 5.02), Word("circumstances", 5.02, 5.5)]
    assert la.insert(moved) == []
    assert texts(la.tentative) == ["circumstances"]  # found after the committed "of the", not dropped by time


def test_one_shared_word_does_not_pull_the_cut_back() -> None:
    """A single common word before the time cut is not taken for the committed tail."""
    la = LocalAgreement(1)
    la.insert([Word("a", 0.0, 0.2), Word("the", 0.2, 0.5)])
    got = la.insert([Word("the", 0.0, 0.1), Word("cat", 0.6, 0.9)])
    assert texts(got) == ["cat"]


def test_a_word_starting_exactly_the_tolerance_before_the_committed_end_is_not_committed_again() -> None:
    # Found by the property test above: the same word read "a" (9.95-10.15 s, the end as float arithmetic
    # left it) then "the" from 10.05 s; 10.15 - 0.1 rounds below 10.05, and both were committed.
    la = LocalAgreement(1)
    assert la.insert([Word("a", 9.95, 10.149999999999999)])
    assert la.insert([Word("the", 10.05, 10.25)]) == []
