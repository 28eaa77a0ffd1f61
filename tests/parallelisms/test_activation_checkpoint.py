"""Activation checkpointing: every mode gives the loss and gradients of no checkpointing, recomputes exactly the
attention calls it should (op-selective: none), and recompute sees the forward's torch-function modes (the CP ring)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from models.llama import Llama, LlamaConfig, canonical_name
from parallelisms.activation_checkpoint import apply_activation_checkpointing

TINY = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, rope_theta=10000.0)
CPU_ATTENTION = str(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)


class AttentionKernels(TorchDispatchMode):
    """Runs of each attention kernel (aten's CPU flash forward and backward) and of the registered CP ops, by name (a
    value selective checkpointing serves from its cache never reaches this mode, which sits below it)."""

    def __init__(self):
        super().__init__()
        self.runs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "attention" in name:
            self.runs[name] = self.runs.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class SdpaCalls(TorchFunctionMode):
    """Counts F.scaled_dot_product_attention calls routed through a torch-function mode (as context parallelism is)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _run(mode: str, every: int = 2):
    model = Llama(LlamaConfig(**TINY))
    apply_activation_checkpointing(model, mode, every)
    model.init_weights(0)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 33), generator=g)
    kernels, calls = AttentionKernels(), SdpaCalls()
    with kernels, calls:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    grads = {canonical_name(n): p.grad for n, p in model.named_parameters()}
    return loss.item(), grads, kernels.runs.get(CPU_ATTENTION, 0), calls.count, model


@pytest.fixture(scope="module")
def plain():
    return _run("none")


# mode, every, attention kernel runs in forward + backward, F.sdpa calls seen by a function mode
@pytest.mark.parametrize("mode, every, kernels, calls", [
    ("full", 1, 8, 8),        # every block's attention runs again in recompute, through the mode
    ("selective", 2, 6, 6),   # blocks 0 and 2 are recomputed
    ("selective", 3, 6, 6),   # blocks 0 and 3
    ("op", 1, 4, 8),          # recompute re-enters the mode, but the kernel output comes from the cache
])
def test_mode_matches_no_checkpointing(plain, mode, every, kernels, calls):
    ref_loss, ref_grads, ref_kernels, ref_calls, _ = plain
    assert (ref_kernels, ref_calls) == (4, 4)
    loss, grads, got_kernels, got_calls, _ = _run(mode, every)
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        assert torch.allclose(grads[name], ref, rtol=1e-5, atol=1e-7), name
    assert got_kernels == kernels
    assert got_calls == calls


def test_selective_wraps_every_kth_block_by_id():
    *_, model = _run("selective", every=2)
    wrapped = [name for name, block in model.layers.items() if hasattr(block, "_checkpoint_wrapped_module")]
    assert wrapped == ["0", "2"]


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="activation checkpoint mode"):
        apply_activation_checkpointing(Llama(LlamaConfig(**TINY)), "sometimes")


@pytest.mark.parametrize("head_groups", [1, 2])
def test_op_mode_under_cp_runs_each_layer_s_attention_and_exchanges_once(head_groups):
    """Issue 57 item 2: the `op` policy saves the attention kernels' outputs, but on the eager Python path of the CP
    ring it recomputed every other op of the call, the ring's sends and receives among them (twice the calls, the
    forward's bytes twice; calls are counted per layer and head group). Attention now goes through the registered
    CP op in op mode, eager too, whose outputs the policy saves whole: the calls and bytes of no checkpointing.
    Full checkpointing recomputes the ring, as it must."""
    plain, op, full = (_cp_variant_stats(mode, "ring", head_groups=head_groups)[0] for mode in ("none", "op", "full"))
    assert plain[0] == 4 * head_groups and plain[1] > 0 and plain[2] > 0
    assert op == plain
    assert full[:2] == (2 * plain[0], 2 * plain[1])


def _cp_variant_stats(mode: str, variant: str, world_size: int = 2, head_groups: int = 0):
    """One forward and backward of TINY (4 blocks, 32 tokens) under `mode` through `context_parallel` with a variant
    of tests/parallelisms/cp_block_probe.VARIANTS, as rank 0 of a fake process group of `world_size` (the exchanges
    run; their data is not real; documents at a group of one: the packed call): (the CP counters (calls, forward
    bytes, backward bytes), {attention kernel or CP op: runs} seen below the checkpoint's modes)."""
    from parallelisms.context_parallel import context_parallel
    from parallelisms.cp.counters import CommStats
    from tests.parallelisms.cp_block_probe import VARIANTS, document_ids
    from training.planning.fake.world import fake_process_group

    load_balancer, cp_impl, with_ids = VARIANTS[variant]
    model = Llama(LlamaConfig(**TINY))
    apply_activation_checkpointing(model, mode, 1)
    model.init_weights(0)
    tokens = torch.randint(0, TINY["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(5))
    buffers = [tokens] + ([document_ids(1, 32)] if with_ids else [])
    stats, kernels = CommStats(), AttentionKernels()
    with fake_process_group(world_size, 0) as group, \
            context_parallel(group, buffers, [1] * len(buffers), load_balancer=load_balancer, cp_impl=cp_impl,
                             document_ids=buffers[1] if with_ids else None, stats=stats, head_groups=head_groups):
        with kernels:
            model(tokens).float().sum().backward()  # backward inside the block, as the trainer runs it
    return (stats.calls, stats.forward_bytes_sent, stats.backward_bytes_sent), kernels.runs


@pytest.mark.parametrize("variant, world_size", [("ring", 2), ("allgather", 2), ("documents", 2), ("ulysses", 2),
                                                 ("hybrid", 2), ("documents", 1)],
                         ids=["ring", "allgather", "documents", "ulysses", "hybrid", "packed at cp1"])
def test_op_mode_runs_each_layer_s_cp_attention_once_in_every_variant(variant, world_size):
    """Issue 57 item 2 over every variant (the ring's test above: head groups): under `op` each layer's CP
    attention runs once, as the registered op, whose outputs the policy saves whole, so the recompute neither runs
    an attention kernel nor exchanges anything (eager; the compiled block's single op per graph is in
    test_cp_compiled_op.py); full checkpointing runs every forward kernel and exchange twice, as it must. Measured
    (4 blocks, 32 tokens; calls, forward bytes, backward bytes): ring (4, 16384, 49152), all-gather
    (4, 16384, 32768), documents (4, 8192, 24576), hybrid at CP 2 (a ring; 4, 16384, 49152), packed at CP 1 (4, 0, 0)
    in op mode as with no checkpointing. Ulysses in op mode: calls and the forward's all-to-alls as without
    checkpointing, plus the log-sum-exp's (512 bytes), but its backward sends 49,664 bytes against 24,576: the op
    keeps Q, K, V and the output in the sequence layout and all-to-alls them to heads again in its backward (so
    does every compiled Ulysses step, whatever the checkpointing), the trade made for an op whose saved tensors are
    its own inputs and outputs (cp/op_variants.py). Asserted as measured, so that a change to it shows."""
    plain, plain_kernels = _cp_variant_stats("none", variant, world_size)
    op, op_kernels = _cp_variant_stats("op", variant, world_size)
    full, full_kernels = _cp_variant_stats("full", variant, world_size)
    forward_kernel = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert plain[0] == 4 and op[0] == 4 and full[0] == 8, (plain, op, full)
    assert op_kernels == {"titan_cp.attention.default": 4, "titan_cp.attention_backward.default": 4}, op_kernels
    assert full_kernels[forward_kernel] == 2 * plain_kernels[forward_kernel], (full_kernels, plain_kernels)
    assert full[1] == 2 * plain[1], (full, plain)
    if variant == "ulysses":
        lse_bytes = 4 * 32 * 4  # (heads, tokens) float32: the op's log-sum-exp back to the sequence layout
        assert op[1:] == (plain[1] + lse_bytes, 2 * plain[2] + lse_bytes), (op, plain)
    else:
        assert op[1:] == plain[1:], (op, plain)


def test_op_policy_saves_every_attention_kernel_the_cuda_path_calls():
    """The varlen and packed-document calls run `aten._flash_attention_forward` (cp/kernel_varlen.py); outside the
    registered CP op the policy must save them as it saves SDPA's kernels, or the recompute runs them again."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from parallelisms.activation_checkpoint import _op_policy
    policy, aten = _op_policy(), torch.ops.aten
    for op in (aten._flash_attention_forward.default, aten._efficient_attention_forward.default,
               aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_cudnn_attention.default):
        assert policy(SimpleNamespace(is_recompute=False), op) == CheckpointPolicy.MUST_SAVE, op
    assert policy(SimpleNamespace(is_recompute=False), aten.add.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


class _OutMatmulLinear(torch.autograd.Function):
    """A linear layer as inductor's compiled code runs it: the forward calls `aten.mm.out` into a buffer it made
    (inside an autograd function, whose forward autograd does not record), the backward plain matmuls."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        out = x.new_empty(x.size(0), weight.size(0))
        torch.mm(x, weight.t(), out=out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


class _OutMatmulBlocks(torch.nn.Module):
    """One block of four out= linear layers, each followed by tanh: what the checkpoint wraps."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(2)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(16, 16, generator=generator) / 4)
                                              for _ in range(4))

    def forward(self, h):
        for weight in self.weights:
            h = torch.tanh(_OutMatmulLinear.apply(h, weight))
        return h


class _MatmulKernelCount(TorchDispatchMode):
    """Matmul kernels that run (below the checkpoint's modes: a matmul served from its cache never gets here)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _out_matmul_run(mode: str):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": _OutMatmulBlocks()})
    apply_activation_checkpointing(model, mode)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    loss = model.layers["0"](x).square().sum()
    with _MatmulKernelCount() as backward_matmuls:
        loss.backward()
    return loss.item(), [x.grad, *(w.grad for w in model.layers["0"].weights)], backward_matmuls.count


def test_op_mode_saves_out_matmuls_as_it_saves_plain_ones():
    """Issue 57 item 3: inductor calls a compiled block's matmuls as `aten.mm.out`, which the `op` policy never saved,
    so under compile it recomputed every matmul. Here the same calls without a compiler: the backward runs 8 gradient
    matmuls, full checkpointing recomputes the 4 forward ones, `op` saves 2 of them (every other one, as eagerly) and
    recomputes 2 (before MatmulsByValue: 12 kernels, all 4 recomputed), and the gradients stay those of no
    checkpointing (the saved outputs copied into the buffers the recompute hands them)."""
    ref_loss, ref_grads, none_matmuls = _out_matmul_run("none")
    assert none_matmuls == 8
    for mode, matmuls in (("full", 12), ("op", 10)):
        loss, grads, got = _out_matmul_run(mode)
        assert got == matmuls, (mode, got)
        assert loss == ref_loss and all(torch.equal(g, r) for g, r in zip(grads, ref_grads)), mode


def test_op_checkpoint_dispatch_modes_leave_a_compiled_block_compiled():
    """Dynamo runs a frame eagerly, saying so only in a DEBUG log, while a dispatch mode whose
    `ignore_compile_internals()` is False is active (torch/_dynamo/convert_frame.py `CatchErrorsWrapper.__call__`,
    torch 2.11 and 2.13: `any_torch_dispatch_mode_on_stack()`). A compiled block under the `op` policy runs inside
    the checkpoint's dispatch modes and MatmulsByValue (parallelize.apply_compile keeps the checkpoint eager around
    it), so each of them must say True, in the forward's context and the recompute's: then dynamo's test finds
    nothing and a function compiled under either context is compiled (one frame), not run eagerly. Torch's own
    `_CachingTorchDispatchMode` / `_CachedTorchDispatchMode` say True in 2.11's checkpoint.py as in 2.13's."""
    from torch._dynamo.testing import CompileCounter
    from torch.utils._python_dispatch import (_get_current_dispatch_mode_stack, any_torch_dispatch_mode_on_stack,
                                              is_in_any_mode_without_ignore_compile_internals)

    import parallelisms.activation_checkpoint as activation_checkpoint

    expected = {"forward": {"_CachingTorchDispatchMode", "MatmulsByValue"},
                "recompute": {"_CachedTorchDispatchMode", "MatmulsByValue"}}
    for phase, context in zip(("forward", "recompute"), activation_checkpoint._op_context()):
        counter = CompileCounter()
        with context:
            modes = {type(m).__name__: m.ignore_compile_internals() for m in _get_current_dispatch_mode_stack()}
            skipped = any_torch_dispatch_mode_on_stack(), is_in_any_mode_without_ignore_compile_internals()
            torch.compile(lambda x: x.sin() + 1, backend=counter)(torch.ones(3))
        assert set(modes) == expected[phase] and all(modes.values()), (phase, modes)
        assert skipped == (False, False), (phase, skipped)
        assert counter.frame_count == 1, (phase, "dynamo ran the frame eagerly")


@pytest.mark.slow
def test_a_compiled_block_saves_the_matmuls_op_saves_eagerly(monkeypatch):
    """Under torch.compile (inductor, parallelize.apply_compile) the `op` policy is handed the same matmuls as eagerly
    and saves the same ones (4 of a block's 7 plain matmuls, the attention kernel too), and the step's gradients are
    no checkpointing's within float32 fusion. Before MatmulsByValue it saw 7 `aten.mm.out` and saved none of them."""
    import parallelisms.activation_checkpoint as activation_checkpoint
    from parallelisms.parallelize import apply_compile

    decisions = []
    make_policy = activation_checkpoint._op_policy

    def recording_policy():
        policy = make_policy()

        def record(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            decisions.append((str(op), decision == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE))
            return decision
        return record

    monkeypatch.setattr(activation_checkpoint, "_op_policy", recording_policy)
    config = dict(TINY, n_layers=1)
    tokens = torch.randint(0, config["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(5))
    runs = {}
    for name, mode, compiled in (("none", "none", False), ("op eager", "op", False), ("op compiled", "op", True)):
        decisions.clear()
        model = Llama(LlamaConfig(**config))
        apply_activation_checkpointing(model, mode)
        if compiled:
            apply_compile(model)
        model.init_weights(0)
        model(tokens).float().logsumexp(-1).mean().backward()
        matmuls = [saved for op, saved in decisions if "mm" in op]
        runs[name] = ([op for op, _ in decisions if "mm" in op], sum(matmuls), model)
    eager_ops, eager_saved, eager_model = runs["op eager"]
    compiled_ops, compiled_saved, compiled_model = runs["op compiled"]
    assert eager_ops == ["aten.mm.default"] * 7 and eager_saved == 4, runs["op eager"][:2]
    assert compiled_ops == eager_ops and compiled_saved == eager_saved, runs["op compiled"][:2]
    for (name, ref), got in zip(runs["none"][2].named_parameters(), compiled_model.parameters()):
        assert torch.allclose(got.grad, ref.grad, rtol=1e-4, atol=1e-6), name
