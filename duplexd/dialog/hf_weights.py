"""Read a local Hugging Face Llama or Qwen2 model folder: config, float32 weights in our names, tokenizer.

A folder holds `config.json`, `model.safetensors` (or shards listed in `model.safetensors.index.json`),
`tokenizer.json`, and `tokenizer_config.json` with the chat template (or a `chat_template.jinja` beside it).
Only local folders are read: with no hub access, a hub id works only if `huggingface_hub` already has it
in its cache.

Q/K layout. Hugging Face stores `q_proj`/`k_proj` rows in the "rotate half" layout (within a head, dimension j
pairs with j + head_dim/2); our RoPE rotates adjacent pairs (2i, 2i+1), the layout of Meta's checkpoints and
of GGUF files. `interleave_rope_rows` moves row j to 2j and row j + head_dim/2 to 2j+1 in every head, which
is the permutation llama.cpp's `convert_hf_to_gguf.py` applies; Q/K biases (Qwen2) are moved the same way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from duplexd.dialog.gguf_weights import ChatTokenizer, LlamaConfig, check_state_dict
from duplexd.errors import EngineError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_PER_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
}
_FIXED = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def load_hf_model(source: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], ChatTokenizer]:
    """Config, float32 state dict (our names, Q/K rows interleaved) and tokenizer of a local model folder."""
    folder = resolve_folder(source)
    raw = _read_json(folder / "config.json")
    config = read_hf_config(raw)
    return config, read_hf_weights(folder, config), read_hf_tokenizer(folder, raw)


def resolve_folder(source: str | Path) -> Path:
    """`source` as a local model folder; a hub id only if `huggingface_hub` has it cached already."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    text = str(source)
    if not path.exists() and _HUB_ID.fullmatch(text):
        cached = _hub_cache(text)
        if cached is not None:
            return cached
        raise EngineError(
            f"{text!r} is not a local folder and is not in the Hugging Face cache; only local model folders can be"
            f" loaded offline (download it where there is network, e.g. `hf download {text} --local-dir DIR`,"
            " and pass DIR)"
        )
    raise EngineError(f"no Hugging Face model folder at {path}")


def _hub_cache(repo_id: str) -> Path | None:
    """The cached snapshot of `repo_id`, never touching the network; None without `huggingface_hub`."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (OSError, ValueError):  # LocalEntryNotFoundError is an OSError; a malformed id a ValueError
        return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EngineError(f"{path.name} is missing from {path.parent}") from None
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise EngineError(f"{path} does not hold a JSON object")
    return data


def read_hf_config(raw: dict[str, Any]) -> LlamaConfig:
    """Our `LlamaConfig` from a `config.json`; refuses what the plain Llama forward pass does not compute."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise EngineError(f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if raw.get("hidden_act", "silu") != "silu":
        raise EngineError(f"unsupported hidden_act {raw['hidden_act']!r} (expected 'silu')")
    if model_type == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise EngineError("Llama models with attention_bias or mlp_bias are not supported")
    if raw.get("use_sliding_window") or any(kind != "full_attention" for kind in raw.get("layer_types") or []):
        raise EngineError("sliding-window attention is not supported")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise EngineError(f"RoPE scaling {rope_type!r} is not supported (only plain RoPE)")
    try:
        dim = int(raw["hidden_size"])
        n_heads = int(raw["num_attention_heads"])
        config = LlamaConfig(
            vocab=int(raw["vocab_size"]),
            dim=dim,
            n_layers=int(raw["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=int(raw.get("head_dim") or dim // n_heads),
            hidden_dim=int(raw["intermediate_size"]),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            norm_eps=float(raw["rms_norm_eps"]),
            context_length=int(raw["max_position_embeddings"]),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attn_bias=model_type == "qwen2",
        )
    except KeyError as exc:
        raise EngineError(f"config.json has no {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise EngineError(f"bad config.json: {exc}") from exc
    return config


def interleave_rope_rows(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a Q/K projection weight or bias from rotate-half to adjacent-pair RoPE layout.

    In each head of `head_dim` rows, row j (j < head_dim/2) moves to 2j and row j + head_dim/2 to 2j+1.
    """
    head_dim = tensor.shape[0] // n_heads
    rest = tensor.shape[1:]
    return tensor.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(tensor.shape).contiguous()


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise EngineError(f"{index} has no weight_map")
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors in {folder} (PyTorch .bin checkpoints are not supported)")
    return files


def _our_name(hf_name: str) -> str | None:
    """Our parameter name for a Hugging Face tensor name; None for tensors we recompute (RoPE frequencies)."""
    if hf_name in _FIXED:
        return _FIXED[hf_name]
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    match = _LAYER.fullmatch(hf_name)
    if match is None or match.group(2) not in _PER_LAYER:
        raise EngineError(f"unexpected tensor {hf_name!r}")
    return f"layers.{int(match.group(1))}.{_PER_LAYER[match.group(2)]}"


def read_hf_weights(folder: Path, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Every tensor as float32 in our names, Q/K rows (and biases) interleaved; checked against `config`."""
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        if not file.is_file():
            raise EngineError(f"weight shard {file.name} is missing from {folder}")
        with safe_open(file, framework="pt") as shard:
            for hf_name in shard.keys():
                name = _our_name(hf_name)
                if name is None:
                    continue
                if name in weights:
                    raise EngineError(f"tensor {hf_name!r} appears in more than one shard")
                weights[name] = shard.get_tensor(hf_name).to(torch.float32).contiguous()
    if config.tie_embeddings:
        weights.pop("output.weight", None)  # a tied checkpoint may still store lm_head; the embedding wins
    check_state_dict(weights, config, str(folder))  # before permuting: the shapes must fit the config
    for name in list(weights):
        if name.endswith(("attention.wq.weight", "attention.wq.bias")):
            weights[name] = interleave_rope_rows(weights[name], config.n_heads)
        elif name.endswith(("attention.wk.weight", "attention.wk.bias")):
            weights[name] = interleave_rope_rows(weights[name], config.n_kv_heads)
    return weights


def _token_text(value: object) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string, an AddedToken dict, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_id(tokenizer: Tokenizer, token: object, fallback: object) -> int | None:
    text = _token_text(token)
    if text is not None:
        token_id = tokenizer.token_to_id(text)
        if token_id is None:
            raise EngineError(f"special token {text!r} is not in tokenizer.json")
        return int(token_id)
    if isinstance(fallback, list):
        fallback = fallback[0] if fallback else None
    return int(fallback) if isinstance(fallback, int) else None


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if template is None and (folder / "chat_template.json").is_file():
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise EngineError(f"{folder} has no chat template (chat_template.jinja or tokenizer_config.json)")
    return template


def read_hf_tokenizer(folder: Path, raw_config: dict[str, Any]) -> ChatTokenizer:
    """`tokenizer.json` with the BOS/EOS ids and chat template of `tokenizer_config.json`.

    Ids fall back to `config.json`'s `bos_token_id`/`eos_token_id`. A model without any BOS (some Qwen2
    exports) gets its EOS id as `bos_id`; such models' chat templates do not use `bos_token`.
    """
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise EngineError(f"tokenizer.json is missing from {folder}")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise EngineError(f"cannot read {path}: {exc}") from exc
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = _read_json(config_path) if config_path.is_file() else {}
    eos_id = _special_id(tokenizer, tokenizer_config.get("eos_token"), raw_config.get("eos_token_id"))
    if eos_id is None:
        raise EngineError(f"{folder} names no EOS token (tokenizer_config.json eos_token or config.json)")
    bos_id = _special_id(tokenizer, tokenizer_config.get("bos_token"), raw_config.get("bos_token_id"))
    return ChatTokenizer(
        tokenizer=tokenizer,
        bos_id=eos_id if bos_id is None else bos_id,
        eos_id=eos_id,
        chat_template=_chat_template(folder, tokenizer_config),
    )
