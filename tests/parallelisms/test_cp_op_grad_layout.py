"""Issue 57, item 4: the CP op's backward hands the CUDA kernels the attention output's gradient without copying it.

The model calls attention with (B, H, S, D) views of (B, S, H, D) projections and turns the output back the same
way, so the gradient autograd hands the op is a (B, H, S, D) view of (B, S, H, D) memory: the layout flash, cuDNN
and the efficient kernel read (out's), and the packed documents' token-major (T, H, D) view of it needs no copy
either. The op used to make it contiguous (B, H, S, D), a copy of the whole gradient per layer and call, and then
flash's aten backward copied that back to its (B, S, H, D) layout ("CUDA code assumes that dout is contiguous",
`_flash_attention_backward`), as cuDNN's `sdpa_output_layout` and the packed documents' view did. Here the op runs
on fake CUDA tensors (CP 1 on a gloo group of one, the kernels forced, the documents' plan on the device as the
trainer moves it) and every copy of dout's values during its backward is counted, inside the op's body too, and
each backward kernel's grad_out is checked to be in the layout it reads as is. Measured on the code before the
change: one copy in each case, and flash handed a grad_out it copies again; after: none, and every kernel reads it
as is. On CPU the op still hands the CPU flash kernel a contiguous dout (the same numbers bit for bit).

The forward's real body runs there too (issue 57 item 1: a custom op under the fake mode would answer with its fake
implementation): flash, dense cuDNN, varlen flash over the packed documents and cuDNN THD, each the kernel the case
forces, its outputs checked against the fake's by the op itself (shape, dtype, device, strides)."""
from __future__ import annotations

import pytest

from tests.distributed import run_ranks

B, S, HEADS, KV_HEADS, HEAD_DIM = 1, 64, 4, 2, 64
CASES = {  # name: (attention_kernel, with document ids)
    "flash": ("flash", False),
    "cudnn": ("cudnn", False),
    "documents flash": ("flash", True),
    "documents cudnn_thd": ("cudnn", True),
}
"""The THD case routes the packed calls to cuDNN THD (what `auto` picks on an H100/H200) answered by the checking
stand-in of tests/parallelisms/cudnn_frontend_reference.py: on fake tensors it checks the metadata of every tensor
bound (uids, dtypes, device, the packed strides declared), so dout's token-major view reaches it as declared."""


def _dout_copies_in_backward(rank, world_size, cases):
    import torch
    import torch.distributed as dist
    from types import SimpleNamespace
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from parallelisms.context_parallel import context_parallel
    from parallelisms.cp import op as cp_op
    from training.planning.fake.cuda import load_fake_cuda_guard

    why = load_fake_cuda_guard()
    if why:
        return why
    aten = torch.ops.aten
    copy_ops = {aten.clone.default, aten.copy_.default, aten._to_copy.default}

    def storage(x):
        return x.untyped_storage()._cdata

    def in_kernel_layout(grad_out):
        """Whether a backward kernel reads this grad_out as is: (B, H, L, D) over (B, L, H, D) memory for the
        SDPA-level ops, whose CUDA flash makes its (B, L, H, D) view contiguous first (aten's
        `_flash_attention_backward`: "CUDA code assumes that dout is contiguous"), and contiguous tokens (T, H, D)
        for the varlen call."""
        return (grad_out.transpose(1, 2) if grad_out.dim() == 4 else grad_out).is_contiguous()

    class RealForward(TorchDispatchMode):
        """The CP op's forward body run here (on fake CUDA tensors; a custom op would otherwise answer with its fake
        implementation under the fake mode), and the attention kernels it calls."""

        def __init__(self):
            super().__init__()
            self.kernels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is cp_op.ATTENTION_OP:
                with self:
                    return cp_op.cp_attention._init_fn(*args, **kwargs)
            if "attention" in func.name():
                self.kernels.append(func.name())
            return func(*args, **kwargs)

    class DoutCopies(TorchDispatchMode):
        """Copies of dout's values: copies that read dout's memory (whatever view of it) or a copy made of it; the
        CP op's body (which a custom op runs below the Python dispatch modes) is run here under this mode instead,
        so its copies count too."""

        def __init__(self, dout):
            super().__init__()
            self.holding_dout, self.copies, self.kernels, self.ready = {storage(dout)}, 0, [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is cp_op.ATTENTION_BACKWARD_OP:
                with self:
                    return cp_op.cp_attention_backward._init_fn(*args, **kwargs)
            out = func(*args, **kwargs)
            if "attention" in func.name() and "backward" in func.name():
                self.kernels.append(func.name())
                self.ready.append(in_kernel_layout(args[0]))
            source = args[1] if func is aten.copy_.default else args[0]
            if func in copy_ops and storage(source) in self.holding_dout:
                self.copies += 1
                self.holding_dout.add(storage(out))
            return out

    import parallelisms.cp.kernel_cudnn_thd as thd
    import parallelisms.cp.op_variants as op_variants
    from tests.parallelisms.cudnn_frontend_reference import StandInFrontend

    frontend = StandInFrontend()
    graphs = thd.ThdGraphs(frontend, None)
    thd.graphs_for = lambda device: graphs  # this rank's process only
    chosen_packed_kernel = op_variants.packed_kernel
    results = {}
    for name in cases:
        kernel, with_ids = CASES[name]
        op_variants.packed_kernel = ((lambda asked, q: "cudnn_thd") if name.endswith("cudnn_thd")
                                     else chosen_packed_kernel)
        frontend.calls.clear()
        tokens = torch.zeros(B, S, dtype=torch.long)
        ids = torch.zeros(B, S, dtype=torch.long)
        ids[:, S // 4:] = 1  # two documents
        buffers = [tokens, ids] if with_ids else [tokens]
        with context_parallel(dist.group.WORLD, buffers, [1] * len(buffers), attention_kernel=kernel,
                              load_balancer="documents" if with_ids else "zigzag",
                              document_ids=ids if with_ids else None):
            run = cp_op.ACTIVE.current(dist.group.WORLD.group_name)
            constants = (True, None, dist.group.WORLD.group_name, run.op_variant)
            with FakeTensorMode(allow_non_fake_inputs=True):
                if with_ids:  # the batch's plan on the device, as the trainer moves it with the batch
                    run.packed = run.packed.to("cuda")
                q, k, v = (torch.randn(B, S, heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
                           for heads in (HEADS, KV_HEADS, KV_HEADS))
                with RealForward() as forward:  # its results checked against the fake's by the op itself
                    out, lse = torch.ops.titan_cp.attention(q, k, v, *constants)
                assert (out.shape, out.dtype, out.device.type) == (q.shape, q.dtype, "cuda")
                assert (lse.shape, lse.dtype) == ((B, HEADS, S), torch.float32)
                # the gradient of out.transpose(1, 2).reshape(B, S, H * D), as autograd hands it to the op
                dout = torch.randn(B, S, HEADS * HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                dout = dout.view(B, S, HEADS, HEAD_DIM).transpose(1, 2)
                ctx = SimpleNamespace(saved_tensors=(q, k, v, out, lse), constants=constants)
                with DoutCopies(dout) as counted:
                    dq, dk, dv, *_ = cp_op._backward(ctx, dout, None)
                assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        results[name] = {"copies": counted.copies, "variant": run.op_variant, "kernels": counted.kernels,
                         "forward_kernels": forward.kernels,
                         "in_kernel_layout": counted.ready, "thd_calls": list(frontend.calls)}
    return results


@pytest.mark.timeout(240)
def test_the_ops_backward_hands_cuda_kernels_dout_without_a_copy():
    (results,) = run_ranks(_dout_copies_in_backward, 1, args=(tuple(CASES),), timeout=200)
    if isinstance(results, str):
        pytest.skip(results)  # no compiler for the fake CUDA device guard (planning/fake/cuda.py)
    print(results)
    # the forward's real body on fake CUDA (issue 57 item 1): each forced kernel is the one that ran
    assert {name: r["forward_kernels"] for name, r in results.items()} == {
        "flash": ["aten::_scaled_dot_product_flash_attention"], "cudnn": ["aten::_scaled_dot_product_cudnn_attention"],
        "documents flash": ["aten::_flash_attention_forward"], "documents cudnn_thd": []}, results
    assert results["flash"]["kernels"] == ["aten::_scaled_dot_product_flash_attention_backward"], results
    assert results["cudnn"]["kernels"] == ["aten::_scaled_dot_product_cudnn_attention_backward"], results
    assert results["documents flash"]["variant"] == "packed", results
    assert any("flash_attention_backward" in name for name in results["documents flash"]["kernels"]), results
    thd_case = results.pop("documents cudnn_thd")
    assert thd_case["variant"] == "packed" and thd_case["kernels"] == [] and thd_case["copies"] == 0, thd_case
    assert thd_case["thd_calls"] == ["forward", "backward"], thd_case  # one graph call each for the whole batch
    assert {name: r["copies"] for name, r in results.items()} == {name: 0 for name in results}, results
    assert all(r["in_kernel_layout"] == [True] and r["thd_calls"] == [] for r in results.values()), results
