"""The dialog engine on an NVIDIA GPU (`dialog.device = "cuda"`).

The GPU tests skip where torch sees no CUDA device; `scripts/gpu-check` runs them on a GPU machine, with
the engine's own tests (batch invariance, lossless drafts, windowed decode) moved there by
`DUPLEXD_TEST_DEVICE=cuda` (tests/dialog/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from duplexd.config import AsrConfig, DialogConfig
from duplexd.dialog.engine import DialogEngine, EngineConfig
from duplexd.dialog.gguf_weights import ChatTokenizer
from duplexd.dialog.model import Transformer
from duplexd.errors import EngineError

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU here (a CPU build of torch, or no NVIDIA driver)")

QUESTION = "What is the capital of France?"


def test_devices_are_validated_where_they_are_configured() -> None:
    for ok in ("cpu", "cuda", "cuda:1"):
        assert DialogConfig(device=ok).device == ok
        assert AsrConfig(device=ok).device == ok
    for bad in ("gpu", "cuda:", "cuda:x", ""):
        with pytest.raises(ValueError, match="dialog.device"):
            DialogConfig(device=bad)
        with pytest.raises(ValueError, match="asr.device"):
            AsrConfig(device=bad)


@pytest.mark.skipif(CUDA, reason="a CUDA GPU is here: the engine loads on it")
def test_a_gpu_that_is_not_there_is_one_readable_error() -> None:
    with pytest.raises(EngineError, match="sees no CUDA GPU") as raised:
        DialogEngine.load(EngineConfig(device="cuda"))
    assert "\n" not in str(raised.value)


def _reply(engine: DialogEngine, question: str) -> tuple[list[int], float | None]:
    sid = engine.open()
    engine.append_user_text(sid, question)
    while engine.busy():
        engine.step()
    p_end = engine.p_end_of_turn(sid)
    engine.start_reply(sid)
    out: list[int] = []
    while engine.busy():
        out.extend(engine.step().get(sid, []))
    engine.close(sid)
    return out, p_end


@needs_cuda
@pytest.mark.slow
def test_the_engine_on_the_gpu_reads_as_on_the_cpu(smol: tuple[Transformer, ChatTokenizer]) -> None:
    """float32 on both (no TF32): the same P(end of turn) to rounding, and the same greedy reply."""
    from duplexd.dialog.weights import load_weights

    loaded = load_weights()
    cpu = DialogEngine(Transformer.from_state_dict(loaded.config, loaded.weights), loaded.tokenizer)
    gpu = DialogEngine(Transformer.from_state_dict(loaded.config, loaded.weights, device="cuda"), loaded.tokenizer)
    assert gpu.pool.k.is_cuda and gpu.model.output.weight.is_cuda
    reply_cpu, p_cpu = _reply(cpu, QUESTION)
    reply_gpu, p_gpu = _reply(gpu, QUESTION)
    assert p_cpu is not None and p_gpu == pytest.approx(p_cpu, rel=1e-3, abs=1e-5)
    assert "Paris" in loaded.tokenizer.decode(reply_gpu)
    assert reply_gpu[:8] == reply_cpu[:8]


@needs_cuda
@pytest.mark.slow
def test_the_engine_loads_on_the_gpu_with_its_dtype_and_tiles_measured_there() -> None:
    engine = DialogEngine.load(EngineConfig(device="cuda", max_sessions=4))
    assert engine.tuning is not None
    assert torch.cuda.get_device_name() in str(engine.tuning["device"])
    assert "int4" not in engine.tuning["dtypes_offered"]  # (a CPU kernel)
    assert engine.pool.k.is_cuda
    alone, _ = _reply(engine, QUESTION)
    assert "Paris" in engine.tokenizer.decode(alone)
    # Batch invariance on the GPU: the same reply with three other conversations in its steps.
    others = [engine.open() for _ in range(3)]
    for i, sid in enumerate(others):
        engine.append_user_text(sid, f"Count to {i + 3}.")
        engine.start_reply(sid)
    shared, _ = _reply(engine, QUESTION)
    assert shared == alone
