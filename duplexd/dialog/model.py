"""A plain-torch Llama (gpt-fast style): RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

`Transformer.forward` runs a full causal pass over `tokens[1, T]` and returns `logits[1, T, vocab]`.
There is no KV cache yet. RoPE rotates adjacent pairs (2i, 2i+1) of each head: the Q/K layout that
GGUF files store (see `gguf_weights`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGUFReader
from torch import Tensor, nn

from duplexd.dialog.gguf_weights import LlamaConfig, open_gguf, read_config, read_weights
from duplexd.errors import EngineError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_cos_sin(seq_len_tokens: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin tables `[seq_len, head_dim // 2]` for positions 0..seq_len-1 (float32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len_tokens, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent pairs of `x[B, T, H, D]` by the angles for its T positions (`cos`, `sin`: `[T, D/2]`)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        group = self.n_heads // self.n_kv_heads  # query heads h*group .. h*group+group-1 share kv head h
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_cos_sin(config.context_length, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        """Causal logits `[B, T, vocab]` for `tokens[B, T]` at positions 0..T-1."""
        seq = tokens.shape[1]
        if seq > self.config.context_length:
            raise EngineError(f"{seq} tokens exceed the model's context of {self.config.context_length}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))

    @classmethod
    def from_gguf(cls, path: Path) -> Transformer:
        """Build the model and load the GGUF's weights, dequantized to float32, in eval mode."""
        return cls.from_reader(open_gguf(path))

    @classmethod
    def from_reader(cls, reader: GGUFReader) -> Transformer:
        """Like `from_gguf`, from an already opened file (opening one parses its metadata: seconds)."""
        config = read_config(reader)
        with torch.device("meta"):
            model = cls(config)
        weights = read_weights(reader)
        if config.tie_embeddings:
            weights["output.weight"] = weights["tok_embeddings.weight"]
        model.load_state_dict(weights, strict=True, assign=True)
        if config.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
        cos, sin = rope_cos_sin(config.context_length, config.head_dim, config.rope_theta)
        model.rope_cos, model.rope_sin = cos, sin
        return model.eval().requires_grad_(False)
