"""The SmolLM2 GGUF through our own tokenizer and Llama forward pass, against transformers as the reference.

The reference is `transformers` (test-only dependency, with `accelerate` and `gguf`) loading the same GGUF
file with `gguf_file=`: it dequantizes the same Q4_1/Q8_0 blocks to float32, un-permutes Q/K and runs
Hugging Face's Llama. Both sides run in float32 on CPU, so logits agree to float rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGUFReader

from duplexd.dialog.gguf_weights import ChatTokenizer, read_config, read_tokenizer
from duplexd.dialog.model import Transformer

pytestmark = pytest.mark.slow

# Measured max |logit difference| is ~1e-4 on logits of magnitude ~40 (float32 rounding through 30 layers
# and differently ordered matmuls). 2e-3 leaves headroom yet fails on real bugs: measured, a rotate-half
# RoPE on the GGUF layout moves logits by ~38, a wrong GQA grouping by ~45, a norm epsilon of 1e-6 by 0.03.
LOGIT_ATOL = 2e-3

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "Ça va? Grüße aus München — naïve café 日本語 🙂",
    "def f(x):\n\treturn x ** 2  # square\n",
    "<|im_start|>user\nHi there<|im_end|>\n",
]

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def tok(reader: GGUFReader) -> ChatTokenizer:
    return read_tokenizer(reader)


@pytest.fixture(scope="module")
def model(reader: GGUFReader) -> Transformer:
    return Transformer.from_reader(reader)


@pytest.fixture(scope="module")
def ref_tok(gguf_file: Path) -> Any:
    transformers = pytest.importorskip("transformers", reason="reference tokenizer needs transformers (test-only)")
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def ref_model(gguf_file: Path) -> Any:
    transformers = pytest.importorskip("transformers", reason="reference model needs transformers (test-only)")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    return ref.eval()


def test_config_matches_smollm2_135m(reader: GGUFReader) -> None:
    config = read_config(reader)
    assert (config.vocab, config.dim, config.n_layers) == (49152, 576, 30)
    assert (config.n_heads, config.n_kv_heads, config.head_dim, config.hidden_dim) == (9, 3, 64, 1536)
    assert config.tie_embeddings


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tok: ChatTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_reference(tok: ChatTokenizer, ref_tok: Any, text: str) -> None:
    assert tok.encode(text) == ref_tok(text, add_special_tokens=False)["input_ids"]


def test_special_tokens_are_single_ids(tok: ChatTokenizer) -> None:
    assert tok.encode("<|im_start|>") == [tok.bos_id]
    assert tok.encode("<|im_end|>") == [tok.eos_id]
    assert tok.decode([tok.bos_id, tok.eos_id], skip_special_tokens=True) == ""


def test_digits_are_split_one_per_token(tok: ChatTokenizer) -> None:
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


def test_chat_template_renders_system_and_user(tok: ChatTokenizer) -> None:
    assert tok.render_chat(MESSAGES) == (
        "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_matches_reference(tok: ChatTokenizer, ref_tok: Any) -> None:
    for add_generation_prompt in (True, False):
        for messages in (MESSAGES, MESSAGES[1:]):
            ours = tok.render_chat(messages, add_generation_prompt=add_generation_prompt)
            ref = ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert ours == ref


def test_chat_template_adds_default_system_prompt(tok: ChatTokenizer) -> None:
    text = tok.render_chat(MESSAGES[1:], add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")


@torch.inference_mode()
def test_logits_match_reference(tok: ChatTokenizer, model: Transformer, ref_model: Any) -> None:
    ids = torch.tensor([tok.encode(tok.render_chat(MESSAGES) + "The capital of France is Paris.")])
    ours = model(ids)
    ref = ref_model(ids).logits
    assert ours.shape == ref.shape == (1, ids.shape[1], 49152)
    diff = (ours - ref).abs().max().item()
    print(f"max |logit diff| over {ids.shape[1]} positions: {diff:.3g}")
    assert diff <= LOGIT_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@torch.inference_mode()
def test_causal_prefix_logits_do_not_depend_on_later_tokens(tok: ChatTokenizer, model: Transformer) -> None:
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog")])
    full = model(ids)
    prefix = model(ids[:, :4])
    torch.testing.assert_close(prefix, full[:, :4], atol=1e-4, rtol=0)


@torch.inference_mode()
def test_greedy_decoding_matches_reference(tok: ChatTokenizer, model: Transformer, ref_model: Any) -> None:
    chat = [MESSAGES[0], {"role": "user", "content": "Describe the sea in three sentences."}]
    prompt = tok.encode(tok.render_chat(chat))
    new_tokens = 20
    ids = list(prompt)
    for _ in range(new_tokens):  # full recompute per step: there is no KV cache yet
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        if ids[-1] == tok.eos_id:
            break
    ours = ids[len(prompt) :]
    ref = ref_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tok.eos_id,
    )[0, len(prompt) :].tolist()
    print("greedy reply:", repr(tok.decode(ours)))
    assert len(ours) == new_tokens, "the reply ended early: the prompt must ask for a longer answer"
    assert ours == ref
