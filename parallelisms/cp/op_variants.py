"""The bodies of the registered CP attention op pair (op.py): for each variant an explicit forward (-> out, float32 lse
(B, Hq, S_local)) and backward (from that out and lse -> dq, dk, dv), run with autograd off on the state of the open
`context_parallel` block (`run`: its SdpaToContextParallel).

- ring / allgather (dense or documents layout): the exchanges of attention.BLOCK_EXCHANGES, in head groups;
- packed (CP 1 with documents): packed_documents' one packed call (cuDNN THD, flash varlen) or per-document calls;
- ulysses / hybrid: the all-to-all to head shards, the ring's exchange over the ring group (one rank for Ulysses),
  and the all-to-all back. The backward repeats the forward's all-to-all of q, k, v, out and lse (the eager path
  keeps the head-sharded tensors from its forward instead): one more all-to-all per layer, twice the backward's
  bytes (measured: tests/parallelisms/test_activation_checkpoint.py), in exchange for an op whose saved tensors are
  its own inputs and outputs.

The backward gets no kernel auxiliaries from the forward (a tensor-only op boundary): every kernel here runs
dropout-free, where those are placeholders (kernel_blocks.philox_placeholders), which torch 2.11's flash, cuDNN and
efficient backwards never read at dropout_p 0 (the source lines are cited there).
"""
from __future__ import annotations

import itertools

import torch

from parallelisms.cp.attention import BLOCK_EXCHANGES
from parallelisms.cp.autograd import grouped_backward, grouped_forward, head_group_count
from parallelisms.cp.block_spec import BlockSpec
from parallelisms.cp.checks import prepare_call
from parallelisms.cp.exchange_alltoall import heads_to_seq, seq_to_heads
from parallelisms.cp.exchange_ring import ring_backward, ring_forward
from parallelisms.cp.kernel_blocks import kernel_family
from parallelisms.cp.kernel_cudnn_thd import packed_kernel
from parallelisms.cp.layouts import ALLGATHER, HYBRID, RING, ULYSSES, layout_kind
from parallelisms.cp.packed_documents import packed_backward, packed_forward, packed_lse, packed_saved

PACKED = "packed"
"""The op's variant name for CP 1 with packed documents (no exchange)."""


def _impl(run, variant: str, q, k) -> str:
    """The concrete variant this call runs: the op's `variant` is the run's (auto resolved at the first call)."""
    if variant != run.op_variant:
        raise RuntimeError(f"titan_cp.attention traced for variant {variant!r} ran in a context_parallel block of "
                           f"{run.op_variant!r}: the compiled graph and the open block disagree")
    if variant in (PACKED, RING):
        return variant
    return run.variant.resolve(q, k).impl


def _block_spec(run, q, k, v, is_causal, scale) -> BlockSpec:
    pg, docs = prepare_call(q, k, v, run.group, run.load_balancer, None, run.documents)
    return BlockSpec(pg, is_causal, scale, run.load_balancer, docs, run.stats, run.head_groups,
                     kernel_family(run.kernel, q), packed_kernel(run.kernel, q))


def _no_auxes(q, k, spec: BlockSpec) -> list:
    return [itertools.repeat(None)] * head_group_count(q, k, spec.head_groups)


def _inner(run, exchange, qh, kh, is_causal, scale):
    """The spec and (forward, backward) pair of the attention after the all-to-all: the ring's over hybrid's ring
    group, or over one rank (Ulysses: the ring's pieces at P = 1, as local_segment_attention)."""
    stats = run.stats if exchange.ring_group is not None else None
    spec = BlockSpec(exchange.ring_group, is_causal, scale, exchange.load_balancer, exchange.docs, stats,
                     run.head_groups, kernel_family(run.kernel, qh), packed_kernel(run.kernel, qh))
    if exchange.ring_group is None:
        return spec, (ring_forward, ring_backward)
    return spec, BLOCK_EXCHANGES[(RING, layout_kind(exchange.load_balancer))]


def _replicated(exchange, q, k, v):
    repeats = exchange.kv_repeats(q.size(1), k.size(1))
    if repeats == 1:
        return k, v
    return k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)


def _heads_forward(run, q, k, v, is_causal, scale):
    exchange = run.variant.head_exchange(q)
    k_r, v_r = _replicated(exchange, q, k, v)
    qh, kh, vh = seq_to_heads(exchange.plan, [q, k_r, v_r], run.stats)
    spec, (fwd, _) = _inner(run, exchange, qh, kh, is_causal, scale)
    out_h, lse_h, _ = grouped_forward(fwd, qh, kh, vh, spec)
    if run.stats is not None and exchange.ring_group is None:
        run.stats.calls += 1
    out = heads_to_seq(exchange.plan, [out_h], run.stats)[0]
    lse = heads_to_seq(exchange.plan, [lse_h.unsqueeze(-1)], run.stats)[0]  # its own all-to-all: float32
    return out, lse.squeeze(-1)


def _heads_backward(run, dout, q, k, v, out, lse, is_causal, scale):
    exchange = run.variant.head_exchange(q)
    k_r, v_r = _replicated(exchange, q, k, v)
    qh, kh, vh, out_h, dout_h = seq_to_heads(exchange.plan, [q, k_r, v_r, out, dout], run.stats, backward=True)
    lse_h = seq_to_heads(exchange.plan, [lse.unsqueeze(-1)], run.stats, backward=True)[0].squeeze(-1)
    spec, (_, bwd) = _inner(run, exchange, qh, kh, is_causal, scale)
    dqh, dkh, dvh = grouped_backward(bwd, dout_h, qh, kh, vh, out_h, lse_h, _no_auxes(qh, kh, spec), spec)
    dq, dk, dv = heads_to_seq(exchange.plan, [dqh, dkh, dvh], run.stats, backward=True)
    repeats = dk.size(1) // k.size(1)
    if repeats > 1:  # replicated K/V heads fold back onto their source head
        dk, dv = (g.unflatten(1, (k.size(1), repeats)).sum(2) for g in (dk, dv))
    return dq, dk, dv


def forward(run, variant: str, q, k, v, is_causal: bool, scale):
    impl = _impl(run, variant, q, k)
    if impl == PACKED:
        kernel = kernel_family(run.kernel, q)
        out, saved = packed_forward(q, k, v, run.packed, is_causal, scale, kernel, packed_kernel(run.kernel, q))
        if run.stats is not None:
            run.stats.calls += 1
        return out, packed_lse(saved, q)
    if impl in (ULYSSES, HYBRID):
        return _heads_forward(run, q, k, v, is_causal, scale)
    spec = _block_spec(run, q, k, v, is_causal, scale)
    out, lse, _ = grouped_forward(BLOCK_EXCHANGES[(impl, layout_kind(run.load_balancer))][0], q, k, v, spec)
    return out, lse


def backward(run, variant: str, dout, q, k, v, out, lse, is_causal: bool, scale):
    impl = _impl(run, variant, q, k)
    if impl == PACKED:
        kernel, packed = kernel_family(run.kernel, q), packed_kernel(run.kernel, q)
        saved = packed_saved(out, lse, run.packed, is_causal, q, kernel, packed)
        return packed_backward(dout, q, k, v, saved, run.packed, is_causal, scale, kernel, packed)
    if impl in (ULYSSES, HYBRID):
        return _heads_backward(run, dout, q, k, v, out, lse, is_causal, scale)
    if impl not in (RING, ALLGATHER):
        raise RuntimeError(f"titan_cp.attention: no explicit pair for {impl!r}")
    spec = _block_spec(run, q, k, v, is_causal, scale)
    bwd = BLOCK_EXCHANGES[(impl, layout_kind(run.load_balancer))][1]
    return grouped_backward(bwd, dout, q, k, v, out, lse, _no_auxes(q, k, spec), spec)
