"""Numbers as they are said (the echo check compares the reply's digits with what Whisper heard)."""

from __future__ import annotations

import pytest

from duplexd.streaming.numbers import spoken


@pytest.mark.parametrize(
    ("written", "said"),
    [
        ("in 2013 1913", "in twenty thirteen nineteen thirteen"),
        ("1900 1905 2005 2100", "nineteen hundred nineteen oh five two thousand five two thousand one hundred"),
        ("0 7 13 20 42 100 115", "zero seven thirteen twenty forty two one hundred one hundred fifteen"),
        ("1000 999999", "one thousand nine hundred ninety nine thousand nine hundred ninety nine"),
        ("1234567", "one million two hundred thirty four thousand five hundred sixty seven"),
        ("1st 2nd 3rd 12th 19th", "first second third twelfth nineteenth"),
        ("20th 21st 42nd", "twentieth twenty first forty second"),
        ("dog 3d 12345678 1.5", "dog 3d 12345678 1.5"),  # (not a number it knows: as written)
    ],
)
def test_numbers_in_words(written: str, said: str) -> None:
    assert spoken(written.split()) == said.split()
