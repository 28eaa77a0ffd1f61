"""The block kernels under the ring: the CPU one against a float64 reference (masked rows included), the CUDA
wrappers against the ops' own schemas and shape rules on the meta device (this box has no GPU)."""
import pytest
import torch

from config import Refusal
from parallelisms.cp.kernel_blocks import CpuFlashBlock, CudaEfficientBlock, CudaFlashBlock, kernel_for
from parallelisms.cp.accumulators import LseAccumulator
from parallelisms.cp.kernel_calls import block_forward
from parallelisms.cp.plan_piece import BlockTask, FULL
from parallelisms.cp.plan_pieces import DocumentShards
from tests.parallelisms.attention_reference import relative_error


def test_kernel_choice_by_device_dtype_and_mask():
    assert isinstance(kernel_for("cpu", torch.bfloat16, 64, True), CpuFlashBlock)
    assert isinstance(kernel_for("cuda", torch.bfloat16, 64, False), CudaFlashBlock)
    assert isinstance(kernel_for("cuda", torch.float16, 64, True), CudaEfficientBlock)
    assert isinstance(kernel_for("cuda", torch.float32, 64, False), CudaEfficientBlock)
    assert isinstance(kernel_for("cuda", torch.bfloat16, 60, False), CudaEfficientBlock)
    with pytest.raises(Refusal, match="mps"):
        kernel_for("mps", torch.float32, 64, False)


@pytest.mark.parametrize("kernel, dtype, masked", [
    (CudaFlashBlock(), torch.bfloat16, False), (CudaEfficientBlock(), torch.float32, True),
    (CudaEfficientBlock(), torch.bfloat16, False)])
def test_cuda_wrappers_fit_the_op_schemas_on_meta_tensors(kernel, dtype, masked):
    batch, heads, kv_heads, lq, head_dim = 2, 8, 2, 40, 64
    lk = 50 if masked else lq  # a mask row that is not 16-aligned, so _bias pads it; causal blocks are square
    q = torch.empty(batch, heads, lq, head_dim, device="meta", dtype=dtype)
    k, v = (torch.empty(batch, kv_heads, lk, head_dim, device="meta", dtype=dtype) for _ in range(2))
    mask = torch.zeros(batch, 1, lq, lk, device="meta", dtype=dtype) if masked else None
    if masked:  # the bias the op gets: lk columns viewed out of rows padded to 64 (the CUDA kernel's 16-alignment)
        bias = kernel._bias(mask, heads)
        assert bias.shape == (batch, heads, lq, lk) and bias.stride(-2) == 64 and lk % 16
    out, lse, aux = kernel.forward(q, k, v, is_causal=not masked, scale=None, mask=mask)
    assert out.shape == q.shape and lse.shape == (batch, heads, lq) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(out, q, k, v, out, lse, aux, is_causal=not masked, scale=None, mask=mask)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape  # GQA heads folded back


def test_document_pieces_leave_rows_that_see_nothing_at_zero_and_minus_inf():
    """A block cut into pieces and merged: rows with no key of their document get out 0 and lse -inf (no piece
    reaches them), the others match a float64 reference built with an explicit mask here."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    doc_q, doc_k = torch.tensor([[0, 0, 1, 1, 2, 2]]), torch.tensor([[1, 1, 1, 2, 3, 3]])
    pieces = DocumentShards([doc_q, doc_k]).pieces(0, 1, [BlockTask(FULL, FULL, False)], 6)
    acc = LseAccumulator(q, v)
    for piece in pieces:
        out, lse, _ = block_forward(q, k, v, piece, None)
        acc.merge(out, lse, piece)
    out, lse = acc.finish()
    assert torch.equal(out[:, :, :2], torch.zeros(1, 2, 2, 8)) and torch.isinf(lse[:, :, :2]).all()
    allowed = doc_q[0][:, None] == doc_k[0][None, :]
    scores = (q.double() @ k.double().transpose(-1, -2)) / 8 ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    expected_lse = torch.logsumexp(scores[:, :, 2:], dim=-1)
    expected = torch.softmax(scores[:, :, 2:], dim=-1) @ v.double()
    assert relative_error(out[:, :, 2:], expected) < 1e-6
    assert relative_error(lse[:, :, 2:], expected_lse) < 1e-6


class _RecordBackward(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the arguments of the CUDA efficient backward op and answers with zeros (no CUDA kernel is needed)."""

    def __init__(self):
        super().__init__()
        self.args = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_efficient_attention_backward.default:
            self.args = args
            q, k, v = args[1:4]
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None
        return func(*args, **(kwargs or {}))


def _ring_shaped_inputs(device, dtype, batch=2, heads=4, full_len=40, head_dim=16):
    """What the ring hands a block backward: q and out row-sliced (a zigzag half) from (B, H, L, D) tensors, out being
    the merged float32 accumulator cast back, i.e. plain contiguous (B, H, L, D) memory."""
    gen = torch.Generator().manual_seed(0)
    full_q = torch.randn(batch, full_len, heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    full_out = torch.randn(batch, heads, full_len, head_dim, generator=gen).to(device, dtype)
    rows = slice(full_len // 2, full_len)
    q, out = full_q[:, :, rows], full_out[:, :, rows]
    k = v = torch.randn(batch, heads, full_len, head_dim, generator=gen).to(device, dtype)
    dout = torch.randn(q.shape, generator=gen).to(device, dtype)
    lse = torch.zeros(batch, heads, q.size(2), device=device)
    return dout, q, k, v, out, lse


def test_efficient_backward_gets_out_in_the_layout_of_sdpas_own_forward_output():
    """The CUDA kernel derives out's row stride as num_heads * head_dim (kernel_backward.h, o_strideM), i.e. the
    (B, L, H, D) memory of the forward's own output: checked against the op's forward on meta tensors."""
    dout, q, k, v, out, lse = _ring_shaped_inputs("meta", torch.bfloat16)
    recorder = _RecordBackward()
    with recorder:
        CudaEfficientBlock().backward(dout, q, k, v, out, lse, (None, None), is_causal=False, scale=None, mask=None)
    passed_out = recorder.args[5]
    forward_out = torch.ops.aten._scaled_dot_product_efficient_attention.default(
        q.contiguous(), k[:, :, :q.size(2)], v[:, :, :q.size(2)], None, True, 0.0, False)[0]
    assert passed_out.shape == forward_out.shape
    assert passed_out.stride() == forward_out.stride(), (passed_out.stride(), forward_out.stride())


def _kernel_reads(out_passed: torch.Tensor) -> tuple[torch.Tensor, int]:
    """out as the CUDA kernel addresses it: after SDPA's transpose to (B, L, H, D), element (b, m, h, d) at
    offset + b * stride(0) + m * H * D + h * stride(2) + d. Returns (values read, number of reads past the storage)."""
    t = out_passed.transpose(1, 2)
    batch, rows, heads, head_dim = t.shape
    b, m, h, d = torch.meshgrid(*(torch.arange(n) for n in t.shape), indexing="ij")
    offsets = t.storage_offset() + b * t.stride(0) + m * heads * head_dim + h * t.stride(2) + d
    storage = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
    inside = offsets < storage.numel()
    values = torch.where(inside, storage[offsets.clamp(max=storage.numel() - 1)], torch.nan)
    return values.transpose(1, 2), int((~inside).sum())


def test_efficient_backward_delta_replayed_with_the_kernels_addressing_is_exact():
    """Replays the kernel's delta = rowsum(dout * out) with its own address formula on the tensor actually passed."""
    dout, q, k, v, out, lse = _ring_shaped_inputs("cpu", torch.float32)
    recorder = _RecordBackward()
    with recorder:
        CudaEfficientBlock().backward(dout, q, k, v, out, lse, (None, None), is_causal=False, scale=None, mask=None)
    read, past_the_end = _kernel_reads(recorder.args[5])
    assert past_the_end == 0
    delta_kernel = (read * dout).sum(-1)
    delta_true = (out * dout).sum(-1)
    assert torch.equal(delta_kernel, delta_true), f"{int((delta_kernel != delta_true).sum())} rows differ"


def test_flash_only_for_head_dims_it_has_kernels_for():
    """CUDA flash attention stops at head dim 256; larger heads go to the memory-efficient kernel."""
    assert isinstance(kernel_for("cuda", torch.bfloat16, 256, False), CudaFlashBlock)
    assert isinstance(kernel_for("cuda", torch.bfloat16, 512, False), CudaEfficientBlock)


def test_document_masked_attention_asks_for_no_mask_so_cuda_flash_serves_it_in_bf16(monkeypatch):
    """Pieces need no mask: every kernel choice of a document-masked call says so, which on CUDA in bf16 is flash."""
    import parallelisms.cp.kernel_calls as toolkit
    from parallelisms.cp.attention import local_segment_attention
    asked = []

    def recording(q, needs_mask, kernel="flash"):
        asked.append(needs_mask)
        return kernel_for(q.device.type, q.dtype, q.size(-1), needs_mask, prefer=kernel)

    monkeypatch.setattr(toolkit, "choose_block_kernel", recording)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 32, 8, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    docs = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [3] * 1 + [4] * 31])
    local_segment_attention(q, q, q, DocumentShards([docs]), is_causal=True).sum().backward()
    assert asked and not any(asked)
    assert isinstance(kernel_for("cuda", torch.bfloat16, 8, False), CudaFlashBlock)


def test_unwritten_runs_are_every_run_of_false_row_by_row():
    """The rows a buffer must still fill (parallelisms/cp/accumulators.unwritten_runs, one numpy pass over the whole
    (B, L) array) against a plain scan of each row, on 2,000 random masks and their column slices."""
    import numpy as np

    from parallelisms.cp.accumulators import unwritten_runs

    def scanned(written):
        runs = []
        for b, row in enumerate(written.tolist()):
            start = None
            for i, w in enumerate(row + [True]):
                if not w and start is None:
                    start = i
                elif w and start is not None:
                    runs.append((b, start, i))
                    start = None
        return runs

    rng = np.random.default_rng(0)
    for _ in range(2000):
        written = rng.random((int(rng.integers(1, 6)), int(rng.integers(1, 20)))) < rng.random()
        assert unwritten_runs(written) == scanned(written)
        assert unwritten_runs(written[:, 1:5]) == scanned(written[:, 1:5])
