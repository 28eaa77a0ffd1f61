"""Llama 3 / 3.1 decoder in TorchTitan's module layout, written for 4-D parallelism.

Layout choices other code relies on:
- Module names follow TorchTitan (`tok_embeddings`, `layers["i"].attention.wq`, `feed_forward.w1`, `norm`, `output`) so
  tensor-parallel plans and the HF weight mapping read directly off the names.
- `layers` is an `nn.ModuleDict` keyed "0".."n-1": a pipeline stage deletes the blocks it does not own and sets
  `tok_embeddings` / `norm` / `output` to None; `forward` then takes or returns hidden states.
- Attention infers the local head count from the projection output, so column-sharded wq/wk/wv just work, and it
  calls `F.scaled_dot_product_attention` with unexpanded K/V so context parallelism can ship the small K/V around
  the ring.
- RoPE angles come from `position_ids` on every call (see models/rope.py).

Block call signature (for TP `PrepareModuleInput` plans): `block(h, cos, sin)` and `attention(x, cos, sin)`, where
cos/sin are (B, S, 1, head_dim // 2) float32 computed once per forward by `Llama.rope(position_ids)`.
Under pipeline or sequence parallelism, pass `position_ids` explicitly: the default arange is taken from the first two
dims of the stage input.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
import typing
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.chunked_loss import chunked_linear_cross_entropy
from models.rope import RotaryEmbedding, apply_rotary
from models.tiled_mlp import tiled_swiglu
from config import Config, RecipeError


@dataclass
class LlamaConfig:
    """Shape and numerics of a Llama 3 model; defaults are the CPU debug model."""

    dim: int = 256
    """Hidden size (HF `hidden_size`)."""
    n_layers: int = 6
    """Number of transformer blocks."""
    n_heads: int = 16
    """Query heads; head_dim = dim // n_heads."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head attention)."""
    vocab_size: int = 2048
    """Rows of the embedding and of the output projection."""
    multiple_of: int = 256
    """The SwiGLU hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the SwiGLU hidden size 8*dim/3 before rounding; None means 1."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base."""
    rope_scaling_factor: float | None = None
    """Llama 3.1 RoPE frequency scaling factor (8 for the released 3.1 models); None disables the scaling."""
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

    def __post_init__(self):
        if self.mlp_chunk_tokens < 0:
            raise RecipeError(f"[model] mlp_chunk_tokens = {self.mlp_chunk_tokens} must be >= 0 (0 = untiled)")
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "rope_original_max_position",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise RecipeError(f"[model] {name} = {getattr(self, name)} must be a positive integer")
        if self.dim % self.n_heads:
            raise RecipeError(f"[model] dim = {self.dim} is not divisible by n_heads = {self.n_heads}; "
                              f"change one of them")
        if self.head_dim % 2:
            raise RecipeError(f"[model] head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")
        if self.num_kv_heads < 1 or self.n_heads % self.num_kv_heads:
            raise RecipeError(f"[model] n_heads = {self.n_heads} must be a multiple of n_kv_heads = "
                              f"{self.n_kv_heads}")
        if self.rope_scaling_factor is not None and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise RecipeError(f"[model] rope_high_freq_factor = {self.rope_high_freq_factor} must exceed "
                              f"rope_low_freq_factor = {self.rope_low_freq_factor}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def num_kv_heads(self) -> int:
        """n_kv_heads with None resolved to n_heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size by Meta's rule (HF `intermediate_size`)."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


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
}


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
    return False


def model_config(name: str, **overrides) -> LlamaConfig:
    """A fresh copy of a named config with field overrides, e.g. model_config("debug", n_layers=2)."""
    if name not in MODEL_CONFIGS:
        close = difflib.get_close_matches(name, list(MODEL_CONFIGS), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"choose one of {', '.join(MODEL_CONFIGS)}"
        raise RecipeError(f"[model] name = {name!r} is not a known model; {hint}")
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
    return dataclasses.replace(MODEL_CONFIGS[name], **overrides)


def recipe_model_config(cfg: Config) -> LlamaConfig:
    """The Llama shape a recipe asks for: its [model] name with the fields the recipe sets (a fresh copy)."""
    return model_config(cfg.model.name, **cfg.model.overrides())


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 and cast back before the weight, as Meta's and HF's code do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE; no biases."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its slice of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # K/V stay unexpanded: context parallelism intercepts exactly this call and ships the smaller K/V.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim ** -0.5,
                                             enable_gqa=k.shape[1] < q.shape[1])
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), with w1 the gate, w3 the up and w2 the down projection."""

    def __init__(self, dim: int, hidden_dim: int, tile_tokens: int = 0):
        super().__init__()
        self.tile_tokens = tile_tokens
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_tokens:  # the weights directly: under TP, tiled_swiglu does the plan's layouts itself
            return tiled_swiglu(x, self.w1.weight, self.w3.weight, self.w2.weight, self.tile_tokens)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: h + attention(norm(h)), then + feed_forward(norm(.))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim, config.mlp_chunk_tokens)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


# Wrapper modules that insert a name component without changing what the parameter is.
_WRAPPER_NAME_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def canonical_name(fqn: str) -> str:
    """A parameter's name with activation-checkpoint / torch.compile / FSDP1 wrapper components removed."""
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_NAME_PARTS)


def _param_seed(seed: int, name: str) -> int:
    """Stable across processes and Python runs (unlike hash()), and distinct per (seed, parameter)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _truncated_normal(std: float) -> Callable[[tuple, torch.Generator], torch.Tensor]:
    def draw(shape, generator):
        return nn.init.trunc_normal_(torch.empty(shape, device="cpu"), 0.0, std, -3 * std, 3 * std, generator=generator)
    return draw


def _normal(std: float) -> Callable[[tuple, torch.Generator], torch.Tensor]:
    return lambda shape, generator: torch.empty(shape, device="cpu").normal_(0.0, std, generator=generator)


def _ones(shape, generator) -> torch.Tensor:
    return torch.ones(shape, device="cpu")


class Llama(nn.Module):
    """The decoder. Construction does not run `init_weights`: build on the meta device, shard, then initialise."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling_factor,
                                    config.rope_low_freq_factor, config.rope_high_freq_factor,
                                    config.rope_original_max_position)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, *,
                labels: torch.Tensor | None = None, loss_chunk_tokens: int = 0,
                sparse_labels: bool = False) -> torch.Tensor:
        """tokens (B, S) ids, or (B, S, dim) hidden states when `tok_embeddings` is None -> logits (B, S, vocab),
        or hidden states when `output` is None. position_ids (B, S) ints, default 0..S-1 for every row.
        With `labels` (B, S) and `loss_chunk_tokens` > 0 (and the output layer held): the summed cross entropy
        instead of the logits, computed that many tokens at a time (models/chunked_loss.py), over the labelled
        tokens only when `sparse_labels`; elsewhere ignored."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if position_ids is None:
            bsz, seqlen = tokens.shape[:2]
            position_ids = torch.arange(seqlen, device=tokens.device).expand(bsz, seqlen)
        cos, sin = self.rope(position_ids)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None and labels is not None and loss_chunk_tokens > 0:
            return chunked_linear_cross_entropy(h, self.output.weight, labels, loss_chunk_tokens, sparse_labels)
        if self.output is not None:
            h = self.output(h)
        return h

    def set_rope(self, theta: float, scaling_factor: float | None = None, low_freq_factor: float = 1.0,
                 high_freq_factor: float = 4.0, original_max_position: int = 8192) -> None:
        """Switch RoPE (e.g. a larger theta at a context-length ramp stage); also updates `self.config`."""
        self.config = dataclasses.replace(
            self.config, rope_theta=theta, rope_scaling_factor=scaling_factor, rope_low_freq_factor=low_freq_factor,
            rope_high_freq_factor=high_freq_factor, rope_original_max_position=original_max_position)
        self.rope.reset(theta, scaling_factor, low_freq_factor, high_freq_factor, original_max_position)

    def _initializer(self, name: str) -> Callable[[tuple, torch.Generator], torch.Tensor]:
        """The draw for one parameter, by canonical name. The layer id is the ModuleDict key, so a pipeline stage
        holding layers "3" and "4" initialises them exactly as the full model does."""
        cfg = self.config
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2].endswith("norm"):
            return _ones
        if name == "tok_embeddings.weight":
            return _normal(1.0)  # as TorchTitan; the first RMSNorm makes the embedding scale irrelevant
        if name == "output.weight":
            return _truncated_normal(cfg.dim ** -0.5)
        if len(parts) == 5 and parts[0] == "layers" and parts[4] == "weight":
            if parts[3] in ("wq", "wk", "wv", "w1"):
                return _truncated_normal(0.02)
            if parts[3] in ("wo", "w2", "w3"):
                depth = 2 * (int(parts[1]) + 1) if cfg.depth_init else 2 * cfg.n_layers
                return _truncated_normal(0.02 / math.sqrt(depth))
        raise ValueError(f"init_weights has no rule for parameter {name!r}")

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init, independent of sharding: each parameter's full tensor is drawn on the CPU in float32
        from its own generator (seeded by `seed` and its canonical name), then copied in; a DTensor parameter
        (FSDP/TP) receives its local shard of that same full tensor. Also recomputes the RoPE buffer, so this is the
        one call needed after `to_empty`. Parameters still on the meta device are skipped.

        Scheme (TorchTitan's): embeddings N(0, 1); wq/wk/wv/w1 truncated normal (at +-3 std) std 0.02; wo/w2/w3 std
        0.02/sqrt(2*(layer_id+1)) with depth_init, else 0.02/sqrt(2*n_layers); output std dim**-0.5; norms ones.
        """
        cfg = self.config
        self.rope.reset(cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                        cfg.rope_high_freq_factor, cfg.rope_original_max_position)
        for fqn, param in self.named_parameters():
            name = canonical_name(fqn)
            draw = self._initializer(name)
            if param.device.type == "meta":
                continue
            generator = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
            full = draw(tuple(param.shape), generator)
            if isinstance(param, DTensor):
                full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                                         src_data_rank=None)
            param.copy_(full)


def count_parameters(model: nn.Module) -> int:
    """Parameters counted once each (shared/tied tensors once), at their full size also when sharded (DTensor)."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(config: LlamaConfig, seq_len: int, causal: bool = True) -> float:
    """Training (forward + backward) FLOPs per token.

    6 x (parameters without the embedding, i.e. blocks + final norm + output) for the matmuls, plus attention scores
    and values: 12 x n_layers x n_heads x head_dim x seq_len. With `causal` the attention term is halved because
    only the lower triangle is computed (TorchTitan's MFU counts it in full; pass causal=False to compare).
    """
    attn_proj = config.dim * config.head_dim * (2 * config.n_heads + 2 * config.num_kv_heads)
    block = attn_proj + 3 * config.dim * config.ffn_hidden_dim + 2 * config.dim
    dense = config.n_layers * block + config.dim + config.dim * config.vocab_size
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * seq_len
    return 6.0 * dense + (attention / 2 if causal else attention)
