"""Read a Llama-architecture GGUF file: model config, tokenizer, chat template and float32 weights.

Parsing and dequantization are done by the `gguf` package (`GGUFReader`, `gguf.quants.dequantize`);
the tokenizer is a `tokenizers.Tokenizer` built from the file's vocabulary and merges.

Q/K layout convention. llama.cpp's converter permutes the rows of `attn_q`/`attn_k` from Hugging Face's
"rotate half" layout (dimension i pairs with i + head_dim/2) back to Meta's original interleaved layout
(dimension 2i pairs with 2i+1). We keep the GGUF rows exactly as stored, and `model.py` applies RoPE to
adjacent pairs, as Meta's reference code and gpt-fast do. No un-permutation is needed. Attention scores
are unchanged by the layout (the same permutation is applied to q and k), so logits equal those of a
Hugging Face model that un-permutes the weights and rotates halves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, TokenType
from gguf.quants import dequantize
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from duplexd.errors import EngineError


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Shape of a Llama-architecture model, read from GGUF metadata (or a Hugging Face `config.json`).

    `attn_bias`: the Q/K/V projections have biases (Qwen2); the output projection never has one.
    """

    vocab: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    rope_theta: float
    norm_eps: float
    context_length: int
    tie_embeddings: bool = True
    attn_bias: bool = False
    """q/k/v projections carry biases (Qwen2)."""

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "context_length"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {value}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"LlamaConfig.rope_theta must be positive, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"LlamaConfig.norm_eps must be positive, got {self.norm_eps}")


def state_dict_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a state dict for `config` holds, with its torch shape (`output.weight` only when untied)."""
    q_rows = config.n_heads * config.head_dim
    kv_rows = config.n_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "tok_embeddings.weight": (config.vocab, config.dim),
        "norm.weight": (config.dim,),
    }
    if not config.tie_embeddings:
        shapes["output.weight"] = (config.vocab, config.dim)
    for i in range(config.n_layers):
        layer = f"layers.{i}."
        shapes[layer + "attention_norm.weight"] = (config.dim,)
        shapes[layer + "attention.wq.weight"] = (q_rows, config.dim)
        shapes[layer + "attention.wk.weight"] = (kv_rows, config.dim)
        shapes[layer + "attention.wv.weight"] = (kv_rows, config.dim)
        shapes[layer + "attention.wo.weight"] = (config.dim, q_rows)
        if config.attn_bias:
            shapes[layer + "attention.wq.bias"] = (q_rows,)
            shapes[layer + "attention.wk.bias"] = (kv_rows,)
            shapes[layer + "attention.wv.bias"] = (kv_rows,)
        shapes[layer + "ffn_norm.weight"] = (config.dim,)
        shapes[layer + "feed_forward.w1.weight"] = (config.hidden_dim, config.dim)
        shapes[layer + "feed_forward.w2.weight"] = (config.dim, config.hidden_dim)
        shapes[layer + "feed_forward.w3.weight"] = (config.hidden_dim, config.dim)
    return shapes


def check_state_dict(weights: Mapping[str, torch.Tensor], config: LlamaConfig, origin: str) -> None:
    """Raise `EngineError` unless `weights` holds exactly the float32 tensors of `state_dict_shapes(config)`."""
    expected = state_dict_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise EngineError(f"{len(missing)} tensors missing from {origin}, e.g. {missing[:3]}")
    extra = sorted(weights.keys() - expected.keys())
    if extra:
        raise EngineError(f"{len(extra)} unexpected tensors in {origin}, e.g. {extra[:3]}")
    for name, shape in expected.items():
        tensor = weights[name]
        if tuple(tensor.shape) != shape or tensor.dtype != torch.float32:
            raise EngineError(
                f"tensor {name} in {origin} is {tensor.dtype} {tuple(tensor.shape)}, expected float32 {shape}"
            )


@dataclass(frozen=True, slots=True)
class ChatTokenizer:
    """The model's tokenizer with its special ids and chat template."""

    tokenizer: Tokenizer
    bos_id: int
    eos_id: int
    chat_template: str

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. `<|im_start|>`) become their ids."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """Render `messages` ({"role", "content"} dicts) with the model's Jinja chat template."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        bos = self.tokenizer.id_to_token(self.bos_id)
        eos = self.tokenizer.id_to_token(self.eos_id)
        return template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )


def open_gguf(path: Path) -> GGUFReader:
    """Memory-map a GGUF file."""
    return GGUFReader(path)


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise EngineError(f"GGUF metadata key {key!r} is missing")
    return field.contents()


def read_config(reader: GGUFReader) -> LlamaConfig:
    """The model shape from the GGUF metadata (only the `llama` architecture is supported)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise EngineError(f"unsupported GGUF architecture {arch!r} (expected 'llama')")
    dim = int(_field(reader, "llama.embedding_length"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    head_count_kv = reader.get_field("llama.attention.head_count_kv")
    key_length = reader.get_field("llama.attention.key_length")
    vocab_size = reader.get_field("llama.vocab_size")
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab=int(vocab_size.contents()) if vocab_size else len(_field(reader, "tokenizer.ggml.tokens")),
        dim=dim,
        n_layers=int(_field(reader, "llama.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(head_count_kv.contents()) if head_count_kv else n_heads,
        head_dim=int(key_length.contents()) if key_length else dim // n_heads,
        hidden_dim=int(_field(reader, "llama.feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        context_length=int(_field(reader, "llama.context_length")),
        tie_embeddings="output.weight" not in names,
    )


def read_tokenizer(reader: GGUFReader) -> ChatTokenizer:
    """A byte-level BPE tokenizer (GPT-2 style) from `tokenizer.ggml.tokens`/`merges`, plus ids and template.

    Pre-tokenization follows llama.cpp's `smollm` pre-tokenizer: every digit is its own piece, then the
    GPT-2 regex. Control tokens (`<|im_start|>` ...) are added as special tokens so they are matched whole.
    """
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise EngineError(f"unsupported GGUF tokenizer model {kind!r} (expected 'gpt2', byte-level BPE)")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    merges: list[str] = list(_field(reader, "tokenizer.ggml.merges"))
    token_types: list[int] = list(_field(reader, "tokenizer.ggml.token_type"))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    control = [tok for tok, kind in zip(tokens, token_types, strict=True) if kind == TokenType.CONTROL]
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in control])
    user = [tok for tok, kind in zip(tokens, token_types, strict=True) if kind == TokenType.USER_DEFINED]
    if user:
        tokenizer.add_tokens([AddedToken(tok, special=False, normalized=False) for tok in user])
    return ChatTokenizer(
        tokenizer=tokenizer,
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        chat_template=str(_field(reader, "tokenizer.chat_template")),
    )


def _our_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to the parameter name in `model.Transformer` (gpt-fast naming)."""
    fixed = {
        "token_embd.weight": "tok_embeddings.weight",
        "output_norm.weight": "norm.weight",
        "output.weight": "output.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    blk, layer, rest = gguf_name.split(".", 2)
    if blk != "blk":
        raise EngineError(f"unexpected GGUF tensor {gguf_name!r}")
    per_layer = {
        "attn_norm.weight": "attention_norm.weight",
        "attn_q.weight": "attention.wq.weight",
        "attn_k.weight": "attention.wk.weight",
        "attn_v.weight": "attention.wv.weight",
        "attn_output.weight": "attention.wo.weight",
        "ffn_norm.weight": "ffn_norm.weight",
        "ffn_gate.weight": "feed_forward.w1.weight",
        "ffn_down.weight": "feed_forward.w2.weight",
        "ffn_up.weight": "feed_forward.w3.weight",
    }
    if rest not in per_layer:
        raise EngineError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"layers.{int(layer)}.{per_layer[rest]}"


FOUR_BIT_GROUP = 32  # elements per block of GGUF's Q4_0 and Q4_1


@dataclass(frozen=True, slots=True)
class FourBitBlocks:
    """A Q4_0 or Q4_1 weight as stored: `weight[n, k] = scales[n, k // 32] * codes[n, k] + mins[n, k // 32]`.

    `codes[N, K]` uint8 in 0..15; `scales`, `mins` `[N, K / 32]` float16 (Q4_0: `mins = -8 * scales`, exact
    in float32). These are the model's own numbers: `kernels.PackedInt4` multiplies by them directly.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 `[N, K]`, as `gguf.quants.dequantize` computes it (`d * q + m` in float32)."""
        group = self.codes.shape[1] // self.scales.shape[1]
        scales = self.scales.float().repeat_interleave(group, dim=1)
        mins = self.mins.float().repeat_interleave(group, dim=1)
        return scales * self.codes.float() + mins


def read_four_bit_blocks(reader: GGUFReader) -> dict[str, FourBitBlocks]:
    """The Q4_0/Q4_1 tensors' blocks, undequantized, keyed by `model.Transformer` parameter names."""
    out: dict[str, FourBitBlocks] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1"):
            continue
        rows = np.asarray(t.data, dtype=np.uint8)  # [N, blocks * bytes per block]
        head = 4 if kind == "Q4_1" else 2  # (d, and m for Q4_1: float16 each) before 16 bytes of codes
        blocks = rows.reshape(rows.shape[0], -1, head + FOUR_BIT_GROUP // 2)
        scales = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0]
        if kind == "Q4_1":
            mins = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0]
        else:
            mins = (-8 * scales.astype(np.float32)).astype(np.float16)  # (exact: a power of two times a half)
        packed = blocks[:, :, head:]  # element j in the low nibble of byte j, element j + 16 in the high
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(rows.shape[0], -1)
        out[_our_name(t.name)] = FourBitBlocks(
            codes=torch.from_numpy(np.ascontiguousarray(codes)),
            scales=torch.from_numpy(np.ascontiguousarray(scales)),
            mins=torch.from_numpy(np.ascontiguousarray(mins)),
        )
    return out


def read_weights(reader: GGUFReader) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, keyed by `model.Transformer` parameter names.

    Shapes are torch's `[out_features, in_features]`; Q/K rows stay in the GGUF (interleaved RoPE) order.
    """
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        array = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not array.flags.writeable:  # an F32 tensor is a view of the read-only memory map
            array = array.copy()
        weights[_our_name(t.name)] = torch.from_numpy(array)
    return weights
