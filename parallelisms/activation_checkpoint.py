"""Activation checkpointing of transformer blocks: none, full, every k-th block, or op-selective.

- full: every block keeps only its input; backward re-runs the whole block (attention included).
- selective: the same for every `every`-th block (by block id, so pipeline stages agree with the full model).
- op: inside every block, the outputs of the attention kernels (CPU and CUDA SDPA ops, and the registered CP
  attention op, parallelisms/cp/op.py) and of every other matmul are saved, the rest (norms, RoPE, activations, the
  other matmuls) is recomputed; the same matmuls in a compiled block as eagerly (MatmulsByValue). Under context parallelism attention goes through that op eagerly too, so no
  attention call and no exchange of it ever runs twice, and a tensor-parallel reduce-scatter is saved rather than
  repeated.

Recompute runs inside backward, where torch-function modes are not active (autograd does not carry them over).
Context parallelism routes attention to the ring through such a mode, so every mode re-enters, during recompute,
the torch-function modes that were active in the block's forward: the recomputed block computes what it computed.

offload: each checkpointed block's input (what checkpointing keeps for its recompute) is moved to host memory after
the forward and brought back before the recompute (parallelisms/activation_offload.py). The offloader is stored on
the model as `activation_offloader`, so the dry run can read the host bytes and a ramp stage switch it off or on
(`enabled`; off, the block runs exactly as plain checkpointing).
"""
from __future__ import annotations

import contextlib
import functools
from collections import Counter

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from config import Refusal, choices
from config.schema import ActivationCheckpointMode
from parallelisms.activation_offload import ActivationOffloader
from parallelisms.cp.op import ACTIVE as CP_ACTIVE, ATTENTION_OP as CP_ATTENTION_OP

_aten = torch.ops.aten
ATTENTION_OPS = frozenset({
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_attention_math.default,
    _aten._flash_attention_forward.default,  # the varlen and packed-document calls (cp/kernel_varlen.py) on CUDA
    _aten._efficient_attention_forward.default,
})
ALWAYS_SAVED_OPS = ATTENTION_OPS | {torch.ops._c10d_functional.reduce_scatter_tensor.default, CP_ATTENTION_OP}
MATMUL_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default})
_BY_VALUE = {_aten.mm.out: _aten.mm.default, _aten.addmm.out: _aten.addmm.default, _aten.bmm.out: _aten.bmm.default}
MODES = choices(ActivationCheckpointMode)


class MatmulsByValue(TorchDispatchMode):
    """Above selective checkpointing's own dispatch mode, every out= matmul becomes its by-value op and a copy into
    the `out` buffer. A compiled block (parallelize.apply_compile) runs inductor's code, which calls each matmul as
    `aten.mm.out` into a buffer it planned: the policy saved none of them (measured: a compiled block's 7 matmuls
    reached it as mm.out, 0 saved, against 4 of 7 saved eagerly), so `op` under compile recomputed every matmul. An
    out= op cannot be saved as it is: the cache would hold inductor's buffer, which inductor reuses, and the
    recompute would hand back the cached tensor without writing the buffer the compiled code reads next. By value,
    the policy sees what it sees eagerly and saves the same matmuls; the recompute copies each saved one into its
    buffer (one copy of the output where the matmul would have run again)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True, as torch's own checkpoint modes: dynamo compiles a block's frame under this mode instead of running
        it eagerly. The check (torch 2.11 and 2.13 alike): torch/_dynamo/convert_frame.py `CatchErrorsWrapper.__call__`
        returns `ConvertFrameReturn()` (the frame runs eagerly, logged at DEBUG only: "non-infra torch dispatch mode
        present") when torch/utils/_python_dispatch.py `any_torch_dispatch_mode_on_stack()` finds a non-infra
        dispatch mode whose `ignore_compile_internals()` is False (with `config.inline_torch_dispatch_torch_compile`,
        default True; otherwise the same test through `is_in_any_mode_without_ignore_compile_internals()`). Torch
        2.11's torch/utils/checkpoint.py (v2.11.0 wheel, git_version 70d99e998b4955e0049d13a98d77ae1b14db1f45)
        defines it True on `_CachingTorchDispatchMode` and `_CachedTorchDispatchMode` already, so with this mode the
        compiled `op` block compiles there too. tests/parallelisms/test_activation_checkpoint.py holds both contexts
        of `_op_context` to it on the installed torch and compiles under each."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        by_value = _BY_VALUE.get(func)
        if by_value is None:
            return func(*args, **kwargs)
        out = kwargs.pop("out")
        return out.copy_(by_value(*args, **kwargs))


def _op_policy():
    """A fresh policy per checkpointed call: matmuls are counted separately in forward and in recompute, so both
    passes pick the same (even-numbered) matmuls to save."""
    matmuls = Counter()

    def policy(ctx, op, *args, **kwargs):
        if op in ALWAYS_SAVED_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op in MATMUL_OPS:
            phase = "recompute" if ctx.is_recompute else "forward"
            matmuls[phase] += 1
            if matmuls[phase] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@contextlib.contextmanager
def _entered(contexts):
    with contextlib.ExitStack() as stack:
        for ctx in contexts:
            stack.enter_context(ctx)
        yield


def _full_context():
    """(forward, recompute) contexts: recompute re-enters the forward's torch-function modes (e.g. the CP ring).
    The checkpoint stays eager around a compiled block (parallelisms/parallelize.apply_compile): dynamo traces a
    checkpoint body as a higher-order op without the torch-function modes, so CP would not route its attention there
    (and dynamo refuses these contexts, which keeps that mistake loud)."""
    return contextlib.nullcontext(), _entered(_get_current_function_mode_stack())


def _op_context():
    """(forward, recompute) contexts of the `op` policy; in both, CP attention goes through its registered op, eager
    too (cp/op.py ActiveRuns.through_op), which the policy saves whole: the recompute runs no exchange again."""
    forward, recompute = create_selective_checkpoint_contexts(_op_policy())
    return (_entered([forward, MatmulsByValue(), CP_ACTIVE.routed_through_op()]),
            _entered([*_get_current_function_mode_stack(), recompute, MatmulsByValue(),
                      CP_ACTIVE.routed_through_op()]))


def _offloaded_checkpoint(offloader: ActivationOffloader, layer: int, fn, hidden, *args, **kwargs):
    """torch's non-reentrant checkpoint with the block input saved through the offloader's hooks (the checkpoint
    saves its inputs under the ambient hooks; inside the block its own hooks take over)."""
    with offloader.hooks(hidden, layer):
        return checkpoint(fn, hidden, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, every: int = 1, offload: bool = False,
                                   prefetch: bool = True, keep_last: int = 0) -> None:
    """Wraps the blocks of `model` (a full Llama or a pipeline stage) in place. `prefetch`: the offloader brings the
    next block input back under the current block's recompute (ActivationOffloader.prefetch); `keep_last`: the last
    checkpointed blocks whose inputs stay on the device (ActivationOffloader.keep_last)."""
    if mode not in MODES:
        raise Refusal(f"activation checkpoint mode {mode!r} is not one of {MODES}")
    if mode == "none":
        if offload:
            raise Refusal("activation offload moves what checkpointing keeps: it needs a checkpoint mode")
        return
    offloader = ActivationOffloader() if offload else None
    if offloader is not None:
        offloader.prefetch, offloader.keep_last = prefetch, keep_last
        model.activation_offloader = offloader
    for name, block in list(model.layers.items()):
        if mode == "selective" and int(name) % every != 0:
            continue
        context_fn = _op_context if mode == "op" else _full_context
        checkpoint_fn = functools.partial(_offloaded_checkpoint, offloader, int(name)) if offloader else None
        if offloader is not None:
            offloader.layers.append(int(name))
        wrapped = checkpoint_wrapper(block, checkpoint_fn=checkpoint_fn, context_fn=context_fn,
                                     preserve_rng_state=False)
        model.layers[name] = wrapped
