"""A float64 stand-in for CUDA flash's varlen forward and backward, so the varlen block code (gathers, fused
rectangles, log-sum-exp merges, gradient scatters) can be checked for exactness on CPU, where no varlen kernel
exists. It follows the ops' documented contract, written here from the math: packed (total, H, D) inputs with
cum_seq offsets, K/V with fewer heads (GQA: query head h reads K/V head h // (Hq / Hkv)), causal aligned bottom-right,
log-sum-exp float32 (H, total_q); the backward takes the final out and log-sum-exp (+inf rows contribute nothing)."""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _scores(q, k, scale, causal):
    """(H, Lq, Lk) float64 scores of one sequence, K expanded over query-head groups; causal bottom-right."""
    k = k.double().repeat_interleave(q.size(1) // k.size(1), dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal:
        lq, lk = q.size(0), k.size(0)
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _bounds(cum):
    c = cum.tolist()
    return list(zip(c[:-1], c[1:]))


def varlen_forward(q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, debug, scale=None, **_):
    scale = scale or 1 / math.sqrt(q.size(-1))
    out = torch.empty_like(q)
    lse = torch.empty(q.size(1), q.size(0), dtype=torch.float32)
    for (qa, qb), (ka, kb) in zip(_bounds(cum_q), _bounds(cum_k)):
        s = _scores(q[qa:qb], k[ka:kb], scale, is_causal)
        m = torch.logsumexp(s, dim=-1)
        vs = v[ka:kb].double().repeat_interleave(q.size(1) // v.size(1), dim=1)
        out[qa:qb] = torch.einsum("hqk,khd->qhd", torch.exp(s - m[..., None]), vs).to(q.dtype)
        lse[:, qa:qb] = m.float()
    return out, lse, torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64), q.new_empty(0)


def varlen_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, rng, unused,
                    scale=None, **_):
    scale = scale or 1 / math.sqrt(q.size(-1))
    groups = q.size(1) // k.size(1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (qa, qb), (ka, kb) in zip(_bounds(cum_q), _bounds(cum_k)):
        s = _scores(q[qa:qb], k[ka:kb], scale, is_causal)
        p = torch.exp(s - lse[:, qa:qb].double()[..., None])
        do, o = dout[qa:qb].double(), out[qa:qb].double()
        vs = v[ka:kb].double().repeat_interleave(groups, dim=1)
        ks = k[ka:kb].double().repeat_interleave(groups, dim=1)
        dv_h = torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, vs)
        ds = p * (dp - (do * o).sum(-1).T[..., None])
        dq[qa:qb] = (torch.einsum("hqk,khd->qhd", ds, ks) * scale).to(q.dtype)
        dk_h = torch.einsum("hqk,qhd->khd", ds, q[qa:qb].double()) * scale
        fold = lambda g: g.view(g.size(0), k.size(1), groups, g.size(2)).sum(2)  # noqa: E731
        dk[ka:kb] = fold(dk_h).to(k.dtype)
        dv[ka:kb] = fold(dv_h).to(v.dtype)
    return dq, dk, dv


class ReferenceVarlen(TorchDispatchMode):
    """Answers the two varlen flash ops with the float64 reference; every other op runs as usual."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._flash_attention_forward.default:
            self.calls += 1
            return varlen_forward(*args, **kwargs)
        if func is aten._flash_attention_backward.default:
            self.calls += 1
            return varlen_backward(*args, **kwargs)
        return func(*args, **kwargs)
