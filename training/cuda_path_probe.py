"""What a GPU would see of one layer's CP attention: its kernel calls, aten ops, host syncs and transient memory,
counted on fake CUDA tensors (FakeTensorMode makes `cuda` tensors on a CPU-only build; shapes, strides and the CUDA
kernels' meta functions run, no storage is allocated).

One rank of a fake process group of the CP degree runs the variant's own forward and backward functions (the sparse
ring on the documents layout, or Ulysses' attention after its all-to-all) on its real plan, made from real document
ids, under a dispatch mode that counts:
- `attention_kernel_calls_per_layer`: attention kernel calls (flash, efficient, varlen) of forward + backward of one
  layer on the busiest rank (the rank with the most planned calls);
- `aten_ops_per_layer`: every aten op of the same (gathers, merges, copies, collectives);
- `host_syncs_per_micro_step`: `_local_scalar_dense` and device-to-host copies of one layer's attention: the plan is
  cached per batch, so these happen once per micro-step, not once per layer.
The transient peak of the layer's attention (its inputs excluded) is read with torch's MemTracker, for the current
path (GQA unexpanded) and for the earlier one (one flash call per piece, K/V expanded), so the dry run can print both.

Document lengths: the recipe's prepared stores when given, else the stated web-like mix (lognormal(6.5, 1.0) tokens,
the bench's "web-like" mix) packed into one row.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from parallelisms.cp_toolkit import BlockSpec
from parallelisms.cp_ulysses import concatenated_documents
from parallelisms.document_layout import DocumentLayout
from parallelisms.ring_attention import ring_backward, ring_forward
from parallelisms.ring_plan import DocumentShards
from parallelisms.ring_sparse import sparse_backward, sparse_forward

aten = torch.ops.aten
WEB_LIKE = "web-like: document lengths lognormal(6.5, 1.0) tokens (median ~665), packed into one row"

ATTENTION_OPS = {
    aten._flash_attention_forward.default, aten._flash_attention_backward.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default,
    aten._efficient_attention_forward.default, aten._efficient_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


GUARD_SOURCE = """#include <c10/core/impl/DeviceGuardImplInterface.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
"""


def load_fake_cuda_guard() -> str | None:
    """Registers a no-op CUDA device guard in this process (a 2-line C++ library, compiled once per torch version
    into the temp folder), so fake CUDA tensors can be sliced and indexed on a CPU-only build; torch.cuda stays
    unavailable. Returns None when it works, else why not (no compiler, no headers): the probe is then skipped."""
    import ctypes
    import os
    import subprocess
    import tempfile

    root = os.path.dirname(torch.__file__)
    lib = os.path.join(tempfile.gettempdir(), f"fake_cuda_guard_{torch.__version__.replace('+', '_')}.so")
    if not os.path.exists(lib):
        src = lib[:-3] + ".cpp"
        with open(src, "w") as f:
            f.write(GUARD_SOURCE)
        cmd = ["g++", "-shared", "-fPIC", "-std=c++17", f"-I{root}/include", src, "-o", lib + ".tmp",
               f"-L{root}/lib", "-lc10", f"-Wl,-rpath,{root}/lib"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return f"cannot build the no-op CUDA device guard ({type(e).__name__})"
        os.replace(lib + ".tmp", lib)
    ctypes.CDLL(lib)  # registration is idempotent: the registry keeps one guard per device type
    return None


class LaunchCounter(TorchDispatchMode):
    """Counts aten ops, attention kernel calls and host syncs (reading a device value, or copying device to host)."""

    def __init__(self, record: bool = False):
        super().__init__()
        self.ops = self.attention = self.syncs = 0
        self.record = record
        self.attention_calls: list = []  # (op, args, kwargs, result) of every attention call when recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if func is aten._local_scalar_dense.default or _device_to_host(func, args, kwargs):
            self.syncs += 1
        result = func(*args, **kwargs)
        if func in ATTENTION_OPS:
            self.attention += 1
            if self.record:
                self.attention_calls.append((func, args, kwargs, result))
        return result


def _device_to_host(func, args, kwargs) -> bool:
    if func is aten._to_copy.default:
        src, dst = args[0], kwargs.get("device")
        return src.device.type == "cuda" and dst is not None and torch.device(dst).type == "cpu"
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        return src.device.type == "cuda" and dst.device.type == "cpu"
    return False


def web_like_row(seq_len: int, seed: int = 0) -> np.ndarray:
    """(S,) document ids of one row packed from the web-like mix (the last document cut at the row's end)."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < seq_len:
        lengths += [int(x) for x in np.ceil(rng.lognormal(6.5, 1.0, 256))]
    lengths = np.array(lengths)
    lengths = lengths[:np.searchsorted(np.cumsum(lengths), seq_len) + 1]
    lengths[-1] -= lengths.sum() - seq_len
    return np.repeat(np.arange(lengths.size), lengths)


def planned_calls(docs: DocumentShards, rank: int, cp: int) -> int:
    """Attention kernel calls of one layer (forward + backward) of `rank` on CUDA flash, from the plan alone."""
    calls = 0
    for src in range(cp):
        pieces = docs.layout_pieces(rank, src, True)
        if pieces:
            calls += 2 * len({p.is_causal for p in pieces})
    return calls


@dataclass
class LayerCounts:
    attention_kernel_calls_per_layer: int
    aten_ops_per_layer: int
    host_syncs_per_micro_step: int
    transient_peak_bytes: float
    rank: int
    pieces: int
    """The mask-free pieces of the rank's layer (what the per-piece path would call, forward and again backward)."""


@contextlib.contextmanager
def fake_group(cp: int, rank: int):
    """A fake process group of `cp` ranks in this process (collectives return at once), unless one is up already."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _qkv(batch, length, heads, kv_heads, head_dim, dtype):
    """Fake CUDA q, k, v as the model hands them over: (B, L, H, D) projections seen as (B, H, L, D)."""
    make = lambda h: torch.empty(batch, length, h, head_dim, dtype=dtype, device="cuda").transpose(1, 2)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


class ExpandGqa(TorchDispatchMode):
    """The earlier CUDA path's GQA handling, replayed for the memory comparison: K/V expanded to the query heads
    before every flash call (forward and backward, as `repeat_interleave` did) and dK/dV folded back."""

    FORWARD = {aten._scaled_dot_product_flash_attention.default, aten._flash_attention_forward.default}
    BACKWARD = {aten._scaled_dot_product_flash_attention_backward.default: 1,
                aten._flash_attention_backward.default: 1}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FORWARD or func in self.BACKWARD:
            at = 0 if func in self.FORWARD else 1  # query's position
            q, k, v = args[at:at + 3]
            head_dim = 1 if q.dim() == 4 else -2  # (B, H, L, D) or packed (total, H, D)
            groups = q.size(head_dim) // k.size(head_dim)
            if groups > 1:
                expanded = [x.repeat_interleave(groups, dim=head_dim) for x in (k, v)]
                result = func(*args[:at + 1], *expanded, *args[at + 3:], **kwargs)
                if func in self.BACKWARD:
                    dq, dk, dv = result
                    fold = (lambda g: g.unflatten(head_dim, (k.size(head_dim), groups)).sum(  # noqa: E731
                        dim=head_dim + 1 if head_dim > 0 else head_dim))
                    return dq, fold(dk), fold(dv)
                return result
        return func(*args, **kwargs)


class FlashWorkspace(TorchDispatchMode):
    """The CUDA flash backward's own scratch, which its meta function does not allocate, allocated around each call
    so the memory tracker sees it (sizes as flash-attention 2's mha_bwd / mha_varlen_bwd allocate them, vendored in
    torch): a float32 dQ accumulator of (total_q + 128 x sequences, Hq, D rounded up to 32) rows, float32 softmax_d
    of (Hq, total_q + 128 x sequences), and with GQA dK/dV expanded to the query heads before the kernel sums them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._flash_attention_backward.default:
            q, k = args[1], args[2]  # packed (total, H, D)
            seqs, total_q, total_k = args[6].numel() - 1, q.size(0), k.size(0)
            heads, kv_heads, head_dim = q.size(1), k.size(1), q.size(2)
        elif func is aten._scaled_dot_product_flash_attention_backward.default:
            q, k = args[1], args[2]  # (B, H, L, D)
            seqs, total_q, total_k = q.size(0), q.size(0) * q.size(2), k.size(0) * k.size(2)
            heads, kv_heads, head_dim = q.size(1), k.size(1), q.size(3)
        else:
            return func(*args, **kwargs)
        rows = total_q + 128 * seqs
        scratch = [torch.empty(rows, heads, -(-head_dim // 32) * 32, dtype=torch.float32, device=q.device),
                   torch.empty(heads, rows, dtype=torch.float32, device=q.device)]
        if kv_heads != heads:
            scratch += [torch.empty(total_k, heads, head_dim, dtype=k.dtype, device=k.device) for _ in range(2)]
        result = func(*args, **kwargs)
        del scratch
        return result


def _layer(fwd, bwd, q, k, v, spec):
    out, lse, auxes = fwd(q, k, v, spec)
    grads = bwd(torch.empty_like(out), q, k, v, out, lse, auxes, spec)
    del out, lse, auxes
    return grads


def measure_layer(docs: DocumentShards, rank: int, impl: str, shape: tuple, dtype=torch.bfloat16,
                  expand_gqa: bool = False, memory: bool = False, counter: LaunchCounter | None = None) -> LayerCounts:
    """One layer's attention (forward + backward) of `rank` on fake CUDA tensors. `shape` = (batch, local length,
    query heads, K/V heads, head dim) as this rank's attention sees them (Ulysses: the whole sequence, heads / P)."""
    batch, length, heads, kv_heads, head_dim = shape
    cp = len(docs.per_rank)
    pieces = sum(len(docs.layout_pieces(rank, src, True)) for src in range(cp))
    with fake_group(max(cp, 1) if impl == "ring" else 1, rank if impl == "ring" else 0) as group, \
            FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _qkv(batch, length, heads, kv_heads, head_dim, dtype)
        if impl == "ring":
            spec, fwd, bwd = BlockSpec(group, True, None, "documents", docs, None), sparse_forward, sparse_backward
        else:  # Ulysses / hybrid on documents: the ring's code at P = 1 over the gathered sequence
            spec, fwd, bwd = BlockSpec(None, True, None, "documents", docs, None), ring_forward, ring_backward
        tracker = MemTracker() if memory else contextlib.nullcontext()
        counter = counter or LaunchCounter()
        # the modelled scratch sits below the counter: allocated and tracked, not counted as ops
        with tracker, (FlashWorkspace() if memory else contextlib.nullcontext()), counter, \
                (ExpandGqa() if expand_gqa else contextlib.nullcontext()):
            _layer(fwd, bwd, q, k, v, spec)
        peak = _total(tracker.get_tracker_snapshot("peak")) if memory else 0.0
    return LayerCounts(counter.attention, counter.ops, counter.syncs, peak, rank, pieces)


def _total(snapshot: dict) -> float:
    return float(sum(per_device.get("Total", 0) for per_device in snapshot.values()))


def ring_counts(ids: np.ndarray, cp: int, shape: tuple, **kwargs) -> LayerCounts:
    """The sparse ring on the documents layout of one row: the rank with the most planned calls, measured."""
    docs = DocumentShards.from_layout(torch.from_numpy(ids)[None], DocumentLayout.plan(torch.from_numpy(ids)[None],
                                                                                        cp))
    busiest = max(range(cp), key=lambda r: planned_calls(docs, r, cp))
    return measure_layer(docs, busiest, "ring", shape, **kwargs)


def ulysses_counts(ids: np.ndarray, cp: int, shape: tuple, **kwargs) -> LayerCounts:
    """Ulysses on the documents layout: the attention every rank runs after the all-to-all (heads / P, all tokens;
    the same plan on every rank)."""
    row = torch.from_numpy(ids)[None]
    docs = concatenated_documents(DocumentShards.from_layout(row, DocumentLayout.plan(row, cp)))
    return measure_layer(docs, 0, "ulysses", shape, **kwargs)


# ---- the dry run's view: one row per stage -------------------------------------------------------------------------

def prepared_lengths(cfg) -> np.ndarray | None:
    """Every document length of the recipe's prepared stores (pooled), or None when they are not all here (the
    dry run's data usually lives where the recipe will run)."""
    import os

    from data.prepare import open_store
    from data.sources import build_run_tokenizer, store_specs
    from models.llama import recipe_model_config

    if not cfg.data.tokenizer_path or not os.path.exists(cfg.data.tokenizer_path):
        return None
    try:
        tokenizer = build_run_tokenizer(cfg, recipe_model_config(cfg).vocab_size)
        stores = [open_store(spec, tokenizer) for spec in store_specs(cfg)]
    except Exception:  # a missing or stale store, a tokenizer that does not load: the stated mix instead
        return None
    if not stores or any(s is None or s.num_documents == 0 for s in stores):
        return None
    return np.concatenate([s.doc_lengths.astype(np.int64) for s in stores])


def row_from_lengths(lengths: np.ndarray, seq_len: int, seed: int = 0) -> np.ndarray:
    """(S,) ids of documents drawn from `lengths` packed into one row (the last one cut at the row's end)."""
    rng = np.random.default_rng(seed)
    drawn = []
    while sum(drawn) < seq_len:
        drawn += rng.choice(lengths, 256).tolist()
    drawn = np.maximum(np.array(drawn), 1)
    drawn = drawn[:np.searchsorted(np.cumsum(drawn), seq_len) + 1]
    drawn[-1] -= drawn.sum() - seq_len
    return np.repeat(np.arange(drawn.size), drawn)


def _stage_shape(cfg, cp: int, tp: int, gathered: bool) -> tuple:
    from models.llama import recipe_model_config

    m = recipe_model_config(cfg)
    heads, kv = m.n_heads // tp, max(1, m.num_kv_heads // tp)
    if gathered:  # Ulysses: the whole sequence, heads split over the group (K/V replicated up to whole groups)
        return (1, cfg.training.seq_len, max(1, heads // cp), max(1, kv // cp), m.head_dim)
    return (1, cfg.training.seq_len // cp, heads, kv, m.head_dim)


def _one_document_layer(cfg, cp: int, tp: int, device: str, expand_gqa: bool = False) -> LayerCounts:
    """One layer's attention (forward + backward) on the row the dry run's step measures (one document, zigzag's
    layout): the dense ring on fake `device` tensors, counted, with its transient peak (inputs excluded)."""
    batch, length, heads, kv, head_dim = _stage_shape(cfg, cp, tp, gathered=False)
    dtype = torch.bfloat16 if cfg.training.dtype == "bfloat16" else torch.float32
    with fake_group(cp, 0) as group, FakeTensorMode(allow_non_fake_inputs=True):
        make = lambda h: torch.empty(batch, length, h, head_dim, dtype=dtype, device=device).transpose(1, 2)  # noqa
        q, k, v = make(heads), make(kv), make(kv)
        spec = BlockSpec(group if cp > 1 else None, True, None, "zigzag", None, None)
        with MemTracker() as tracker, FlashWorkspace(), LaunchCounter() as counter, \
                (ExpandGqa() if expand_gqa else contextlib.nullcontext()):
            _layer(ring_forward, ring_backward, q, k, v, spec)
            peak = _total(tracker.get_tracker_snapshot("peak"))
    return LayerCounts(counter.attention, counter.ops, counter.syncs, peak, 0, 0)


def stage_cuda_path(cfg, cp: int, tp: int, lengths: np.ndarray | None) -> dict:
    """The dry run's CUDA-path numbers of one stage: counts on a documents row (prepared stores, else web-like) and
    one layer's attention transients on the step's own row, CPU kernels vs CUDA with GQA unexpanded and expanded."""
    why = load_fake_cuda_guard()
    if why:
        return {"cuda_path": f"not measured: {why}"}
    p = cfg.parallelism
    ids = row_from_lengths(lengths, cfg.training.seq_len) if lengths is not None else web_like_row(
        cfg.training.seq_len)
    dtype = torch.bfloat16 if cfg.training.dtype == "bfloat16" else torch.float32
    gathered = p.cp_impl in ("ulysses", "hybrid") and cp > 1
    documents = cfg.data.document_masking and p.cp_load_balancer == "documents"
    counts = expanded_docs = None
    if documents and cp > 1:  # the documents row: counted, and its varlen transients measured both ways
        run = ulysses_counts if gathered else ring_counts
        shape = _stage_shape(cfg, cp, tp, gathered)
        counts = run(ids, cp, shape, dtype=dtype, memory=True)
        expanded_docs = run(ids, cp, shape, dtype=dtype, memory=True, expand_gqa=True).transient_peak_bytes
    cpu = _one_document_layer(cfg, cp, tp, "cpu").transient_peak_bytes
    one_doc = _one_document_layer(cfg, cp, tp, "cuda")
    expanded = _one_document_layer(cfg, cp, tp, "cuda", expand_gqa=True).transient_peak_bytes
    unexpanded = one_doc.transient_peak_bytes
    if counts is None:  # one document per row as far as CP goes: the dense ring's (or one rank's) calls
        counts = one_doc
    else:
        unexpanded, expanded = max(unexpanded, counts.transient_peak_bytes), max(expanded, expanded_docs)
    return {"attention_kernel_calls_per_layer": counts.attention_kernel_calls_per_layer,
            "aten_ops_per_layer": counts.aten_ops_per_layer,
            "host_syncs_per_micro_step": counts.host_syncs_per_micro_step,
            "count_row": ("prepared stores" if lengths is not None else "web-like") if documents and cp > 1 else
            "one document",
            "attention_transient_gib_cpu": cpu / 2**30, "attention_transient_gib_cuda": unexpanded / 2**30,
            "attention_transient_gib_cuda_gqa_expanded": expanded / 2**30}


def cuda_peak_gib(step_peak_gib: float, numbers: dict, expanded: bool = False) -> float | None:
    """The step's peak on the CUDA path: the measured step (CPU kernels) plus what one layer's CUDA attention holds
    beyond the CPU kernels' (added whatever phase the peak is in: an upper bound)."""
    if "attention_transient_gib_cuda" not in numbers:
        return None
    cuda = numbers["attention_transient_gib_cuda_gqa_expanded" if expanded else "attention_transient_gib_cuda"]
    return step_peak_gib + max(0.0, cuda - numbers["attention_transient_gib_cpu"])


def cuda_table(rows: list[tuple[str, float, dict]], usable_gib: float) -> str:
    """The dry run's second table: per stage (name, step peak GiB, stage_cuda_path's numbers)."""
    head = ("stage", "attn calls/layer", "aten ops/layer", "host syncs/micro-step", "count row",
            "peak GiB CUDA (GQA unexpanded)", "peak GiB CUDA (GQA expanded, earlier path)", "fits")
    lines = [head]
    for name, peak, n in rows:
        if "attention_transient_gib_cuda" not in n:
            lines.append((name, n.get("cuda_path", "?"), "", "", "", "", "", ""))
            continue
        new, old = cuda_peak_gib(peak, n), cuda_peak_gib(peak, n, expanded=True)
        lines.append((name, str(n["attention_kernel_calls_per_layer"]), str(n["aten_ops_per_layer"]),
                      str(n["host_syncs_per_micro_step"]), n["count_row"], f"{new:.2f}", f"{old:.2f}",
                      "yes" if new <= usable_gib else "NO"))
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines)


CUDA_PATH_STATEMENT = (
    "  CUDA path, on fake CUDA tensors (training/cuda_path_probe.py): attn calls / aten ops = one layer's attention "
    "forward + backward on the busiest CP rank; host syncs = device-to-host reads in the attention path per "
    "micro-step; the peak is the step's measured peak plus what one layer's CUDA attention (varlen gathers, flash "
    "backward scratch, GQA dK/dV expanded inside the kernel) holds beyond the CPU kernels' (an upper bound); "
    "'earlier path' expands K/V for GQA before every flash call")


def print_cuda_path(cfg, results, usable_gib: float) -> None:
    """The dry run's CUDA-path table (one row per stage; `results` are dry_run.RowResult, filled in here)."""
    lengths = prepared_lengths(cfg)
    rows = []
    for index, r in enumerate(results):
        try:
            r.cuda = stage_cuda_path(r.row.cfg, r.dims.cp, r.dims.tp, lengths)
        except Exception as e:  # shown, not fatal: the CPU-kernel measurement above stands on its own
            first = (str(e).strip().splitlines() or [""])[0]
            r.cuda = {"cuda_path": f"not measured: {type(e).__name__}: {first}"}
        rows.append((f"{index + 1} {r.row.name}", r.peak_gib, r.cuda))
    print(CUDA_PATH_STATEMENT)
    print(cuda_table(rows, usable_gib))


def cuda_json(numbers: dict, step_peak_gib: float) -> dict:
    """dry_run.json's CUDA-path fields of one stage."""
    out = {k: numbers[k] for k in ("attention_kernel_calls_per_layer", "aten_ops_per_layer",
                                   "host_syncs_per_micro_step", "count_row", "cuda_path") if k in numbers}
    if "attention_transient_gib_cuda" in numbers:
        out["peak_device_gib_per_rank_cuda_path"] = cuda_peak_gib(step_peak_gib, numbers)
        out["peak_device_gib_per_rank_cuda_path_gqa_expanded"] = cuda_peak_gib(step_peak_gib, numbers, True)
    return out
