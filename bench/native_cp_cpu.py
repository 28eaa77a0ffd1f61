"""torch's own context parallelism (torch.distributed.tensor.experimental.context_parallel) made to run on CPU, for
the benchmarks ONLY.

torch 2.13 routes SDPA under its CP to a templated ring through DTensor's custom-op handlers, but registers handlers
only for the CUDA flash / efficient / cuDNN ops, so on CPU it fails (docs/design.md). Here the CPU flash op and its
backward get handlers that call the same templated ring (`_templated_ring_attention[_backward]`) with the CPU
kernel, exactly as torch's CUDA handlers do. Nothing in the training code imports this.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor, Shard

aten = torch.ops.aten
SEQ_DIM = 2


def _local(x):
    return x._local_tensor if isinstance(x, DTensor) else x


def _arg(args, kwargs, index, name, default):
    return args[index] if len(args) > index else kwargs.get(name, default)


def _handlers(mesh):
    from torch.distributed.tensor.experimental._context_parallel import _attention as native

    group = mesh.get_group()

    def wrap(tensors):
        return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in tensors)

    def forward(op_call, args, kwargs):
        q, k, v = (_local(a) for a in args[:3])
        if kwargs.get("attn_mask") is not None:
            raise NotImplementedError("torch native CP takes no attn_mask")
        out, lse = native._templated_ring_attention(
            group, SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v,
            is_causal=_arg(args, kwargs, 4, "is_causal", False), dropout_p=_arg(args, kwargs, 3, "dropout_p", 0.0),
            scale=kwargs.get("scale"))
        return wrap((out, lse))

    def backward(op_call, args, kwargs):
        grad_out, q, k, v, out, lse = (_local(a) for a in args[:6])
        dq, dk, dv = native._templated_ring_attention_backward(
            group, SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=grad_out,
            grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse,
            is_causal=_arg(args, kwargs, 7, "is_causal", False), dropout_p=_arg(args, kwargs, 6, "dropout_p", 0.0),
            scale=kwargs.get("scale"))
        return wrap((dq, dk, dv))

    return {aten._scaled_dot_product_flash_attention_for_cpu.default: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: backward}


@contextlib.contextmanager
def native_context_parallel(mesh, seq_len: int, rotate: str = "allgather"):
    """torch's `context_parallel` around SDPA calls on this rank's (already head-tail sharded) q/k/v.

    rotate: "allgather" (torch's default: K/V all-gathered once per call) or "alltoall" (a true ring: K/V passed to
    the next rank each step). A dummy position buffer of `seq_len` tokens sets up torch's head-tail load balancing.
    """
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel import _attention as native

    added = _handlers(mesh)
    saved = dict(native.custom_ops)
    native.custom_ops.update(added)
    native.set_rotate_method(rotate)
    positions = torch.arange(seq_len)[None].clone()
    try:
        with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[1], no_restore_buffers={positions}):
            yield
    finally:
        native.custom_ops.clear()
        native.custom_ops.update(saved)
        native.set_rotate_method("allgather")
