"""cuDNN THD orchestration (parallelisms/cp/kernel_cudnn_thd.py) on CPU, every frontend call answered in its own
convention by the float64 stand-in of tests/parallelisms/cudnn_frontend_reference.py (uids, ragged offsets in
elements, seq_len tensors, token-major stats), against per-document float64 attention:
- the graph wrapper alone (GQA 16/8 and MHA, causal squares and full rectangles, sequences of 1 to 2,000 tokens,
  lengths not multiples of 64, zero-length batch entries);
- the CP 1 packed path (one graph call forward and one backward per layer);
- Ulysses / hybrid's whole-sequence documents (causal squares and fused rectangles) at CP 2 and 4;
- the ring and the all-gather on the documents layout at CP 2 and 4 (real gloo ranks, tests/distributed.py);
- graph buckets: a 20-step CP 2 ring over changing documents builds at most 8 graphs per direction;
- the registered CP op pair (what compiled blocks call) on THD: eager, compiled and under opcheck.
The stand-in also checks every tensor bound against what the graph declared, on fake CUDA tensors too.
The real kernel: tests/gpu/test_gpu_cudnn_thd.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import parallelisms.cp.attention as attention_module
import parallelisms.cp.exchange_ring as ring_module
import parallelisms.cp.kernel_calls as calls_module
import parallelisms.cp.kernel_cudnn_thd as thd
import parallelisms.cp.packed_documents as packed_module
from parallelisms.cp.attention import local_segment_attention
from parallelisms.cp.exchange_alltoall import concatenated_documents
from parallelisms.cp.packed_documents import PackedDocuments, packed_attention
from parallelisms.cp.plan_layout import DocumentLayout
from parallelisms.cp.plan_pieces import DocumentShards
from tests.distributed import run_ranks
from training.planning import cuda_path_probe as probe
from training.planning.fake.cuda import load_fake_cuda_guard
from tests.parallelisms.attention_reference import reference_attention, relative_error
from tests.parallelisms.cudnn_frontend_reference import StandInFrontend
from tests.parallelisms.varlen_reference import varlen_backward, varlen_forward

TOLERANCE = 1e-5


def _stand_in(monkeypatch) -> StandInFrontend:
    """Every THD call of this process goes to a float64 stand-in (CPU, no device checks)."""
    frontend = StandInFrontend()
    graphs = thd.ThdGraphs(frontend, None)
    monkeypatch.setattr(thd, "graphs_for", lambda device: graphs)
    return frontend


def _lengths_row(total: int, seed: int, longest: int) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = [1, longest, 63, 65, 129]
    while sum(lengths) < total:
        lengths.append(int(rng.integers(1, 300)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


@pytest.mark.parametrize("heads", [(16, 8, 600), (2, 2, 2000)], ids=["gqa-16-8", "mha-2000-tokens"])
@pytest.mark.parametrize("rectangles", [False, True], ids=["causal-squares", "full-rectangles"])
def test_the_graph_wrapper_follows_the_frontends_convention(monkeypatch, heads, rectangles):
    frontend = _stand_in(monkeypatch)
    hq, hk, longest = heads
    gen = torch.Generator().manual_seed(7)
    lengths_q = _lengths_row(longest + 500, seed=1, longest=longest)
    lengths_k = [n + (17 if rectangles else 0) for n in lengths_q]
    lengths_q[2], lengths_k[2] = 0, 0  # a zero-length batch entry
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32) for n in (lengths_q, lengths_k))
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    # rectangles: q, k, v are views with wider token strides (as a fused QKV projection would give), so each
    # tensor's own stride must reach its ragged offsets while the packed outputs and gradients use theirs
    wide = 3 if rectangles else 0
    q = torch.randn(tq, hq + wide, 16, generator=gen)[:, :hq]
    k, v = (torch.randn(tk, hk + wide, 16, generator=gen)[:, :hk] for _ in range(2))
    dout = torch.randn(tq, hq, 16, generator=gen)
    call = thd.ThdCall(cu_q, cu_k, max(lengths_q), max(lengths_k), is_causal=not rectangles)
    graphs = thd.graphs_for(q.device)
    out, stats = graphs.forward(q, k, v, call, 0.25)
    dq, dk, dv = graphs.backward(dout, q, k, v, out, stats, call, 0.25)
    assert stats.shape == (tq, hq, 1) and stats.dtype == torch.float32
    ref_out, ref_lse, *_ = varlen_forward(q.double(), k.double(), v.double(), cu_q, cu_k, 0, 0, 0.0,
                                          not rectangles, False, scale=0.25)
    refs = varlen_backward(dout.double(), q.double(), k.double(), v.double(), ref_out, ref_lse, cu_q, cu_k, 0, 0,
                           0.0, not rectangles, None, None, scale=0.25)
    assert relative_error(out, ref_out) < TOLERANCE
    assert relative_error(stats[..., 0].T, ref_lse) < TOLERANCE
    for got, ref in zip((dq, dk, dv), refs):
        assert relative_error(got, ref) < TOLERANCE
    assert frontend.calls == ["forward", "backward"] and len(frontend.graphs) == 2
    declared = frontend.graphs[0].node[1]["q"].dim
    assert declared[0] == thd.bucket(len(lengths_q), thd.BATCH_FLOOR, 4)  # the bucket, zero-length entries added
    assert declared[2] > longest + (17 if rectangles else 0)


def test_offsets_in_bytes_or_head_major_stats_fail_against_the_stand_in(monkeypatch):
    """The stand-in is strict: the two mistakes the frontend does not report are caught."""
    _stand_in(monkeypatch)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    q = k = v = torch.randn(12, 2, 8)
    call = thd.ThdCall(cu, cu, 7, 7, True)
    reference, _, *_ = varlen_forward(q.double(), k.double(), v.double(), cu, cu, 0, 0, 0.0, True, False, scale=0.5)
    bytes_call = lambda self, q, k, backward=False: {  # noqa: E731
        **real_bindings(self, q, k), thd.Uid.RAG_Q: real_bindings(self, q, k)[thd.Uid.RAG_Q] * q.element_size()}
    real_bindings = thd.ThdCall.bindings
    monkeypatch.setattr(thd.ThdCall, "bindings", bytes_call)
    with pytest.raises(AssertionError, match="past the buffer"):
        thd.graphs_for(q.device).forward(q, k, v, call, 0.5)
    monkeypatch.setattr(thd.ThdCall, "bindings", real_bindings)
    monkeypatch.setattr(thd, "_stats_stride", lambda shape: [shape.heads * shape.max_q, shape.max_q, 1, 1])
    _stand_in(monkeypatch)  # new graphs: the cached ones declared token-major stats
    with pytest.raises(AssertionError, match="token-major"):
        thd.graphs_for(q.device).forward(q, k, v, call, 0.5)
    monkeypatch.undo()
    _stand_in(monkeypatch)
    out, _ = thd.graphs_for(q.device).forward(q, k, v, call, 0.5)
    assert relative_error(out, reference) < TOLERANCE


def _documents(batch: int, seq: int, seed: int, longest: int = 2000) -> torch.Tensor:
    """(B, S) ids: documents of 1 to `longest` tokens, lengths not multiples of 64."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        lengths = [int(min(longest, x)) for x in np.ceil(rng.lognormal(3.5, 1.2, seq))]
        rows.append(np.repeat(np.arange(len(lengths)), lengths)[:seq])
    return torch.from_numpy(np.stack(rows))


def _qkv(batch, seq, heads, kv_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(batch, seq, h, 16, generator=gen).transpose(1, 2).requires_grad_()  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads), torch.randn(batch, heads, seq, 16, generator=gen)


@pytest.mark.parametrize("heads", [(16, 8), (4, 4)], ids=["gqa-16-8", "mha"])
def test_cp1_packed_documents_on_thd(monkeypatch, heads):
    frontend = _stand_in(monkeypatch)
    monkeypatch.setattr(packed_module, "one_packed_call", lambda q, kernel: True)
    ids = _documents(2, 640, seed=2)
    q, k, v, dout = _qkv(2, 640, *heads, seed=3)
    out = packed_attention(q, k, v, PackedDocuments.from_ids(ids.numpy()), packed="cudnn_thd")
    out.backward(dout)
    assert frontend.calls == ["forward", "backward"]  # one call each way for the whole batch
    full = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = reference_attention(*full, True, ids)
    expected.backward(dout.double())
    assert relative_error(out, expected) < TOLERANCE
    for got, ref in zip((q.grad, k.grad, v.grad), full):
        assert relative_error(got, ref.grad) < TOLERANCE


def _route_documents_to_thd(monkeypatch) -> StandInFrontend:
    """The CP paths' document pieces take the packed calls (CPU has none) and those go to THD."""
    frontend = _stand_in(monkeypatch)
    for module in (calls_module, ring_module):
        if hasattr(module, "uses_varlen"):
            monkeypatch.setattr(module, "uses_varlen", lambda q, pieces: bool(pieces))
    monkeypatch.setattr(attention_module, "packed_kernel", lambda asked, q: "cudnn_thd")
    return frontend


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_and_hybrid_documents_on_thd(monkeypatch, cp):
    """After Ulysses' all-to-all (hybrid's too) a rank attends over every rank's shard concatenated, in the
    documents layout's order: causal squares and fused full rectangles, one THD call each."""
    frontend = _route_documents_to_thd(monkeypatch)
    ids = _documents(1, 512, seed=cp)
    docs = concatenated_documents(DocumentShards.from_layout(ids, DocumentLayout.plan(ids, cp)))
    q, k, v, dout = _qkv(1, 512, 4, 2, seed=5)
    out = local_segment_attention(q, k, v, docs, is_causal=True)
    out.backward(dout)
    assert set(frontend.calls) == {"forward", "backward"}
    positions = docs.positions[0, 0]
    order = torch.argsort(positions)
    full = [x.detach()[:, :, order].double().requires_grad_() for x in (q, k, v)]
    expected = reference_attention(*full, True, ids)
    expected.backward(dout[:, :, order].double())
    assert relative_error(out[:, :, order], expected) < TOLERANCE
    for got, ref in zip((q.grad, k.grad, v.grad), full):
        assert relative_error(got[:, :, order], ref.grad) < TOLERANCE


def _ring_case(rank, size, impl):
    """On one gloo rank: the documents layout's ring or all-gather with every packed call on the stand-in."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from parallelisms.context_parallel import context_parallel

    patch = pytest.MonkeyPatch()
    try:
        frontend = _route_documents_to_thd(patch)
        ids = _documents(2, 384, seed=11)
        q, k, v, dout = _qkv(2, 384, 4, 2, seed=12)
        full = [x.detach().double().requires_grad_() for x in (q, k, v)]
        expected = reference_attention(*full, True, ids)
        expected.backward(dout.double())
        layout = DocumentLayout.plan(ids, size)
        mine = layout.positions[rank]  # (B, S / P)
        take = lambda x: torch.stack([x[b, :, mine[b]] for b in range(x.size(0))])  # noqa: E731
        local = [take(x.detach()).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (q, k, v)]
        local_ids = ids.clone()
        with context_parallel(dist.group.WORLD, [local_ids], [1], load_balancer="documents", document_ids=local_ids,
                              cp_impl=impl):
            out = F.scaled_dot_product_attention(*local, is_causal=True, enable_gqa=True)
            out.backward(take(dout))
        errors = [relative_error(out, take(expected))]
        errors += [relative_error(g.grad, take(r.grad)) for g, r in zip(local, full)]
        return errors, sorted(set(frontend.calls))
    finally:
        patch.undo()


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_and_allgather_documents_on_thd(cp):
    for per_impl in run_ranks(_ring_cases, cp, timeout=120):
        for impl, (errors, calls) in per_impl.items():
            assert calls == ["backward", "forward"], (impl, calls)
            assert max(errors) < TOLERANCE, (impl, errors)


def _ring_cases(rank, size):
    return {impl: _ring_case(rank, size, impl) for impl in ("ring", "allgather")}


@pytest.mark.slow
def test_a_20_step_cp2_run_over_changing_documents_builds_at_most_8_graphs_per_direction(monkeypatch):
    """Graphs are built per shape bucket (sequence count, longest sequence and total tokens rounded up), not per
    batch: 20 steps of 16K-token web-like rows at CP 2 (both ranks' ring blocks: causal squares and
    fused rectangles), counted on fake CUDA by the wrapper itself. Slow tier since issue 56 (the fast tier runs in
    minutes; CI runs both): a 20-step 2-rank run, 22 s."""
    why = load_fake_cuda_guard()
    if why:
        pytest.skip(why)
    _stand_in(monkeypatch)
    for step in range(20):
        row = torch.from_numpy(probe.web_like_row(16384, seed=step))[None]
        docs = DocumentShards.from_layout(row, DocumentLayout.plan(row, 2))
        for rank in range(2):
            probe.measure_layer(docs, rank, "ring", (1, 8192, 16, 8, 128), packed="cudnn_thd")
    built = thd.graphs_for(torch.device("cuda")).built
    assert 0 < built["forward"] <= 8 and 0 < built["backward"] <= 8, built


def test_documents_take_thd_where_the_run_takes_cudnn_and_the_frontend_serves_the_gpu(monkeypatch):
    """"auto" takes THD where it resolves to cuDNN (Hopper / Blackwell with torch's conditions), "cudnn" by name;
    FlashAttention varlen otherwise: another family, no frontend, a dtype or head dim cuDNN does not serve, CPU."""
    import parallelisms.cp.kernel_blocks as kernel_blocks

    gpu, bf16 = torch.device("cuda", 0), torch.bfloat16
    monkeypatch.setattr(thd, "_thd_problem_on", lambda index: None)
    monkeypatch.setattr(kernel_blocks, "family_on", lambda asked, device: "cudnn")
    assert thd.packed_kernel_for("auto", gpu, bf16, 128) == "cudnn_thd"
    assert thd.packed_kernel_for("cudnn", gpu, bf16, 128) == "cudnn_thd"
    assert thd.packed_kernel_for("flash", gpu, bf16, 128) == "flash"
    assert thd.packed_kernel_for("fa3", gpu, bf16, 128) == "flash"
    assert thd.packed_kernel_for("cudnn", gpu, torch.float32, 128) == "flash"
    assert thd.packed_kernel_for("cudnn", gpu, bf16, 256) == "flash"  # cuDNN's head dim limit here
    assert thd.packed_kernel_for("cudnn", torch.device("cpu"), bf16, 128) == "flash"
    monkeypatch.setattr(kernel_blocks, "family_on", lambda asked, device: "flash")  # an A100, or deterministic
    assert thd.packed_kernel_for("auto", gpu, bf16, 128) == "flash"
    monkeypatch.setattr(thd, "_thd_problem_on", lambda index: "the nvidia-cudnn-frontend package is not installed")
    assert thd.packed_kernel_for("cudnn", gpu, bf16, 128) == "flash"
    assert thd.documents_kernel_name("cudnn", gpu, bf16, 128) == "flash_varlen"
    assert thd.documents_kernel_name("auto", torch.device("cpu"), torch.float32, 64) == "per_document"


def test_thd_is_refused_where_it_cannot_run():
    assert "runs on CUDA" in thd.thd_problem(torch.device("cpu"), lambda module: True)
    assert "nvidia-cudnn-frontend" in thd.thd_problem(torch.device("cuda", 0), lambda module: False)


def test_cp1_packed_offsets_go_where_the_queries_are():
    """Issue 57: document ids (or a packed plan) left on the host beside CUDA buffers gave the packed kernel host
    cu_seqlens (a device-mismatch error inside it); context_parallel moves them once to the buffers' device. The
    meta device stands for CUDA here (any device that is not the ids')."""
    from parallelisms.context_parallel import _packed_documents
    from parallelisms.cp.packed_documents import PackedDocuments
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    elsewhere = torch.device("meta")
    assert _packed_documents(ids, 1, None, elsewhere).cu_seqlens.device == elsewhere
    host_plan = PackedDocuments.from_ids(ids.numpy())
    assert host_plan.cu_seqlens.device.type == "cpu"
    assert _packed_documents(ids, 1, host_plan, elsewhere).cu_seqlens.device == elsewhere
    assert _packed_documents(ids, 1, host_plan, ids.device) is host_plan  # already there: not copied
    assert _packed_documents(ids, 1, None, ids.device).cu_seqlens.device.type == "cpu"  # CPU runs: unchanged
    assert _packed_documents(ids, 2, None, ids.device) is None  # CP > 1: the documents layout, no packed form


def _registered_op_on_thd(rank, size):
    """One gloo rank, CP 1 with documents: the registered op pair (parallelisms/cp/op.py, what compiled blocks call)
    with its packed calls routed to THD and answered by the stand-in; eager, under torch.library.opcheck (schema,
    the fake against the real outputs, autograd registration, AOT dispatch), and compiled (aot_eager: the op's
    fakes and autograd formula traced, its bodies run as they are), each against float64 per-document attention."""
    import torch.distributed as dist
    from torch.library import opcheck

    import parallelisms.cp.op_variants as op_variants
    from parallelisms.context_parallel import context_parallel
    from parallelisms.cp.op import ACTIVE

    patch = pytest.MonkeyPatch()
    try:
        frontend = _stand_in(patch)
        patch.setattr(op_variants, "packed_kernel", lambda asked, q: "cudnn_thd")
        patch.setattr(packed_module, "one_packed_call", lambda q, kernel: True)
        ids = _documents(2, 192, seed=8, longest=120)
        q, k, v, dout = _qkv(2, 192, 4, 2, seed=9)
        full = [x.detach().double().requires_grad_() for x in (q, k, v)]
        expected = reference_attention(*full, True, ids)
        expected.backward(dout.double())
        tokens, group = torch.zeros_like(ids), dist.group.WORLD
        errors = {}
        with context_parallel(group, [tokens, ids], [1, 1], attention_kernel="cudnn", load_balancer="documents",
                              document_ids=ids):
            run = ACTIVE.current(group.group_name)
            constants = (True, None, group.group_name, run.op_variant)

            def attention(q, k, v):
                return torch.ops.titan_cp.attention(q, k, v, *constants)[0]

            for name, fn in (("eager", attention),
                             ("compiled", torch.compile(attention, backend="aot_eager", fullgraph=True))):
                leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                before = len(frontend.calls)
                out = fn(*leaves)
                out.backward(dout)
                errors[name] = [relative_error(out, expected)] + [relative_error(x.grad, r.grad)
                                                                  for x, r in zip(leaves, full)]
                errors[name + " calls"] = frontend.calls[before:]
            q, k, v = (x.detach() for x in (q, k, v))  # the backward op has no autograd formula of its own
            out, lse = torch.ops.titan_cp.attention(q, k, v, *constants)
            checks = {"forward": opcheck(torch.ops.titan_cp.attention.default,
                                         tuple(x.detach().clone().requires_grad_() for x in (q, k, v)) + constants),
                      "backward": opcheck(torch.ops.titan_cp.attention_backward.default,
                                          (dout, q, k, v, out, lse, *constants))}
        return run.op_variant, errors, checks
    finally:
        patch.undo()


@pytest.mark.timeout(240)
def test_the_registered_op_runs_thd_eager_compiled_and_under_opcheck():
    """Issue 57, item 1: the op's THD branch (cuDNN's packed documents at CP 1, `auto` on an H100/H200), checked
    where no GPU is: the stand-in also checks every tensor the op's bodies bind (uids, dtypes, devices, the packed
    strides it declared; tests/parallelisms/cudnn_frontend_reference.py). One THD call forward and one backward per
    run; the numbers are float64 per-document attention's. The same branch on fake CUDA tensors, counted for copies
    of the output's gradient: tests/parallelisms/test_cp_op_grad_layout.py. On an H200 the compiled op with THD
    matched eager within 1e-3 (bench/measurements/h200_gpu_report_2026-12-04, compiled_op)."""
    ((variant, errors, checks),) = run_ranks(_registered_op_on_thd, 1, timeout=200)
    assert variant == "packed", variant
    for name in ("eager", "compiled"):
        assert errors[name + " calls"] == ["forward", "backward"], errors
        assert max(errors[name]) < TOLERANCE, errors
    assert all(result == "SUCCESS" for op in checks.values() for result in op.values()), checks
