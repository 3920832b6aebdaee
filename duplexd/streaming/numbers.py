"""Numbers as they are said: "In 2013: 1913" is "in twenty thirteen nineteen thirteen". Pure.

The reply's text has digits, the loudspeaker says words, and Whisper writes what it hears back either way
("in 23", "teen.", "19th."): the echo check compares both sides in words (`spoken`). English, integers
(cardinals; ordinals "19th"; four-digit numbers from 1100 to 2099 outside 2000-2009 as years, as speech
engines read them); anything else is left as written.
"""

from __future__ import annotations

import re

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_ORDINAL = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth", "nine": "ninth"}
_ORDINAL |= {"twelve": "twelfth"}
_NUMBER = re.compile(r"^(\d{1,7})(st|nd|rd|th)?$")


def _below_1000(n: int) -> list[str]:
    words: list[str] = []
    if n >= 100:
        words += [_ONES[n // 100], "hundred"]
        n %= 100
        if not n:
            return words
    if n < 20:
        return words + [_ONES[n]]
    return words + [_TENS[n // 10]] + ([_ONES[n % 10]] if n % 10 else [])


def cardinal(n: int) -> list[str]:
    """0 <= n < 10**7 in words: 2013 -> two thousand thirteen."""
    if n < 1000:
        return _below_1000(n)
    words = cardinal(n // 1000) + ["thousand"] if n < 1_000_000 else cardinal(n // 1_000_000) + ["million"]
    rest = n % 1000 if n < 1_000_000 else n % 1_000_000
    return words + (cardinal(rest) if rest else [])


def year(n: int) -> list[str]:
    """1913 -> nineteen thirteen, 1900 -> nineteen hundred, 1905 -> nineteen oh five."""
    high, low = divmod(n, 100)
    if low == 0:
        return [*_below_1000(high), "hundred"]
    return _below_1000(high) + (["oh"] if low < 10 else []) + _below_1000(low)


def _ordinal(words: list[str]) -> list[str]:
    last = words[-1]
    if last in _ORDINAL:
        return words[:-1] + [_ORDINAL[last]]
    return words[:-1] + [last[:-1] + "ieth" if last.endswith("y") else last + "th"]


def spoken_word(word: str) -> list[str]:
    """One normalized word (lower case, no punctuation) as it is said: digits in words, else itself."""
    m = _NUMBER.match(word)
    if m is None:
        return [word]
    n = int(m.group(1))
    if m.group(2):
        return _ordinal(cardinal(n))
    if len(m.group(1)) == 4 and 1100 <= n <= 2099 and not 2000 <= n <= 2009:
        return year(n)
    return cardinal(n)


def spoken(words: list[str]) -> list[str]:
    """Normalized words with every number in words."""
    return [w for word in words for w in spoken_word(word)]
