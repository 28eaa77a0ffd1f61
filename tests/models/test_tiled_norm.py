"""The tiled RMSNorm against the plain one (models/llama.py's RMSNorm, untiled): the same outputs bit for bit in
bf16, and in a small fp32 Llama the same loss and every gradient within 1e-6; its float32 temporaries never span
more than one tile, and the breakdown tool (harness/memory_breakdown.py) sees the norms' share drop."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode

from models.llama import Llama, RMSNorm, model_config
from models.tiled_norm import tiled_rms_norm
from harness.memory_breakdown import BreakdownMode


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_matches_plain_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 64, generator=gen).to(dtype).requires_grad_()
    plain = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        plain.weight.copy_(torch.rand(64, generator=gen) + 0.5)
    grad = torch.randn(3, 37, 64, generator=gen).to(dtype)
    ref = plain(x)
    ref_gx, ref_gw = torch.autograd.grad(ref, (x, plain.weight), grad)
    out = tiled_rms_norm(x, plain.weight, 1e-5, tile_tokens=10)  # 111 rows: 11 full tiles and one of 1
    gx, gw = torch.autograd.grad(out, (x, plain.weight), grad)
    assert torch.equal(out, ref)
    bound = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel(gx, ref_gx) <= bound and rel(gw, ref_gw) <= bound


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels=tokens, loss_chunk_tokens=16)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_model_loss_and_every_gradient_match_untiled():
    cfg = dataclasses.replace(model_config("debug"), n_layers=2)
    plain = Llama(cfg)
    plain.init_weights(seed=0)
    tiled = Llama(dataclasses.replace(cfg, norm_chunk_tokens=7, mlp_chunk_tokens=9))
    tiled.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 50), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = _loss_and_grads(plain, tokens)
    loss, grads = _loss_and_grads(tiled, tokens)
    assert rel(loss, ref_loss) <= 1e-6
    errors = {n: rel(grads[n], g) for n, g in ref_grads.items()}
    assert max(errors.values()) <= 1e-6, errors


class LargestFloat32(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2:
                self.largest = max(self.largest, t.size(0))
        return out


def test_float32_temporaries_span_one_tile():
    x = torch.randn(100, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    with LargestFloat32() as mode:
        tiled_rms_norm(x, w, 1e-5, tile_tokens=8).sum().backward()
    assert mode.largest == 100  # the (rows, 1) per-token scale, 4 bytes a token; every (rows, dim) one is a tile
    with LargestFloat32() as mode:
        x32 = torch.randn(100, 64, requires_grad=True)
        tiled_rms_norm(x32.to(torch.bfloat16), w, 1e-5, tile_tokens=8)
    assert mode.largest == 100  # only the input's cast, made outside the norm


def _unfused(monkeypatch):
    """The feed-forward's norm as its own tiled op again, before the tiled SwiGLU (what the block did before)."""
    from models.llama import TransformerBlock

    monkeypatch.setattr(TransformerBlock, "_norm_in_feed_forward", lambda self, h: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_fused_into_the_tiled_swiglu_changes_no_bit(monkeypatch, dtype):
    """Both tiled: the feed-forward's tiles normalise their own rows (models/tiled_mlp.tiled_norm_swiglu). With the
    norm's and the SwiGLU's tiles alike, the loss and every gradient equal the norm and the SwiGLU one after the
    other bit for bit (each row computes the same ops; the norm weight's float32 sums run over the same tiles)."""
    cfg = dataclasses.replace(model_config("debug"), n_layers=2, norm_chunk_tokens=9, mlp_chunk_tokens=9)
    model = Llama(cfg)
    model.init_weights(seed=0)
    model = model.to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (2, 50), generator=torch.Generator().manual_seed(1))
    assert all(block._norm_in_feed_forward(torch.zeros(1)) for block in model.layers.values())
    loss, grads = _loss_and_grads(model, tokens)
    _unfused(monkeypatch)
    ref_loss, ref_grads = _loss_and_grads(model, tokens)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items()), [n for n in grads
                                                                          if not torch.equal(grads[n], ref_grads[n])]


def test_breakdown_sees_the_feed_forward_norm_output_go(monkeypatch):
    """At the block's peak the unfused pair holds the norm's bf16 (tokens x dim) output for the SwiGLU's backward;
    fused, the tiles make their own: the norms' share drops by exactly that tensor (8 GiB at 1M tokens per rank of
    an 8B model), less what one tile of it holds while it is made (measured: 2,097,152 - 116,736 bytes)."""
    fused, fused_peak = _norm_share(256, mlp_chunk_tokens=256)
    _unfused(monkeypatch)
    unfused, unfused_peak = _norm_share(256, mlp_chunk_tokens=256)
    whole, one_tile_fp32 = 4096 * 256 * 2, 256 * 256 * 4
    assert whole - one_tile_fp32 <= unfused - fused <= whole and fused_peak < unfused_peak, (unfused, fused)


def _norm_share(norm_chunk_tokens: int, mlp_chunk_tokens: int = 0) -> tuple[int, int]:
    cfg = dataclasses.replace(model_config("debug"), n_layers=1, dim=256, norm_chunk_tokens=norm_chunk_tokens,
                              mlp_chunk_tokens=mlp_chunk_tokens)
    block = Llama(cfg).layers["0"].to(torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        h = torch.randn(1, 4096, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
        cos, sin = torch.randn(1, 4096, 1, cfg.head_dim // 2), torch.randn(1, 4096, 1, cfg.head_dim // 2)
        modules = ModTracker()
        with modules, BreakdownMode(modules) as mode:
            block(h, cos, sin).sum().backward()
    return mode.categories().get("norms", 0), mode.peak_bytes


def test_breakdown_sees_the_norms_shrink():
    untiled, untiled_peak = _norm_share(0)
    tiled, tiled_peak = _norm_share(256)
    assert untiled >= 4096 * 256 * 4 * 2  # at least two float32 (tokens x dim) copies untiled
    assert tiled <= untiled / 3 and tiled_peak < untiled_peak  # measured: 16.8 MB -> 4.2 MB (the two bf16 outputs)
