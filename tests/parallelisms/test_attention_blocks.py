"""The block kernels under the ring: the CPU one against a float64 reference (masked rows included), the CUDA
wrappers against the ops' own schemas and shape rules on the meta device (this box has no GPU)."""
import pytest
import torch

from parallelisms.attention_blocks import CpuFlashBlock, CudaEfficientBlock, CudaFlashBlock, kernel_for
from parallelisms.ring_attention import _block_forward
from parallelisms.ring_plan import BlockTask, mask_task
from tests.parallelisms.attention_reference import relative_error


def test_kernel_choice_by_device_dtype_and_mask():
    assert isinstance(kernel_for("cpu", torch.bfloat16, 64, True), CpuFlashBlock)
    assert isinstance(kernel_for("cuda", torch.bfloat16, 64, False), CudaFlashBlock)
    assert isinstance(kernel_for("cuda", torch.float16, 64, True), CudaEfficientBlock)
    assert isinstance(kernel_for("cuda", torch.float32, 64, False), CudaEfficientBlock)
    assert isinstance(kernel_for("cuda", torch.bfloat16, 60, False), CudaEfficientBlock)
    with pytest.raises(NotImplementedError, match="mps"):
        kernel_for("mps", torch.float32, 64, False)


@pytest.mark.parametrize("kernel, dtype, masked", [
    (CudaFlashBlock(), torch.bfloat16, False), (CudaEfficientBlock(), torch.float32, True),
    (CudaEfficientBlock(), torch.bfloat16, False)])
def test_cuda_wrappers_fit_the_op_schemas_on_meta_tensors(kernel, dtype, masked):
    batch, heads, kv_heads, lq, head_dim = 2, 8, 2, 40, 64
    lk = 48 if masked else lq  # a mask row that is not 16-aligned; causal blocks are square
    q = torch.empty(batch, heads, lq, head_dim, device="meta", dtype=dtype)
    k, v = (torch.empty(batch, kv_heads, lk, head_dim, device="meta", dtype=dtype) for _ in range(2))
    mask = torch.zeros(batch, 1, lq, lk, device="meta", dtype=dtype) if masked else None
    out, lse, aux = kernel.forward(q, k, v, is_causal=not masked, scale=None, mask=mask)
    assert out.shape == q.shape and lse.shape == (batch, heads, lq) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(out, q, k, v, out, lse, aux, is_causal=not masked, scale=None, mask=mask)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape  # GQA heads folded back


def test_cpu_block_with_document_mask_zeroes_rows_that_see_nothing():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    doc_q, doc_k = torch.tensor([[0, 0, 1, 1, 2, 2]]), torch.tensor([[1, 1, 1, 2, 3, 3]])
    job = mask_task(BlockTask(slice(None), slice(None), False), doc_q, doc_k, torch.float32)
    out, lse, _ = _block_forward(q, k, v, job, None)
    assert torch.equal(out[:, :, :2], torch.zeros(1, 2, 2, 8)) and torch.isinf(lse[:, :, :2]).all()
    allowed = doc_q[0][:, None] == doc_k[0][None, :]
    scores = (q.double() @ k.double().transpose(-1, -2)) / 8 ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    expected_lse = torch.logsumexp(scores[:, :, 2:], dim=-1)
    expected = torch.softmax(scores[:, :, 2:], dim=-1) @ v.double()
    assert relative_error(out[:, :, 2:], expected) < 1e-6
    assert relative_error(lse[:, :, 2:], expected_lse) < 1e-6
