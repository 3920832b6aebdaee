"""`duplexd bench llm`'s parts: the matmul bound, the long text, RSS, the result and its table.

No timing is asserted here (timing claims live in the benchmark's own output); only that each part
measures what it says and that the result carries every key.
"""

from __future__ import annotations

import json
import mmap
import string
import time
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader

from duplexd.bench import llm
from duplexd.dialog.gguf_weights import ChatTokenizer, LlamaConfig, read_config, read_tokenizer

TINY = LlamaConfig(
    vocab=512,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    hidden_dim=160,
    rope_theta=10000.0,
    norm_eps=1e-5,
    context_length=256,
)


@pytest.fixture(scope="module")
def tokenizer(reader: GGUFReader) -> ChatTokenizer:
    return read_tokenizer(reader)


def test_matmul_shapes_follow_the_config() -> None:
    shapes = llm.matmul_shapes(TINY)
    assert len(shapes) == 7 * TINY.n_layers + 1
    assert shapes[:7] == [(64, 64), (32, 64), (32, 64), (64, 64), (160, 64), (160, 64), (64, 160)]
    assert shapes[-1] == (512, 64)


def test_matmul_shapes_of_smollm2(reader: GGUFReader) -> None:
    shapes = llm.matmul_shapes(read_config(reader))
    assert shapes[:7] == [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
    assert len(shapes) == 7 * 30 + 1 and shapes[-1] == (49152, 576)


@pytest.mark.parametrize("kernel", ["gemm", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_bound_is_positive_for_each_batch_size(kernel: llm.Kernel, dtype: torch.dtype) -> None:
    result = llm.matmul_bound_tok_s((1, 3), dtype, kernel, TINY, warmup=0, repeats=1)
    assert set(result) == {1, 3}
    assert all(v > 0 and v != float("inf") for v in result.values())


def test_matmul_bound_on_the_real_shapes(reader: GGUFReader) -> None:
    result = llm.matmul_bound_tok_s((1, 2), torch.float32, "rowwise", read_config(reader), warmup=0, repeats=1)
    assert set(result) == {1, 2} and all(v > 0 for v in result.values())


def test_int4_bound_is_positive_for_each_batch_size() -> None:
    result = llm.int4_bound_tok_s((1, 3), TINY, warmup=0, repeats=1)
    assert set(result) == {1, 3} and all(0 < v < float("inf") for v in result.values())
    with pytest.raises(ValueError, match="batch sizes must be positive, got 0"):
        llm.int4_bound_tok_s((0,), TINY)


def test_matmul_bound_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="kernel must be one of"):
        llm.matmul_bound_tok_s((1,), torch.float32, "nope", TINY)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch sizes must be positive, got 0"):
        llm.matmul_bound_tok_s((0,), torch.float32, "gemm", TINY)


def test_long_text_is_clean_english_prose() -> None:
    text = llm.long_text()
    assert len(text) > 300_000
    assert "\n\n\n" not in text and "  " not in text and "\t" not in text
    assert not [line for line in text.splitlines() if line and set(line) <= set("*=-~^#")]  # rST underlines
    assert "assert" in text[:200]  # sorted topic order: "assert" comes first
    assert text == llm.long_text()  # deterministic


def test_long_text_tokens(tokenizer: ChatTokenizer) -> None:
    ids = llm.long_text_tokens(tokenizer, 8192)
    assert len(ids) == 8192
    decoded = tokenizer.decode(ids)
    letters = sum(c in string.ascii_letters for c in decoded)
    assert letters / len(decoded) > 0.6, "mostly ASCII letters"
    assert all(c.isascii() for c in decoded[:2000])
    with pytest.raises(ValueError, match="fewer than n_tokens=10000000"):
        llm.long_text_tokens(tokenizer, 10_000_000)


def test_cpu_busy_s_counts_this_process() -> None:
    before = llm.cpu_busy_s()
    if before is None:
        pytest.skip("no /proc/stat on this platform")
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:  # burn 0.3 s of CPU
        pass
    after = llm.cpu_busy_s()
    assert after is not None
    assert after[1] - before[1] >= 0.25
    assert after[0] - before[0] >= 0.2  # the machine saw it too (clock ticks are coarse)


def test_rss_mb_sees_an_allocation() -> None:
    # A fresh anonymous mapping: heap allocations can reuse memory an earlier test already made resident.
    size = 64 << 20
    before = llm.rss_mb()
    block = mmap.mmap(-1, size)
    block.write(b"\x01" * size)  # touch every page
    after = llm.rss_mb()
    block.close()
    freed = llm.rss_mb()
    assert before > 0
    assert after - before > 48
    assert after - freed > 48


def _measurements(engine: bool) -> dict:
    aggregate = {
        n: {"tok_s": 10.0 * n**0.5, "tokens": 32 * n, "steps": 32, "rss_delta_mb": 2.0 * n} for n in (1, 2, 4, 8, 16)
    }
    parts = {
        "config": {"max_sessions": 16, "dtype": "auto"},
        "tuning": {
            "dtype": "bfloat16",
            "dtype_setting": "auto",
            "dtypes_offered": ["float32", "bfloat16"],
            "decode_linear": "tiles 4/8/16",
        },
        "aggregate": aggregate,
        "prefill_tok_s": 400.0,
        "kv_resident_max_tokens": 1024,
        "kv_tokens_fed": 20_480,
        "kv_pool_mb_per_slot": 45.0,
        "ppl": {"full": 12.0, "window_sinks": 12.5, "window_no_sinks": 40.0},
        "rss_mb": {"before_load": 200.0, "after_load": 800.0},
    }
    bound = {n: 20.0 * n**0.6 for n in (1, 2, 4, 8, 16)}
    return {
        "machine": llm.machine_info(),
        "quick": True,
        "engine": parts if engine else dict.fromkeys(parts),
        "hf_generate_tok_s": 5.0 if engine else None,
        "matmul": {
            k: {d: {n: b * (2 if d == "bf16" else 1) for n, b in bound.items()} for d in ("fp32", "bf16")}
            for k in ("gemm", "rowwise")
        },
        "ppl_text": {"source": "pydoc_data.topics", "tokens": 2048},
        "skipped": {} if engine else {"engine": "absent", "hf_generate_tok_s": "absent"},
        "phases": {
            "engine: load": {"s": 1.0, "other_cores": 0.0},
            "transformers generate": {"s": 9.0, "other_cores": 1.5},
        },
    }


REQUIRED = {
    "machine",
    "single_tok_s",
    "prefill_tok_s",
    "aggregate_tok_s",
    "hf_generate_tok_s",
    "matmul_bound_tok_s",
    "engine_bound_tok_s",
    "kv_resident_max_tokens",
    "rss_per_session_mb",
    "ppl",
    "ratios",
}


def test_report_has_every_key_and_its_ratios(tmp_path: Path) -> None:
    result = llm.report(**_measurements(engine=True))
    assert REQUIRED <= set(result)
    assert set(result["aggregate_tok_s"]) == {"1", "2", "4", "8", "16"}
    assert result["single_tok_s"] == 10.0
    # the bound is the plain GEMM in the dtype the engine chose at load
    assert result["engine_bound_tok_s"] == result["matmul_bound_tok_s"]["gemm"]["bf16"]
    assert result["engine_config"]["dtype"] == "bfloat16" and result["engine_config"]["dtype_setting"] == "auto"
    assert result["engine_config"]["dtypes_offered"] == ["float32", "bfloat16"]
    assert result["engine_config"]["decode_linear"] == "tiles 4/8/16"
    assert set(result["ppl"]) == {"full", "window_sinks", "window_no_sinks"}
    assert result["rss_per_session_mb"] == pytest.approx(2.0)
    ratios = result["ratios"]
    assert ratios["single_over_hf"] == pytest.approx(2.0)
    assert ratios["aggregate16_over_single"] == pytest.approx(4.0)
    assert ratios["aggregate_over_engine_bound"]["1"] == pytest.approx(0.25)
    assert {"cpu", "cores", "torch"} <= set(result["machine"])
    out = tmp_path / "llm.json"
    out.write_text(json.dumps(result))
    assert json.loads(out.read_text()) == result  # plain JSON: string keys, no tensors
    shown = llm.table(result)
    assert "| 16 |" in shown and "ratio 2.00" in shown
    assert "during transformers generate (1.50)" in shown and "engine: load" not in shown


def test_an_int4_engine_is_measured_against_the_int4_bound() -> None:
    measured = _measurements(engine=True)
    measured["engine"]["tuning"] = {**measured["engine"]["tuning"], "dtype": "int4", "decode_linear": "tiles 1/2 int4"}
    measured["matmul"]["gemm"]["int4"] = {n: 40.0 for n in (1, 2, 4, 8, 16)}
    result = llm.report(**measured)
    assert result["engine_bound_tok_s"] == result["matmul_bound_tok_s"]["gemm"]["int4"]
    assert result["ratios"]["aggregate_over_engine_bound"]["1"] == pytest.approx(0.25)
    assert "| gemm int4 |" in llm.table(result)


def test_report_without_engine_or_transformers_is_null_with_reasons() -> None:
    result = llm.report(**_measurements(engine=False))
    assert REQUIRED <= set(result)
    assert result["single_tok_s"] is None and result["hf_generate_tok_s"] is None
    assert result["ratios"]["single_over_hf"] is None
    assert result["ppl"] == {"full": None, "window_sinks": None, "window_no_sinks": None}
    assert result["matmul_bound_tok_s"]["gemm"]["fp32"]["16"] > 0
    assert set(result["skipped"]) == {"engine", "hf_generate_tok_s"}
    json.dumps(result)
    assert "skipped engine: absent" in llm.table(result)


def test_cli_knows_bench_llm() -> None:
    from duplexd.cli import build_parser

    args = build_parser().parse_args(["bench", "llm", "--out", "x.json", "--quick"])
    assert args.what == "llm" and args.quick and args.out == Path("x.json")


@pytest.mark.slow
def test_hf_generate_baseline_is_positive(gguf_file: Path, tokenizer: ChatTokenizer) -> None:
    pytest.importorskip("transformers", reason="the baseline needs transformers (test-only)")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": "Hi"}]))
    assert llm.hf_generate_tok_s(prompt, new_tokens=4, repeats=1, path=gguf_file) > 0
