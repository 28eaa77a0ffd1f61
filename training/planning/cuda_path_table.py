"""The dry run's CUDA-path numbers, one row per stage: kernel calls, aten ops and host syncs of one layer's attention
on fake CUDA tensors (cuda_path_probe.py), and the step's peak with the CUDA attention's transients, GQA unexpanded vs
the earlier expanded path, on the documents the step-time prediction prices (workload.document_lengths)."""
from __future__ import annotations

import numpy as np
import torch

from models.llama import recipe_model_config
from parallelisms.cp.block_spec import BlockSpec
from parallelisms.cp.exchange_ring import ring_backward, ring_forward
from parallelisms.cp.layouts import DOCUMENTS
from training.planning.accelerators import kernel_on
from training.planning.cuda_path_probe import LayerCounts, layer_counts, packed_row, ring_counts, ulysses_counts
from training.planning.fake.cuda import load_fake_cuda_guard
from training.planning.workload import document_lengths, mix_lengths


def row_from_lengths(lengths: np.ndarray, seq_len: int, seed: int = 0) -> np.ndarray:
    """(S,) ids of documents drawn from `lengths` packed into one row (the last one cut at the row's end)."""
    rng = np.random.default_rng(seed)
    return packed_row(lambda: rng.choice(lengths, 256).tolist(), seq_len)


def _stage_shape(cfg, cp: int, tp: int, gathered: bool) -> tuple:
    m = recipe_model_config(cfg)
    heads, kv = m.n_heads // tp, max(1, m.num_kv_heads // tp)
    if gathered:  # Ulysses: the whole sequence, heads split over the group (K/V replicated up to whole groups)
        return (1, cfg.training.seq_len, max(1, heads // cp), max(1, kv // cp), m.head_dim)
    return (1, cfg.training.seq_len // cp, heads, kv, m.head_dim)


def _one_document_layer(cfg, cp: int, tp: int, device: str, dtype, expand_gqa: bool = False,
                        kernel: str = "flash") -> LayerCounts:
    """One layer's attention (forward + backward) on the row the dry run's step measures (one document, the recipe's
    fixed layout, zigzag for the documents layout): the dense ring on fake `device` tensors, counted, with its
    transient peak (inputs excluded)."""
    p = cfg.parallelism
    layout = "zigzag" if p.cp_load_balancer == DOCUMENTS else p.cp_load_balancer
    return layer_counts(_stage_shape(cfg, cp, tp, gathered=False), dtype, device, cp, 0,
                        lambda group: BlockSpec(group if cp > 1 else None, True, None, layout, None, None,
                                                p.attention_head_groups, kernel),
                        (ring_forward, ring_backward), expand_gqa=expand_gqa)


def stage_cuda_path(cfg, cp: int, tp: int, lengths: np.ndarray | None) -> dict:
    """The dry run's CUDA-path numbers of one stage: counts on a documents row (the recipe's documents, else the
    stated mix) and one layer's attention transients on the step's own row, CPU kernels vs CUDA with GQA unexpanded
    and expanded."""
    why = load_fake_cuda_guard()
    if why:
        return {"cuda_path": f"not measured: {why}"}
    p = cfg.parallelism
    dtype = torch.bfloat16 if cfg.training.dtype == "bfloat16" else torch.float32
    documents = cfg.data.document_masking and p.cp_load_balancer == DOCUMENTS and cp > 1
    kernel = kernel_on(cfg.hardware.accelerator, p.attention_kernel)
    cpu = _one_document_layer(cfg, cp, tp, "cpu", dtype).transient_peak_bytes
    counts, counts_expanded = (_one_document_layer(cfg, cp, tp, "cuda", dtype, e, kernel) for e in (False, True))
    unexpanded, expanded = counts.transient_peak_bytes, counts_expanded.transient_peak_bytes
    if documents:  # the documents row: counted, and its varlen transients measured both ways
        if lengths is not None:
            ids = row_from_lengths(lengths, cfg.training.seq_len)
        else:  # one row holding each share of the stated mix in turn
            mix = mix_lengths(cfg.training.seq_len, rows=1)
            ids = np.repeat(np.arange(mix.size), mix)
        gathered = p.cp_impl in ("ulysses", "hybrid")
        run, shape = ulysses_counts if gathered else ring_counts, _stage_shape(cfg, cp, tp, gathered)
        counts, counts_expanded = (run(ids, cp, shape, dtype=dtype, memory=True, expand_gqa=e,
                                       head_groups=p.attention_head_groups, kernel=kernel) for e in (False, True))
        unexpanded = max(unexpanded, counts.transient_peak_bytes)
        expanded = max(expanded, counts_expanded.transient_peak_bytes)
    return {"attention_kernel": kernel, "attention_calls_by_kernel": counts.calls_by_kernel,
            "attention_kernel_calls_per_layer": counts.attention_kernel_calls_per_layer,
            "aten_ops_per_layer": counts.aten_ops_per_layer,
            "host_syncs_per_micro_step": counts.host_syncs_per_micro_step,
            "count_row": ("recipe's documents" if lengths is not None else "stated mix") if documents
            else "one document",
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
    head = ("stage", "kernel", "attn calls/layer", "aten ops/layer", "host syncs/micro-step", "count row",
            "peak GiB CUDA (GQA unexpanded)", "peak GiB CUDA (GQA expanded, earlier path)", "fits")
    lines = [head]
    for name, peak, n in rows:
        if "attention_transient_gib_cuda" not in n:
            lines.append((name, n.get("cuda_path", "?"), "", "", "", "", "", "", ""))
            continue
        new, old = cuda_peak_gib(peak, n), cuda_peak_gib(peak, n, expanded=True)
        calls = ", ".join(f"{kind} {count}" for kind, count in sorted(n["attention_calls_by_kernel"].items()))
        lines.append((name, n["attention_kernel"], f"{n['attention_kernel_calls_per_layer']} ({calls})",
                      str(n["aten_ops_per_layer"]),
                      str(n["host_syncs_per_micro_step"]), n["count_row"], f"{new:.2f}", f"{old:.2f}",
                      "yes" if new <= usable_gib else "NO"))
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines)


CUDA_PATH_STATEMENT = (
    "  CUDA path, on fake CUDA tensors (training/planning/cuda_path_table.py): kernel = the CP attention's kernel "
    "family on hardware.accelerator (parallelism.attention_kernel; auto = cudnn on H100/H200, flash = "
    "FlashAttention-2 on A100; packed documents always take the flash ops' varlen calls); attn calls (by kernel) / "
    "aten ops = one layer's attention forward + backward on the busiest CP rank; host syncs = device-to-host reads "
    "in the attention path per micro-step; the peak is the step's measured peak plus what one layer's CUDA "
    "attention (varlen gathers, flash backward scratch, GQA dK/dV expanded inside the kernel) holds beyond the CPU "
    "kernels' (an upper bound); "
    "'earlier path' expands K/V for GQA before every flash call")


def print_cuda_path(cfg, results, usable_gib: float) -> None:
    """The dry run's CUDA-path table (one row per stage; `results` are dry_run.RowResult, filled in here)."""
    stores = document_lengths(cfg)  # the documents the prediction prices (training/planning/workload.py)
    lengths = np.concatenate(list(stores.values())) if stores else None
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
    """dry_run.json's CUDA-path fields of one stage, and `predicted_peak_gib_per_rank`: the one peak a GPU run's
    measured peak is compared with (bench_gpu, bench_predictions, the GPU report), the CUDA path's where it was
    measured (its attention's transients), else the CPU kernels' step peak."""
    out = {k: numbers[k] for k in ("attention_kernel", "attention_calls_by_kernel",
                                   "attention_kernel_calls_per_layer", "aten_ops_per_layer",
                                   "host_syncs_per_micro_step", "count_row", "cuda_path") if k in numbers}
    if "attention_transient_gib_cuda" in numbers:
        out["peak_device_gib_per_rank_cuda_path"] = cuda_peak_gib(step_peak_gib, numbers)
        out["peak_device_gib_per_rank_cuda_path_gqa_expanded"] = cuda_peak_gib(step_peak_gib, numbers, True)
    return out | {"predicted_peak_gib_per_rank": out.get("peak_device_gib_per_rank_cuda_path", step_peak_gib)}
