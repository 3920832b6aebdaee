"""Hugging Face Llama/Qwen2 folders: tiny random models saved by transformers, read by `hf_weights`.

The check is end to end: a minimal float32 forward pass written here, with adjacent-pair RoPE, runs our state
dict and must reproduce transformers' logits (rotate-half RoPE on the original rows). That only holds if the
Q/K rows and biases were interleaved correctly; the same pass without the permutation is shown to miss.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from duplexd.dialog import hf_weights
from duplexd.dialog.gguf_weights import ChatTokenizer, LlamaConfig
from duplexd.errors import EngineError

VOCAB = 320  # the model's embedding rows; the tokenizer uses the first 300, as real models pad theirs
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# float32 on CPU: measured max |difference| <= 3e-6 on logits up to ~3.5; leaving out the Q/K permutation moves
# them by 1.5 to 2.8 (asserted below), so 1e-4 is far from both.
LOGIT_ATOL = 1e-4

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TEXTS = [
    "hello world, the quick brown fox",
    "  jumps over 12345 lazy dogs  ",
    "<|im_start|>user\nhello there<|im_end|>\n",
    "naïve café 🙂",
]
MESSAGES = [
    {"role": "user", "content": "hello, quick fox?"},
    {"role": "assistant", "content": "the lazy dog."},
    {"role": "user", "content": "over 12345"},
]


def _write_tokenizer(folder: Path, *, qwen: bool) -> None:
    """A byte-level BPE trained on a few words, as `tokenizer.json`: GPT-2 style, or Qwen2's NFC and regex.

    (transformers' `Qwen2Tokenizer` always applies Qwen2's normalizer and split regex, as real Qwen2
    `tokenizer.json` files also say; the reference only agrees with a file that says so too.)
    """
    tokenizer = Tokenizer(models.BPE())
    if qwen:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog 12345"] * 20, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))


def _randomize(model: torch.nn.Module) -> None:
    """transformers zeroes biases and sets norms to 1; random values make every tensor matter."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)


def save_tiny_model(
    folder: Path, model_type: str, *, tie: bool, head_dim: int | None = None, max_shard_size: str | None = None
) -> Any:
    """Save a random 2-layer GQA model (4 query heads, 2 KV heads) with its tokenizer; returns the HF model."""
    transformers = pytest.importorskip("transformers", reason="the reference models need transformers (test-only)")
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rope_theta": 5000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tie,
    }
    if model_type == "llama":
        model_cls = transformers.LlamaForCausalLM
        config = transformers.LlamaConfig(**common, **({"head_dim": head_dim} if head_dim else {}))
    else:
        model_cls = transformers.Qwen2ForCausalLM
        config = transformers.Qwen2Config(**common)
    torch.manual_seed(len(model_type) + tie)
    model = model_cls(config).eval()
    _randomize(model)
    if max_shard_size is None:
        model.save_pretrained(folder)
    else:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    _write_tokenizer(folder, qwen=model_type == "qwen2")
    if model_type == "llama":
        tokenizer_config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": LLAMA_TEMPLATE}
    else:  # Qwen2 style: no BOS, the template in its own file
        tokenizer_config = {"bos_token": None, "eos_token": "<|im_end|>"}
        (folder / "chat_template.jinja").write_text(QWEN_TEMPLATE, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return model


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_adjacent(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of `x[T, H, D]` by position t times frequency i."""
    seq, _, head_dim = x.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)[:, None, :]
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def reference_logits(config: LlamaConfig, w: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """A plain Llama/Qwen2 forward pass over our state dict: logits `[T, vocab]`."""
    seq = len(tokens)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    x = w["tok_embeddings.weight"][torch.tensor(tokens)]
    for i in range(config.n_layers):
        p = f"layers.{i}."
        h = _rms_norm(x, w[p + "attention_norm.weight"], config.norm_eps)
        q = F.linear(h, w[p + "attention.wq.weight"], w.get(p + "attention.wq.bias"))
        k = F.linear(h, w[p + "attention.wk.weight"], w.get(p + "attention.wk.bias"))
        v = F.linear(h, w[p + "attention.wv.weight"], w.get(p + "attention.wv.bias"))
        q = _rope_adjacent(q.view(seq, config.n_heads, config.head_dim), config.rope_theta)
        k = _rope_adjacent(k.view(seq, config.n_kv_heads, config.head_dim), config.rope_theta)
        v = v.view(seq, config.n_kv_heads, config.head_dim)
        group = config.n_heads // config.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(config.head_dim)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attended = torch.einsum("hts,shd->thd", probs, v).reshape(seq, -1)
        x = x + F.linear(attended, w[p + "attention.wo.weight"])
        h = _rms_norm(x, w[p + "ffn_norm.weight"], config.norm_eps)
        gate, up = F.linear(h, w[p + "feed_forward.w1.weight"]), F.linear(h, w[p + "feed_forward.w3.weight"])
        x = x + F.linear(F.silu(gate) * up, w[p + "feed_forward.w2.weight"])
    output = w["tok_embeddings.weight"] if config.tie_embeddings else w["output.weight"]
    return F.linear(_rms_norm(x, w["norm.weight"], config.norm_eps), output)


CASES = {
    "llama": {"model_type": "llama", "tie": False},
    "llama-tied-wide-heads": {"model_type": "llama", "tie": True, "head_dim": 24},
    "llama-sharded": {"model_type": "llama", "tie": False, "max_shard_size": "40KB"},
    "qwen2-tied": {"model_type": "qwen2", "tie": True},
    "qwen2-sharded": {"model_type": "qwen2", "tie": False, "max_shard_size": "40KB"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    ref = save_tiny_model(tmp_path, **CASES[case])
    config, weights, tok = hf_weights.load_hf_model(tmp_path)
    assert config.attn_bias == (CASES[case]["model_type"] == "qwen2")
    assert config.tie_embeddings == CASES[case]["tie"]
    assert ("output.weight" in weights) != config.tie_embeddings
    assert all(t.dtype == torch.float32 for t in weights.values())
    tokens = tok.encode(tok.render_chat(MESSAGES))
    assert len(tokens) > 20
    with torch.no_grad():
        expected = ref(torch.tensor([tokens])).logits[0]
        got = reference_logits(config, weights, tokens)
    torch.testing.assert_close(got, expected, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("case", ["llama", "qwen2-tied"])
def test_logits_miss_without_the_qk_permutation(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parity test above can fail: rows left in rotate-half order give different logits."""
    ref = save_tiny_model(tmp_path, **CASES[case])
    monkeypatch.setattr(hf_weights, "interleave_rope_rows", lambda tensor, n_heads: tensor)
    config, weights, tok = hf_weights.load_hf_model(tmp_path)
    tokens = tok.encode(tok.render_chat(MESSAGES))
    with torch.no_grad():
        expected = ref(torch.tensor([tokens])).logits[0]
        got = reference_logits(config, weights, tokens)
    assert (got - expected).abs().max() > 100 * LOGIT_ATOL


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tokenizer_and_template_match_transformers(model_type: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the reference tokenizer needs transformers")
    save_tiny_model(tmp_path, model_type, tie=True)
    _, _, tok = hf_weights.load_hf_model(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == text
    assert tok.render_chat(MESSAGES) == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.eos_id == tok.tokenizer.token_to_id("<|im_end|>")
    # Llama names its BOS; the Qwen2 folder has none, so the EOS id stands in
    expected_bos = "<|endoftext|>" if model_type == "llama" else "<|im_end|>"
    assert tok.bos_id == tok.tokenizer.token_to_id(expected_bos)


@pytest.mark.parametrize(
    ("head_dim", "rows", "expected"),
    [
        (4, [0, 1, 2, 3], [0, 2, 1, 3]),
        (4, [0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 1, 3, 4, 6, 5, 7]),  # two heads, each permuted on its own
        (6, [0, 1, 2, 3, 4, 5], [0, 3, 1, 4, 2, 5]),
    ],
)
def test_interleave_rope_rows(head_dim: int, rows: list[int], expected: list[int]) -> None:
    n_heads = len(rows) // head_dim
    bias = torch.tensor(rows, dtype=torch.float32)
    weight = bias[:, None].repeat(1, 3)
    assert hf_weights.interleave_rope_rows(bias, n_heads).tolist() == expected
    assert hf_weights.interleave_rope_rows(weight, n_heads)[:, 1].tolist() == expected


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "mistral"}, "unsupported model_type 'mistral'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias or mlp_bias"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "RoPE scaling 'llama3'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling 'linear'"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"num_key_value_heads": 3}, r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"),
        ({"hidden_size": 32}, r"tensor tok_embeddings.weight .* expected float32 \(320, 32\)"),
        ({"num_attention_heads": 8, "num_key_value_heads": 4}, r"wq.weight .* expected float32 \(128, 64\)"),
    ],
)
def test_unsupported_or_inconsistent_config_is_refused(
    changes: dict[str, object], message: str, tmp_path: Path
) -> None:
    save_tiny_model(tmp_path, "llama", tie=False)
    _edit_config(tmp_path, **changes)
    with pytest.raises(EngineError, match=message):
        hf_weights.load_hf_model(tmp_path)


def test_missing_tensor_is_refused(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "qwen2", tie=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(EngineError, match=r"1 tensors missing .*layers\.1\.attention\.wk\.bias"):
        hf_weights.load_hf_model(tmp_path)


def test_unknown_tensor_is_refused(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "llama", tie=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(EngineError, match="unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"):
        hf_weights.load_hf_model(tmp_path)


def test_bfloat16_weights_become_float32(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "llama", tie=True)
    exact = hf_weights.load_hf_model(tmp_path)[1]
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, tmp_path / "model.safetensors")
    _, weights, _ = hf_weights.load_hf_model(tmp_path)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, exact[name], atol=0.01 * exact[name].abs().max().item(), rtol=0)


def test_folder_without_chat_template_is_refused(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "qwen2", tie=True)
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(EngineError, match="no chat template"):
        hf_weights.load_hf_model(tmp_path)


def test_named_templates_and_token_dicts(tmp_path: Path) -> None:
    """Older `tokenizer_config.json` shapes: a list of named templates and AddedToken dicts."""
    save_tiny_model(tmp_path, "qwen2", tie=True)
    (tmp_path / "chat_template.jinja").unlink()
    tokenizer_config = {
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": QWEN_TEMPLATE}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tok: ChatTokenizer = hf_weights.load_hf_model(tmp_path)[2]
    assert tok.chat_template == QWEN_TEMPLATE
    assert (tok.bos_id, tok.eos_id) == (0, 2)


def test_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="no Hugging Face model folder"):
        hf_weights.load_hf_model(tmp_path / "nope")


def test_uncached_hub_id_says_only_local_folders_work(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # so the id cannot name a relative folder
    with pytest.raises(EngineError, match="only local model folders can be loaded offline"):
        hf_weights.load_hf_model("duplexd-tests/not-a-real-model")


@pytest.mark.parametrize("case", ["llama", "qwen2-tied"])
def test_engine_runs_hf_folders_like_transformers(case: str, tmp_path: Path) -> None:
    """The engine's own model (fused q/k/v with Qwen2's biases) and its cached decode on an HF folder."""
    from duplexd.dialog.engine import DialogEngine, EngineConfig
    from duplexd.dialog.model import Transformer
    from duplexd.dialog.weights import load_weights

    ref = save_tiny_model(tmp_path, **CASES[case])
    loaded = load_weights(tmp_path)
    model = Transformer.from_state_dict(loaded.config, loaded.weights)
    tok = loaded.tokenizer
    tokens = tok.encode(tok.render_chat(MESSAGES))
    with torch.no_grad():
        torch.testing.assert_close(
            model(torch.tensor([tokens]))[0], ref(torch.tensor([tokens])).logits[0], atol=LOGIT_ATOL, rtol=0
        )

    # Plain greedy decoding, as transformers' generate: the reply guard (its own tests) is off here, or the
    # random tiny model's repeated tokens would be banned where transformers repeats them.
    unguarded = {"no_repeat_ngram_tokens": 0, "no_copy_ngram_tokens": 0, "max_reply_sentences": 0}
    engine = DialogEngine(model, tok, EngineConfig(max_sessions=1, max_reply_tokens=8, **unguarded))
    chat = [{"role": "system", "content": "Be brief."}, MESSAGES[0]]
    sid = engine.open(chat[0]["content"])
    engine.append_user_text(sid, chat[1]["content"])
    engine.start_reply(sid)
    got: list[int] = []
    while engine.busy():
        got.extend(engine.step().get(sid, []))
    prompt = tok.encode(tok.render_chat(chat))
    with torch.no_grad():
        expected = ref.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=len(got),
            do_sample=False,
            pad_token_id=tok.eos_id,
        )[0, len(prompt) :].tolist()
    assert got and got == expected
