"""Llama 3.x / Qwen2.5 / Qwen3 decoder in TorchTitan's module layout, written for 4-D parallelism.

One block serves all three families; the differences are switches on `LlamaConfig`: `qkv_bias` (Qwen2.5),
`qk_norm` with an explicit `attention_head_dim` (Qwen3), `tie_embeddings` (Llama 3.2 1B/3B, small Qwens: the output
layer IS the embedding parameter) and the RoPE type (default / llama3 / yarn, models/rope.py).

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
import hashlib
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.autocast import to_autocast_dtype
from models.chunked_loss import chunked_linear_cross_entropy
from models.chunked_scores import chunked_token_scores
from models.rope import RotaryEmbedding, apply_rotary
from models.tiled_mlp import tiled_norm_swiglu, tiled_swiglu
from models.tiled_norm import tiled_rms_norm
from models.model_config import HF_NAME, MODEL_CONFIGS, LlamaConfig, model_config  # noqa: F401 (re-exported)
from models.hf_config import recipe_model_config  # noqa: F401 (re-exported)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 and cast back before the weight, as Meta's and HF's code do."""

    def __init__(self, dim: int, eps: float, tile_tokens: int = 0):
        super().__init__()
        self.eps = eps
        self.tile_tokens = tile_tokens
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast (one-device bf16, issue 36) the weight in bf16, as FSDP2's bf16 weights were: a bf16 output
        # (autocast leaves this product alone), cast once here, not once per GEMM that reads it.
        (weight,) = to_autocast_dtype(self.weight)
        if self.tile_tokens:  # same numbers, float32 temporaries one tile at a time (models/tiled_norm.py)
            return tiled_rms_norm(x, weight, self.eps, self.tile_tokens)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * weight


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE; q/k/v biases with `qkv_bias`, per-head q/k RMSNorm before
    RoPE with `qk_norm` (`q_norm` / `k_norm` are None otherwise)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=config.qkv_bias)
        self.wk = nn.Linear(config.dim, config.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wv = nn.Linear(config.dim, config.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.sublayer_hook: Callable | None = None
        """Set by the composer to run the sublayer in head groups (parallelisms/sublayer_groups.py): its output,
        or None where that does not apply and this forward runs."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.sublayer_hook is not None:
            grouped = self.sublayer_hook(self, x, cos, sin)
            if grouped is not None:
                return grouped
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its slice of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
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
        self.attention_norm = RMSNorm(config.dim, config.norm_eps, config.norm_chunk_tokens)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, config.norm_chunk_tokens)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim, config.mlp_chunk_tokens)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), cos, sin)
        if self._norm_in_feed_forward(h):  # the same numbers; the norm's output never whole (models/tiled_mlp.py)
            (norm_weight,) = to_autocast_dtype(self.ffn_norm.weight)
            ff = self.feed_forward
            return h + tiled_norm_swiglu(h, norm_weight, self.ffn_norm.eps, ff.w1.weight, ff.w3.weight,
                                         ff.w2.weight, ff.tile_tokens)
        return h + self.feed_forward(self.ffn_norm(h))

    def _norm_in_feed_forward(self, h: torch.Tensor) -> bool:
        """Both tiled (model.norm_chunk_tokens, mlp_chunk_tokens) and no tensor parallelism (there the norm runs on
        sequence shards, the SwiGLU on the gathered rows): the feed-forward's tiles normalise their own rows."""
        ff = self.feed_forward
        return (self.ffn_norm.tile_tokens > 0 and ff.tile_tokens > 0
                and not any(isinstance(t, DTensor) for t in (h, ff.w1.weight, self.ffn_norm.weight)))


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


def _zeros(shape, generator) -> torch.Tensor:
    return torch.zeros(shape, device="cpu")


class Llama(nn.Module):
    """The decoder. Construction does not run `init_weights`: build on the meta device, shard, then initialise."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        kw = config.rope_kwargs
        self.rope = RotaryEmbedding(config.head_dim, kw.pop("theta"), kw.pop("scaling_factor"), **kw)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_chunk_tokens)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With `tie_embeddings`, make the output layer's weight the embedding parameter itself. Called again after
        anything that replaces parameters module by module (`to_empty`, `to`, tensor parallelism's plans), which
        would otherwise leave two copies; under FSDP2 both modules keep the one sharded parameter on their own."""
        if self.config.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None, *,
                labels: torch.Tensor | None = None, loss_chunk_tokens: int = 0,
                sparse_labels: bool = False, token_scores: bool = False) -> torch.Tensor:
        """tokens (B, S) ids, or (B, S, dim) hidden states when `tok_embeddings` is None -> logits (B, S, vocab),
        or hidden states when `output` is None. position_ids (B, S) ints, default 0..S-1 for every row.
        With `labels` (B, S) and `loss_chunk_tokens` > 0 (and the output layer held): the summed cross entropy
        instead of the logits, computed that many tokens at a time (models/chunked_loss.py), over the labelled
        tokens only when `sparse_labels`; elsewhere ignored. With `token_scores` as well: each token's loss and
        argmax instead of the sum (models/chunked_scores.py, for evaluation; no gradient)."""
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
            if token_scores:
                return chunked_token_scores(h, self.output.weight, labels, loss_chunk_tokens, sparse_labels)
            return chunked_linear_cross_entropy(h, self.output.weight, labels, loss_chunk_tokens, sparse_labels)
        if self.output is not None:
            h = self.output(h)
        return h

    def set_rope(self, theta: float, scaling_factor: float | None = None, low_freq_factor: float = 1.0,
                 high_freq_factor: float = 4.0, original_max_position: int = 8192, *, rope_type: str = "llama3",
                 beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True,
                 attention_factor: float | None = None) -> None:
        """Switch RoPE (e.g. a larger theta, or YaRN, at a context-length ramp stage); also updates `self.config`."""
        self.config = dataclasses.replace(
            self.config, rope_theta=theta, rope_scaling_factor=scaling_factor, rope_low_freq_factor=low_freq_factor,
            rope_high_freq_factor=high_freq_factor, rope_original_max_position=original_max_position,
            rope_type=rope_type or "llama3", rope_yarn_beta_fast=beta_fast, rope_yarn_beta_slow=beta_slow,
            rope_yarn_truncate=truncate, rope_attention_factor=attention_factor)
        kw = self.config.rope_kwargs
        self.rope.reset(kw.pop("theta"), kw.pop("scaling_factor"), **kw)

    def set_rope_from(self, config: LlamaConfig) -> None:
        """Switch RoPE to `config`'s (every RoPE field of it)."""
        self.set_rope(**{**config.rope_kwargs, "rope_type": config.rope_type})

    def _initializer(self, name: str) -> Callable[[tuple, torch.Generator], torch.Tensor]:
        """The draw for one parameter, by canonical name. The layer id is the ModuleDict key, so a pipeline stage
        holding layers "3" and "4" initialises them exactly as the full model does."""
        cfg = self.config
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2].endswith("norm"):
            return _ones
        if name == "tok_embeddings.weight" and cfg.tie_embeddings:
            return _truncated_normal(cfg.dim ** -0.5)  # also the output layer: the output's rule keeps logits O(1)
        if name == "tok_embeddings.weight":
            return _normal(1.0)  # as TorchTitan; the first RMSNorm makes the embedding scale irrelevant
        if name == "output.weight":
            return _truncated_normal(cfg.dim ** -0.5)
        if len(parts) == 5 and parts[0] == "layers" and parts[4] == "bias":
            return _zeros
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
        kw = self.config.rope_kwargs
        self.rope.reset(kw.pop("theta"), kw.pop("scaling_factor"), **kw)
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
                # shard into shard: a host-resident one (training.cpu_offload) gets the device's copy of its values
                param.to_local().copy_(full.to_local())
                continue
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
