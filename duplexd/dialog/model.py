"""A plain-torch Llama (gpt-fast style): RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

Two ways to run it:

- `Transformer.forward(tokens[B, T])`: a full causal pass from position 0 (the reference, and the
  full-attention perplexity probe).
- `Transformer.step(tokens, attend, logits_rows)`: the engine's packed pass. All new tokens of one engine step,
  from every session, are packed into one `[N]` row vector; the engine's `attend` callback does each
  session's attention against its own bounded KV window (`dialog/kv_window.py`).

Batch invariance. Library GEMMs pick a kernel by the number of rows, so a row's float result changes with
how many other rows share the call. Every row of a step (decode tokens and prefill chunks alike) therefore
goes through `decode_linear` (`kernels.DecodeLinear`: fixed-shape tiles this CPU computes the same whatever
the other rows, or rowwise), chosen at load by `kernels.choose`. A token's numbers (and so a session's
greedy tokens) depend neither on what it shares a step with nor on the chunks its prompt was cut into.

RoPE rotates adjacent pairs (2i, 2i+1) of each head: the Q/K layout GGUF files store (`gguf_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGUFReader
from torch import Tensor, nn

from duplexd.dialog.gguf_weights import FourBitBlocks, LlamaConfig, open_gguf, read_config, read_weights
from duplexd.dialog.kernels import ROWWISE, DecodeLinear, PackedInt4
from duplexd.errors import EngineError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one fused op: steps are op-bound
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_angles(positions: Tensor, head_dim: int, theta: float) -> Tensor:
    """Unit complex rotations `[len(positions), head_dim // 2]` (complex64) for integer positions.

    Angles are computed in float64, so positions in the millions (a session that runs for days) still get
    exact relative phases after the cast.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(positions.to(torch.float64), inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rope(x: Tensor, rotation: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Rotate adjacent pairs of `x[T, H, D]` by `rotation[T, D/2]` (complex), in float32; the result in
    `dtype` (default: `x`'s)."""
    x32 = x if x.dtype == torch.float32 else x.float()
    pairs = torch.view_as_complex(x32.unflatten(-1, (-1, 2)).contiguous())
    rotated = torch.view_as_real(pairs * rotation[:, None, :]).flatten(-2)
    dtype = x.dtype if dtype is None else dtype
    return rotated if dtype == torch.float32 else rotated.to(dtype)


@dataclass(frozen=True, slots=True)
class Segment:
    """`length` consecutive packed rows that belong to one session (one prefill chunk, or one token)."""

    start: int
    length: int


AttendFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]
"""`attend(layer, q[N, H, D], k[N, Hkv, D], v[N, Hkv, D]) -> out[N, H, D]` (pre-RoPE q/k)."""


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        qkv = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, qkv, bias=config.attn_bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`[..., qkv]` -> q `[..., H, D]`, k and v `[..., Hkv, D]`."""
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.unflatten(-1, (self.n_heads, self.head_dim)),
            k.unflatten(-1, (self.n_kv_heads, self.head_dim)),
            v.unflatten(-1, (self.n_kv_heads, self.head_dim)),
        )

    def forward(self, x: Tensor, rotation: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.split_qkv(self.wqkv(x))
        q = apply_rope(q.flatten(0, 1), rotation.repeat(batch, 1)).unflatten(0, (batch, seq))
        k = apply_rope(k.flatten(0, 1), rotation.repeat(batch, 1)).unflatten(0, (batch, seq))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(gate x) * up x), with gate and up fused into one matrix `w13`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(config.dim, 2 * config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def activate(self, h13: Tensor) -> Tensor:
        gate, up = h13.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.activate(self.w13(x)))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, rotation: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rotation)
        return h + self.feed_forward(self.ffn_norm(h))

    def linears(self) -> dict[str, nn.Linear]:
        """The block's matrices a decode step multiplies rows by, in step order, by parameter name."""
        return {
            "attention.wqkv": self.attention.wqkv,
            "attention.wo": self.attention.wo,
            "feed_forward.w13": self.feed_forward.w13,
            "feed_forward.w2": self.feed_forward.w2,
        }


def _packed_linear(x: Tensor, layer: nn.Linear, decode: DecodeLinear) -> Tensor:
    """`layer(x)` for packed rows, batch-invariant: every row, a prefill chunk's too, through `decode` (its
    fixed-shape tiles), so a token's numbers do not depend on the chunk it came in, nor on its neighbours."""
    return decode(x, layer.weight, layer.bias)


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
        self.decode_linear = ROWWISE  # one-token rows' kernel (`kernels.choose` measures a faster one at load)
        # decode attention's arithmetic by the cache rows it spans (empty: the weights' dtype; `tuning`)
        self.attention_dtypes: dict[int, torch.dtype] = {}

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def decode_layers(self) -> list[tuple[Tensor, Tensor | None, int]]:
        """The weights a decode step multiplies one-token rows by, one per shape, each with its uses per step
        (what the invariance self-test checks: a row's numbers depend on the shape, not on the values)."""
        first: TransformerBlock = self.layers[0]  # type: ignore[assignment]
        n = len(self.layers)
        return [(m.weight, m.bias, n) for m in first.linears().values()] + [(self.output.weight, None, 1)]

    def decode_weights(self) -> list[tuple[Tensor, Tensor | None, int]]:
        """Every weight a decode step multiplies one-token rows by, in step order, once each: what timing a
        kernel must stream. (One layer's weights reused 30 times stay in the CPU's cache and flatter the
        dtype whose weights are larger: float32's 540 MB do not fit, bfloat16's are half of it.)"""
        out: list[tuple[Tensor, Tensor | None, int]] = []
        for layer in self.layers:
            block: TransformerBlock = layer  # type: ignore[assignment]
            out.extend((m.weight, m.bias, 1) for m in block.linears().values())
        return out + [(self.output.weight, None, 1)]

    def pack_int4(self, blocks: Mapping[str, FourBitBlocks]) -> dict[int, tuple[Tensor, PackedInt4]]:
        """Every layer's matrices in their 4-bit form (`blocks`: the GGUF's Q4_0/Q4_1 blocks by parameter
        name, fused as the dense weights are), for `DecodeLinear(tiles, int4=...)`. Each dense weight is
        replaced by exactly the numbers its packed form multiplies by (so `forward`, which uses the dense
        weights, e.g. for the perplexity check, computes with the same model as `step`). Raises `KeyError`
        for a matrix not in 4 bits."""
        parts = {
            part: fuse_projections(self.config, {name: getattr(b, part) for name, b in blocks.items()})
            for part in ("codes", "scales", "mins")
        }
        dtype = self.tok_embeddings.weight.dtype
        packed: dict[int, tuple[Tensor, PackedInt4]] = {}
        for i, layer in enumerate(self.layers):
            block: TransformerBlock = layer  # type: ignore[assignment]
            for name, linear in block.linears().items():
                key = f"layers.{i}.{name}.weight"
                four = PackedInt4.pack(parts["codes"][key], parts["scales"][key], parts["mins"][key], dtype)
                linear.weight = nn.Parameter(four.dense().to(dtype), requires_grad=False)
                packed[id(linear.weight)] = (linear.weight, four)
        return packed

    def forward(self, tokens: Tensor) -> Tensor:
        """Causal logits `[B, T, vocab]` for `tokens[B, T]` at positions 0..T-1 (full attention)."""
        seq = tokens.shape[1]
        if seq > self.config.context_length:
            raise EngineError(f"{seq} tokens exceed the model's context of {self.config.context_length}")
        device = self.device
        rotation = rope_angles(torch.arange(seq), self.config.head_dim, self.config.rope_theta).to(device)
        x = self.tok_embeddings(tokens.to(device))
        for layer in self.layers:
            x = layer(x, rotation)
        return self.output(self.norm(x))

    def step(self, tokens: Tensor, attend: AttendFn, logits_rows: Tensor | None) -> Tensor:
        """One packed engine step: `tokens[N]` from several sessions, attention delegated to `attend`.

        Returns logits `[len(logits_rows), vocab]` for the requested rows only (the output head is a fifth
        of the weights; a prefill chunk needs logits for its last token at most), through `decode_linear`. With
        `logits_rows=None`, logits for every row in one plain matmul (scoring a text, not decoding).
        """
        decode = self.decode_linear
        x = self.tok_embeddings(tokens.to(self.device))
        for index, layer in enumerate(self.layers):
            block: TransformerBlock = layer  # type: ignore[assignment]
            attn = block.attention
            q, k, v = attn.split_qkv(_packed_linear(block.attention_norm(x), attn.wqkv, decode))
            out = attend(index, q, k, v).flatten(-2)
            h = x + _packed_linear(out, attn.wo, decode)
            ffn = block.feed_forward
            hidden = ffn.activate(_packed_linear(block.ffn_norm(h), ffn.w13, decode))
            x = h + _packed_linear(hidden, ffn.w2, decode)
        if logits_rows is None:
            return self.output(self.norm(x))
        return decode(self.norm(x[logits_rows.to(self.device)]), self.output.weight)

    @classmethod
    def from_gguf(cls, path: Path) -> Transformer:
        """Build the model and load the GGUF's weights, dequantized to float32, in eval mode."""
        return cls.from_reader(open_gguf(path))

    @classmethod
    def from_reader(cls, reader: GGUFReader) -> Transformer:
        """Like `from_gguf`, from an already opened file (opening one parses its metadata: seconds)."""
        return cls.from_state_dict(read_config(reader), read_weights(reader))

    @classmethod
    def from_state_dict(
        cls,
        config: LlamaConfig,
        weights: Mapping[str, Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> Transformer:
        """Build the model from per-projection weights (`wq`/`wk`/`wv`, `w1`/`w3` fused here), in eval mode,
        its weights in `dtype` on `device`."""
        with torch.device("meta"):
            model = cls(config)
        state = fuse_projections(config, weights)
        if config.tie_embeddings:
            state["output.weight"] = state["tok_embeddings.weight"]
        state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        if config.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
        return model.eval().requires_grad_(False)


def fuse_projections(config: LlamaConfig, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Per-projection names (`attention.wq`, `feed_forward.w1`, ...) -> this model's fused ones."""
    state = dict(weights)
    for i in range(config.n_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            names = [f"{p}attention.{w}.{kind}" for w in ("wq", "wk", "wv")]
            if all(n in state for n in names):
                state[f"{p}attention.wqkv.{kind}"] = torch.cat([state.pop(n) for n in names])
        gate, up = f"{p}feed_forward.w1.weight", f"{p}feed_forward.w3.weight"
        if gate in state and up in state:
            state[f"{p}feed_forward.w13.weight"] = torch.cat([state.pop(gate), state.pop(up)])
    return state
