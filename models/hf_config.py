"""Hugging Face config.json <-> `LlamaConfig`, for Llama 3.x, Qwen2.5 (`qwen2`) and Qwen3 (`qwen3`) folders.

Reading accepts transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) layouts; writing emits
both, so either version loads an export. Anything our block cannot compute exactly (sliding-window layers, mixtures of
experts, partial rotary, other RoPE types or model types, o_proj/MLP biases) is refused in one line that names the
key and the file, before any process starts. `[model] name = "hf"` resolves here (`recipe_model_config`).
"""
from __future__ import annotations

import json
import math
import os

from config import Config, RecipeError
from config.rope import DEFAULT_ROPE_TYPE, ROPE_TYPES, is_scaling_type
from models.model_config import HF_NAME, LlamaConfig, model_config, with_overrides

SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def read_hf_config(path: str) -> dict:
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise RecipeError(f"'{config_path}' does not exist; point the path at a Hugging Face Llama or Qwen folder "
                          f"(config.json + *.safetensors).") from None
    except json.JSONDecodeError as e:
        raise RecipeError(f"'{config_path}' is not valid JSON ({e}).") from None


def hf_weights_dtype(path: str) -> str | None:
    """The dtype a Hugging Face folder's weights are stored in: config.json's `dtype` (transformers 5) or
    `torch_dtype` (4.x); else the first tensor of its first safetensors file; None when neither says."""
    hf = read_hf_config(path)
    named = hf.get("dtype") or hf.get("torch_dtype")
    if isinstance(named, str) and named in _SAFETENSORS_DTYPES.values():
        return named
    files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    if not files:
        return None
    with open(os.path.join(path, files[0]), "rb") as f:  # safetensors: 8-byte header length, then a JSON header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    stored = [entry["dtype"] for key, entry in header.items() if key != "__metadata__"]
    return _SAFETENSORS_DTYPES.get(stored[0]) if stored else None


_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _rope_fields(hf: dict, where: str) -> dict:
    """transformers 5 keeps RoPE in `rope_parameters`; 4.x in top-level `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not params.get("rope_type") and scaling:
        params = {**scaling, **params}
    kind = params.get("rope_type", params.get("type", DEFAULT_ROPE_TYPE))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise RecipeError(f"{where}: partial_rotary_factor != 1 is not supported (RoPE covers the whole head here).")
    # transformers' own fallbacks, in its order: a top-level original_max_position_embeddings, then the model's
    # (for a default-RoPE model: the context a ramp stage that switches scaling on extends)
    original = (params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                or hf.get("max_position_embeddings") or 8192)
    if kind == DEFAULT_ROPE_TYPE:
        return dict(rope_theta=float(theta), rope_scaling_factor=None, rope_original_max_position=int(original))
    if not is_scaling_type(kind):
        raise RecipeError(f"{where}: rope_type '{kind}' is not supported; use {', '.join(ROPE_TYPES[:-1])} or "
                          f"{ROPE_TYPES[-1]}.")
    out = dict(rope_theta=float(theta), rope_scaling_factor=float(params["factor"]), rope_type=kind,
               rope_original_max_position=int(original))
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(params.get("high_freq_factor", 4.0)))
    else:
        if params.get("mscale") or params.get("mscale_all_dim"):
            raise RecipeError(f"{where}: yarn with mscale / mscale_all_dim is not supported; set attention_factor.")
        out.update(rope_yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                   rope_yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                   rope_yarn_truncate=bool(params.get("truncate", True)),
                   rope_attention_factor=None if params.get("attention_factor") is None
                   else float(params["attention_factor"]))
    return out


def _ffn_fields(dim: int, hidden: int) -> dict:
    """multiple_of / ffn_dim_multiplier when Meta's rule gives SwiGLU size `hidden` (Llama 3.1), else the size."""
    for multiple_of, multiplier in ((256, None), (1024, 1.3), (4096, 1.3), (4096, 1.2)):
        base = int(2 * 4 * dim / 3)
        base = int(multiplier * base) if multiplier else base
        if multiple_of * math.ceil(base / multiple_of) == hidden:
            return dict(multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
    return dict(intermediate_size=hidden)


def check_supported(hf: dict, where: str) -> str:
    """The folder's model_type when our block computes it exactly; a one-line RecipeError naming the key otherwise."""
    kind = hf.get("model_type", "llama")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise RecipeError(f"{where}: model_type '{kind}' is not supported; supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama 3.x, Qwen2.5, Qwen3).")
    for key in _EXPERT_KEYS:
        if hf.get(key):
            raise RecipeError(f"{where}: {key} = {hf[key]} is a mixture of experts, which is not supported; "
                              f"use a dense model.")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise RecipeError(f"{where}: use_sliding_window / layer_types asks for sliding-window attention, which is "
                          f"not supported; set use_sliding_window false (full attention everywhere).")
    if hf.get("hidden_act", "silu") != "silu":
        raise RecipeError(f"{where}: hidden_act = {hf['hidden_act']!r} is not supported (SwiGLU with silu only).")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key) and not (kind == "qwen2" and key == "attention_bias"):
            raise RecipeError(f"{where}: {key} = true is not supported for model_type '{kind}' (no o_proj / MLP "
                              f"biases here).")
    return kind


def from_hf_config(hf: dict, where: str = "config.json") -> LlamaConfig:
    """An HF Llama / Qwen2 / Qwen3 config dict (transformers 4.x or 5.x) -> our LlamaConfig."""
    kind = check_supported(hf, where)
    try:
        dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or dim // n_heads)
        cfg = LlamaConfig(dim=dim, n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads,
                          n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
                          attention_head_dim=0 if head_dim * n_heads == dim else head_dim,
                          vocab_size=int(hf["vocab_size"]), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                          max_seq_len=int(hf.get("max_position_embeddings", 131072)),
                          qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3", family=kind,
                          tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                          **_ffn_fields(dim, int(hf["intermediate_size"])), **_rope_fields(hf, where))
    except KeyError as e:
        raise RecipeError(f"{where}: missing key {e.args[0]!r}; is this a Llama or Qwen config.json?") from None
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{where}: a shape field has a wrong value ({e}).") from None
    assert cfg.ffn_hidden_dim == int(hf["intermediate_size"])
    return cfg


def recipe_hf_config(cfg: Config) -> LlamaConfig:
    """The shape of `[model] name = "hf"`: checkpoint.hf_load_path's config.json (recipe fields override it)."""
    path = cfg.checkpoint.hf_load_path
    if not path:
        raise RecipeError(f"[model] name = \"hf\" in {cfg.recipe_path or 'the recipe'} needs checkpoint.hf_load_path "
                          f"(the folder whose config.json gives the shape); set it or name a shape.")
    return from_hf_config(read_hf_config(path), where=os.path.join(path, "config.json"))


def recipe_model_config(cfg: Config) -> LlamaConfig:
    """The model shape a recipe asks for: its [model] name (or, for "hf", the shape of checkpoint.hf_load_path's
    config.json) with the fields the recipe sets (a fresh copy)."""
    if cfg.model.name != HF_NAME:
        return model_config(cfg.model.name, **cfg.model.overrides())
    return with_overrides(recipe_hf_config(cfg), cfg.model.overrides())


def _rope_json(cfg: LlamaConfig) -> tuple[dict, dict | None]:
    """(transformers 5 `rope_parameters`, transformers 4 `rope_scaling`) of the config's RoPE."""
    if cfg.rope_scaling_factor is None:
        return {"rope_type": DEFAULT_ROPE_TYPE, "rope_theta": cfg.rope_theta}, None
    scaling = {"rope_type": cfg.rope_type, "factor": cfg.rope_scaling_factor,
               "original_max_position_embeddings": cfg.rope_original_max_position}
    if cfg.rope_type == "llama3":
        scaling.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    else:
        scaling.update(beta_fast=cfg.rope_yarn_beta_fast, beta_slow=cfg.rope_yarn_beta_slow,
                       truncate=cfg.rope_yarn_truncate)
        if cfg.rope_attention_factor is not None:
            scaling["attention_factor"] = cfg.rope_attention_factor
    return {**scaling, "rope_theta": cfg.rope_theta}, scaling


def to_hf_config(cfg: LlamaConfig, dtype, *, bos_token_id: int | None = None, eos_token_id=None,
                 max_position_embeddings: int | None = None) -> dict:
    """config.json that transformers 4.x (rope_theta / rope_scaling) and 5.x (rope_parameters) both read.
    `max_position_embeddings` None keeps the config's max_seq_len."""
    rope, scaling = _rope_json(cfg)
    dtype_name = str(dtype).replace("torch.", "")
    out = {
        "architectures": [SUPPORTED_MODEL_TYPES[cfg.family]], "model_type": cfg.family, "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": max_position_embeddings or cfg.max_seq_len, "hidden_act": "silu",
        "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling, "rope_parameters": rope, "torch_dtype": dtype_name, "dtype": dtype_name,
        "use_cache": True, "initializer_range": 0.02, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }
    if cfg.family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    elif cfg.family == "qwen3":
        out.update(attention_bias=False)
    if cfg.family != "llama":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
                   layer_types=["full_attention"] * cfg.n_layers)
    return out
