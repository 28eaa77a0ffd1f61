"""Document masking by pieces (cp/plan_pieces.py): every CP variant against each document run alone through plain SDPA,
and no S x S tensor anywhere in a masked forward + backward."""
import itertools

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from tests.parallelisms.test_context_parallel import DTYPES

SEQ = 48
# Row 0: 1-token documents next to each other and documents crossing every shard boundary (6/12/24-token chunks);
# row 1: one long document over half the sequence, then short ones.
DOC_LENGTHS = ([1, 1, 7, 1, 13, 2, 1, 1, 9, 12], [30, 1, 5, 1, 11])


def _documents() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
                        for lengths in DOC_LENGTHS])


def _attention(variant: str, size: int):
    from parallelisms.cp.attention import allgather_attention
    from parallelisms.cp.exchange_hybrid import hybrid_attention
    from parallelisms.cp.exchange_ulysses import ulysses_attention
    from parallelisms.cp.attention import ring_attention
    if variant == "hybrid":
        return lambda *a, **kw: hybrid_attention(*a, ulysses_degree=min(size, 2), **kw)
    return {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}[variant]


def _cases(size):
    """Every layout, GQA and MHA at cp 1 and 2; zigzag with GQA at cp 4 (4 ranks share 2 cores here)."""
    balancers = ("zigzag",) if size > 2 else ("zigzag", "striped", "contiguous")
    kv_heads = (2,) if size > 2 else (4, 2)
    cases = itertools.product(("ring", "allgather", "ulysses", "hybrid"), balancers, (True, False), kv_heads, DTYPES)
    return [c for c in cases if not (c[0] == "hybrid" and c[1] == "striped" and 1 < min(size, 2) < size)]


def _inputs(kv_heads, dtype):
    gen = torch.Generator().manual_seed(99)
    q = torch.randn(2, 4, SEQ, 8, generator=gen).to(dtype)
    k, v = (torch.randn(2, kv_heads, SEQ, 8, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=gen).to(dtype)


def _case_result(rank, size, variant, balancer, is_causal, kv_heads, dtype_name):
    """The variant's (out, dq, dk, dv) in global order (rank 0 only; the others return None)."""
    from parallelisms.context_parallel import shard_sequence, unshard_sequence
    q, k, v, grad_out = _inputs(kv_heads, DTYPES[dtype_name][0])

    def shard(x, dim=2):
        return shard_sequence(x, dim, rank, size, balancer)

    local = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]
    out = _attention(variant, size)(*local, dist.group.WORLD, is_causal=is_causal, load_balancer=balancer,
                                    document_ids=shard(_documents(), 1))
    out.backward(shard(grad_out))
    got = [unshard_sequence(t, 2, dist.group.WORLD, balancer) for t in (out, *(t.grad for t in local))]
    assert got[0].dtype == q.dtype
    return got if rank == 0 else None


def _results(rank, size):
    return [(case, _case_result(rank, size, *case)) for case in _cases(size)]


def _errors(case, got):
    """Max relative errors of (out, dq, dk, dv) against the per-document float64 reference (computed here, once)."""
    from tests.parallelisms.attention_reference import per_document_attention, relative_error
    _, _, is_causal, kv_heads, dtype_name = case
    q, k, v, grad_out = _inputs(kv_heads, DTYPES[dtype_name][0])
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = per_document_attention(*full, is_causal, _documents())
    expected.backward(grad_out.double())
    return [relative_error(a, b) for a, b in zip(got, [expected, *(t.grad for t in full)])]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_variant_matches_each_document_run_alone(size):
    """ring, all-gather, Ulysses, hybrid x zigzag/striped/contiguous x causal or not x GQA/MHA x fp32/bf16."""
    results = run_ranks(_results, size, timeout=180)[0]
    assert len(results) == len(_cases(size))
    errors = [(case, _errors(case, got)) for case, got in results]
    failures = [(case, e) for case, e in errors if max(e) > DTYPES[case[4]][1]]
    assert not failures, failures
    assert all(max(e) > 0 for _, e in errors)  # the variants really ran (no reference compared with itself)


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements of any tensor an aten op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


LONG_SEQ = 4096


def _largest_tensors(rank, size):
    """Largest tensor of a masked forward + backward at cp = 1 (as the trainer runs document masking) per variant."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 160, (LONG_SEQ,), generator=gen)
    lengths[::4] = 1
    docs = torch.repeat_interleave(torch.arange(LONG_SEQ), lengths)[:LONG_SEQ][None]
    q = torch.randn(1, 2, LONG_SEQ, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 1, LONG_SEQ, 16, generator=gen, requires_grad=True) for _ in range(2))
    largest = {}
    for variant in ("ring", "allgather", "ulysses", "hybrid"):
        with _LargestTensor() as mode:
            out = _attention(variant, size)(q, k, v, dist.group.WORLD, is_causal=True, document_ids=docs)
            out.sum().backward()
        largest[variant] = mode.largest
    return largest, int(docs.max()) + 1, q.numel()


@pytest.mark.timeout(120)
def test_masked_attention_never_allocates_an_s_by_s_tensor():
    """Forward + backward over 4096 tokens of ~100 documents: no tensor beyond O(tokens) (a dense (S, S) mask or
    score block is 16.7M elements; q is 131K)."""
    (largest, n_docs, q_numel), = run_ranks(_largest_tensors, 1, timeout=100)
    assert n_docs > 50
    for variant, numel in largest.items():
        assert numel <= 2 * q_numel, (variant, numel)
    assert 2 * q_numel * 32 <= LONG_SEQ * LONG_SEQ  # so the bound really is far below S x S


def _output_layouts(rank, size):
    """(output, dQ, dK) memory layouts of plain SDPA and of the document-masked ring at cp = 1 for the model's q/k/v:
    transposed views of (B, L, H, D) projections. True: (B, L, H, D) in memory."""
    from parallelisms.cp.attention import ring_attention
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, SEQ, h, 16, generator=gen).transpose(1, 2).requires_grad_() for h in (4, 2, 2))
    docs = _documents()[:1]
    layouts = {}
    for name, call in (("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                          enable_gqa=True)),
                       ("ring", lambda: ring_attention(q, k, v, dist.group.WORLD, document_ids=docs))):
        out = call()
        dq, dk, _ = torch.autograd.grad(out.sum(), (q, k, v))
        layouts[name] = [t.transpose(1, 2).is_contiguous() for t in (out, dq, dk)]
    return layouts


def test_masked_output_and_gradients_keep_the_models_memory_layout():
    """The model turns the attention output back into (B, L, H * D) and its q/k/v gradients into (B, L, H * D): a
    view when they are (B, L, H, D) in memory, as SDPA returns them; otherwise a copy per tensor (and for the output
    a second saved activation)."""
    (layouts,) = run_ranks(_output_layouts, 1, timeout=60)
    assert layouts["ring"] == layouts["sdpa"] == [True, True, True], layouts
