"""LlamaConfig validation: every bad field is refused with its name and value."""

from __future__ import annotations

import dataclasses

import pytest

from duplexd.dialog.gguf_weights import LlamaConfig

SMOLLM2 = LlamaConfig(
    vocab=49152,
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    hidden_dim=1536,
    rope_theta=100000.0,
    norm_eps=1e-5,
    context_length=8192,
)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("vocab", 0, "vocab must be positive, got 0"),
        ("dim", -1, "dim must be positive, got -1"),
        ("n_kv_heads", 2, r"n_heads \(9\) must be a multiple of n_kv_heads \(2\)"),
        ("head_dim", 63, "head_dim must be even"),
        ("rope_theta", 0.0, "rope_theta must be positive"),
        ("norm_eps", 0.0, "norm_eps must be positive"),
        ("context_length", 0, "context_length must be positive"),
    ],
)
def test_bad_field_is_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMOLLM2, **{field: value})


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SMOLLM2.dim = 1  # type: ignore[misc]
