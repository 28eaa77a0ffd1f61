"""Model shapes: `LlamaConfig` (one dataclass for Llama 3.x, Qwen2.5 and Qwen3, the differences being switches),
the published named shapes, and recipe field overrides checked against each field's type.

The "hf" name (shape from a Hugging Face folder's config.json) is resolved in models/hf_config.py.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass

from config import RecipeError
from config.rope import ROPE_SCALING_TYPES, is_scaling_type


@dataclass
class LlamaConfig:
    """Shape and numerics of a Llama 3 model; defaults are the CPU debug model."""

    dim: int = 256
    """Hidden size (HF `hidden_size`)."""
    n_layers: int = 6
    """Number of transformer blocks."""
    n_heads: int = 16
    """Query heads; head_dim = dim // n_heads unless attention_head_dim is set."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head attention)."""
    vocab_size: int = 2048
    """Rows of the embedding and of the output projection."""
    multiple_of: int = 256
    """The SwiGLU hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the SwiGLU hidden size 8*dim/3 before rounding; None means 1."""
    intermediate_size: int = 0
    """The SwiGLU hidden size itself (HF `intermediate_size`); 0 = Meta's rule from multiple_of/ffn_dim_multiplier."""
    attention_head_dim: int = 0
    """Per-head width (HF `head_dim`, Qwen3: 128 at any hidden size); 0 = dim // n_heads."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2.5)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    """The output projection is the embedding matrix: one parameter, trained and exported as one."""
    family: str = "llama"
    """Hugging Face model_type written on export: llama | qwen2 | qwen3."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base."""
    rope_scaling_factor: float | None = None
    """RoPE scaling factor (8 for the released Llama 3.1 models); None disables the scaling."""
    rope_type: str = "llama3"
    """The scaling applied when rope_scaling_factor is set: llama3 (Llama 3.1) | yarn (Hugging Face's YaRN)."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN: pairs turning more than this many times over the original context keep their frequency."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: pairs turning fewer than this many times are divided by the factor."""
    rope_yarn_truncate: bool = True
    """YaRN: round the correction range to whole pairs (HF `truncate`)."""
    rope_attention_factor: float | None = None
    """YaRN: cos/sin scale; None = 0.1 ln(factor) + 1."""
    rope_low_freq_factor: float = 1.0
    """Llama 3.1 scaling: wavelengths above original_max_position / low_freq_factor are divided by the factor."""
    rope_high_freq_factor: float = 4.0
    """Llama 3.1 scaling: wavelengths below original_max_position / high_freq_factor are left alone."""
    rope_original_max_position: int = 8192
    """Llama 3.1 scaling: the context length the unscaled model was trained at."""
    max_seq_len: int = 131072
    """Longest sequence the model is meant for; informational, as RoPE is computed on the fly and sizes nothing."""
    depth_init: bool = True
    """Output projections (wo, w2, w3) get std 0.02/sqrt(2*(layer_id+1)) if True, else 0.02/sqrt(2*n_layers)."""
    mlp_chunk_tokens: int = 0
    """SwiGLU computed over tiles of this many tokens, each recomputed in backward (models/tiled_mlp.py), so the
    (tokens x ffn_hidden_dim) intermediates exist for one tile at a time; 0 = the whole sequence at once."""
    norm_chunk_tokens: int = 0
    """The blocks' RMSNorms computed over tiles of this many tokens (models/tiled_norm.py), saving only their input
    and one float32 scale per token: their float32 temporaries exist for one tile at a time; 0 = untiled."""

    def __post_init__(self):
        for name in ("mlp_chunk_tokens", "norm_chunk_tokens"):
            if getattr(self, name) < 0:
                raise RecipeError(f"[model] {name} = {getattr(self, name)} must be >= 0 (0 = untiled)")
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "rope_original_max_position",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise RecipeError(f"[model] {name} = {getattr(self, name)} must be a positive integer")
        if not is_scaling_type(self.rope_type):
            raise RecipeError(f"[model] rope_type = {self.rope_type!r} is not supported; use "
                              f"{' or '.join(ROPE_SCALING_TYPES)} (with rope_scaling_factor; unset it for plain RoPE)")
        if self.family not in FAMILIES:
            raise RecipeError(f"[model] family = {self.family!r} is not supported; use one of {', '.join(FAMILIES)}")
        if self.intermediate_size < 0 or self.attention_head_dim < 0:
            raise RecipeError("[model] intermediate_size and attention_head_dim must be >= 0 (0 = derived)")
        if not self.attention_head_dim and self.dim % self.n_heads:
            raise RecipeError(f"[model] dim = {self.dim} is not divisible by n_heads = {self.n_heads}; "
                              f"change one of them (or set attention_head_dim)")
        if self.head_dim % 2:
            raise RecipeError(f"[model] head_dim = {self.head_dim} must be even for RoPE")
        if self.num_kv_heads < 1 or self.n_heads % self.num_kv_heads:
            raise RecipeError(f"[model] n_heads = {self.n_heads} must be a multiple of n_kv_heads = "
                              f"{self.n_kv_heads}")
        if (self.rope_scaling_factor is not None and self.rope_type == "llama3"
                and not self.rope_high_freq_factor > self.rope_low_freq_factor):
            raise RecipeError(f"[model] rope_high_freq_factor = {self.rope_high_freq_factor} must exceed "
                              f"rope_low_freq_factor = {self.rope_low_freq_factor}")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def rope_kwargs(self) -> dict:
        """The keyword arguments of `RotaryEmbedding.reset` / `Llama.set_rope` this config's RoPE is."""
        return dict(theta=self.rope_theta, scaling_factor=self.rope_scaling_factor,
                    low_freq_factor=self.rope_low_freq_factor, high_freq_factor=self.rope_high_freq_factor,
                    original_max_position=self.rope_original_max_position,
                    rope_type=None if self.rope_scaling_factor is None else self.rope_type,
                    beta_fast=self.rope_yarn_beta_fast, beta_slow=self.rope_yarn_beta_slow,
                    truncate=self.rope_yarn_truncate, attention_factor=self.rope_attention_factor)

    @property
    def num_kv_heads(self) -> int:
        """n_kv_heads with None resolved to n_heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size (HF `intermediate_size`): the field when set, else Meta's rule."""
        if self.intermediate_size:
            return self.intermediate_size
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


FAMILIES = ("llama", "qwen2", "qwen3")

_LLAMA31_ROPE = dict(rope_theta=500000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                     rope_high_freq_factor=4.0, rope_original_max_position=8192, max_seq_len=131072)

MODEL_CONFIGS: dict[str, LlamaConfig] = {
    # TorchTitan's debug model shape (6.16M parameters with embeddings); no RoPE scaling.
    "debug": LlamaConfig(),
    # Published Llama 3.1 shapes (Meta's params.json); Llama 3 has the same shapes without the RoPE scaling.
    "llama3_8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                             ffn_dim_multiplier=1.3, **_LLAMA31_ROPE),
    "llama3_70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                              ffn_dim_multiplier=1.3, **_LLAMA31_ROPE),
    "llama3_405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                               multiple_of=4096, ffn_dim_multiplier=1.2, **_LLAMA31_ROPE),
    # Published Llama 3.2 / Qwen2.5 / Qwen3 shapes (their config.json files on the Hugging Face hub).
    "llama3_2_1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                               intermediate_size=8192, attention_head_dim=64, tie_embeddings=True,
                               **{**_LLAMA31_ROPE, "rope_scaling_factor": 32.0}),
    "llama3_2_3b": LlamaConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                               intermediate_size=8192, attention_head_dim=128, tie_embeddings=True,
                               **{**_LLAMA31_ROPE, "rope_scaling_factor": 32.0}),
    "qwen2_5_7b": LlamaConfig(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064,
                              intermediate_size=18944, qkv_bias=True, norm_eps=1e-6, rope_theta=1000000.0,
                              max_seq_len=32768, family="qwen2"),
    "qwen3_8b": LlamaConfig(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, vocab_size=151936,
                            intermediate_size=12288, attention_head_dim=128, qk_norm=True, norm_eps=1e-6,
                            rope_theta=1000000.0, max_seq_len=40960, family="qwen3"),
}
HF_NAME = "hf"
"""`[model] name` that takes the shape from checkpoint.hf_load_path's config.json (models/hf_config.py)."""


def _accepts(value, hint) -> bool:
    """Whether a recipe value fits a config field's annotation (int for float is fine, bool for int is not)."""
    for allowed in typing.get_args(hint) or (hint,):
        if allowed is type(None) and value is None:
            return True
        if allowed is bool and isinstance(value, bool):
            return True
        if allowed in (int, float) and isinstance(value, int) and not isinstance(value, bool):
            return True
        if allowed is float and isinstance(value, float):
            return True
        if allowed is str and isinstance(value, str):
            return True
    return False


def model_config(name: str, **overrides) -> LlamaConfig:
    """A fresh copy of a named config with field overrides, e.g. model_config("debug", n_layers=2)."""
    if name not in MODEL_CONFIGS:
        close = difflib.get_close_matches(name, [*MODEL_CONFIGS, HF_NAME], n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"choose one of {', '.join([*MODEL_CONFIGS, HF_NAME])}"
        raise RecipeError(f"[model] name = {name!r} is not a known model; {hint}")
    return with_overrides(MODEL_CONFIGS[name], overrides)


def with_overrides(base: LlamaConfig, overrides: dict) -> LlamaConfig:
    """A copy of `base` with recipe field overrides, each checked against the field's type."""
    hints = typing.get_type_hints(LlamaConfig)
    for key, value in overrides.items():
        if key not in hints:
            close = difflib.get_close_matches(key, list(hints), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(hints)}"
            raise RecipeError(f"[model] {key} is not a model field; {hint}")
        if not _accepts(value, hints[key]):
            expected = getattr(hints[key], "__name__", hints[key])
            raise RecipeError(f"[model] {key} = {value!r} has the wrong type; expected {expected}")
        if float in (typing.get_args(hints[key]) or (hints[key],)) and isinstance(value, int):
            overrides[key] = float(value)
    return dataclasses.replace(base, **overrides)
