"""Attention kernels on one GPU, side by side in one run: forward + backward time of one attention call on each kernel
family the CP layer can pick (parallelisms/cp/kernel_blocks.py: cudnn, flash = PyTorch's FlashAttention-2, fa3 / fa4
when installed), as a bare block call and as `ring_attention` at CP=1, and of `F.scaled_dot_product_attention`, at
each --seqs length, plain causal and packed documents.

    python bench/bench_attention_kernels.py [--seqs 8192,65536] [--reps 10] [--heads 16] [--kv-heads 8] [--head-dim 128]

Shapes: bf16, batch 1, q (1, heads, seq, head_dim), K/V with kv-heads (GQA), the model's (B, L, H, D) memory seen as
(B, H, L, D), as the trainer hands them over. Packed documents: the web-like mix (document lengths lognormal(6.5,
1.0) tokens, median ~665, the last one cut at the row's end; training/planning/cuda_path_probe.web_like_row), causal
inside each document; `packed call` rows are the CP 1 documents path (one packed-sequence call each way: flash
varlen, and cuDNN THD where nvidia-cudnn-frontend serves the GPU), with their TFLOP/s over the documents' pairs.
SDPA has no documents column (it would need a dense (S, S) mask); a bare block has none either
(documents are the ring's varlen calls). Each cell is the fastest of --reps, all calls interleaved rep by rep.
`ring at CP=1 / SDPA` lines (the GPU report's summary picks them up) compare the family "auto" picks with SDPA.
Without CUDA it runs the same code on the CPU (flash-CPU kernels only), for the tests.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import numpy as np  # noqa: E402

from parallelisms.context_parallel import ring_attention  # noqa: E402
from parallelisms.cp.kernel_cudnn_thd import thd_problem  # noqa: E402
from parallelisms.cp.packed_documents import PackedDocuments, packed_attention  # noqa: E402
from parallelisms.cp.flash_impls import flash_implementation  # noqa: E402
from parallelisms.cp.kernel_blocks import concrete_kernel, kernel_for, module_installed, runnable_kernels  # noqa: E402

DOCUMENT_MIX = "web-like: lognormal(6.5, 1.0) tokens per document (median ~665)"


def timed(call, device: torch.device) -> float:
    """Seconds of `call()` (a forward + backward), CUDA events on a GPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    call()
    return time.perf_counter() - begin


def _inputs(seq: int, args, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    make = lambda h: torch.randn(1, seq, h, args.head_dim, generator=gen, device=device,  # noqa: E731
                                 dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    q, k, v = make(args.heads), make(args.kv_heads), make(args.kv_heads)
    grad = torch.randn(q.shape, generator=gen, device=device, dtype=torch.bfloat16)
    return q, k, v, grad


def _document_ids(seq: int, device: torch.device) -> torch.Tensor:
    from training.planning.cuda_path_probe import web_like_row

    return torch.from_numpy(web_like_row(seq)).to(device)[None]


def _calls(seq: int, args, device: torch.device, families: list[str]) -> dict:
    """{(call name, masking): (family to activate or None, fn)} for one length."""
    q, k, v, grad = _inputs(seq, args, device)
    ids = _document_ids(seq, device)
    group = dist.group.WORLD

    def backward(out):
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    def block(family):
        kernel = kernel_for(device.type, q.dtype, q.size(-1), False, prefer=family)

        def run():
            with torch.no_grad():
                out, lse, aux = kernel.forward(q, k, v, is_causal=True, scale=None, mask=None)
                kernel.backward(grad, q, k, v, out, lse, aux, is_causal=True, scale=None, mask=None)
        return run

    calls = {("SDPA", "plain"): (None, lambda: backward(F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                         enable_gqa=True)))}
    for family in families:
        activate = family if family in ("fa3", "fa4") else None
        calls[(f"block, {family}", "plain")] = (activate, block(family))
        calls[(f"ring at CP=1, {family}", "plain")] = (activate, lambda f=family: backward(
            ring_attention(q, k, v, group, is_causal=True, kernel=f)))
        calls[(f"ring at CP=1, {family}", "documents")] = (activate, lambda f=family: backward(
            ring_attention(q, k, v, group, is_causal=True, kernel=f, load_balancer="contiguous", document_ids=ids)))
    docs = PackedDocuments.from_ids(ids.cpu().numpy()).to(device)
    for packed in packed_kernels(device):
        calls[(PACKED_ROWS[packed], "documents")] = (None, lambda p=packed: backward(packed_attention(
            q, k, v, docs, kernel="cudnn" if p == "cudnn_thd" else "flash", packed=p)))
    return calls


PACKED_ROWS = {"flash": "packed call, flash varlen", "cudnn_thd": "packed call, cuDNN THD"}
"""The CP 1 documents path (parallelisms/cp/packed_documents.py): one packed-sequence call each way per layer."""


def packed_kernels(device: torch.device) -> list[str]:
    """flash varlen everywhere (on CPU: the per-document calls), cuDNN THD where the frontend serves the GPU."""
    if device.type != "cuda":
        return ["flash"]
    return ["flash"] + (["cudnn_thd"] if thd_problem(device, module_installed) is None else [])


def document_pairs(seq: int) -> int:
    """Causal (query, key) pairs inside the web-like row's documents."""
    from training.planning.cuda_path_probe import web_like_row

    lengths = np.bincount(web_like_row(seq))
    return int((lengths * (lengths + 1) // 2).sum())


def packed_tflops(seconds: float, seq: int, args) -> float:
    """TFLOP/s of one packed call forward + backward: 4 x D flops per pair and query head forward, 2.5x that back."""
    return 3.5 * 4 * args.head_dim * args.heads * document_pairs(seq) / seconds / 1e12


def _run_family(activate: str | None, fn, device) -> float:
    with flash_implementation(activate or "flash"):
        return timed(fn, device)


def measure(args, device: torch.device) -> dict:
    """{(call, masking, seq): fastest seconds} over every available family and --seqs length."""
    families = runnable_kernels(device)
    best = {}
    for seq in args.seqs:
        calls = _calls(seq, args, device, families)
        for (name, masking), (activate, fn) in calls.items():  # warm-up: graphs, plans, allocator
            _run_family(activate, fn, device)
        for _ in range(args.reps):
            for (name, masking), (activate, fn) in calls.items():
                key = (name, masking, seq)
                best[key] = min(best.get(key, float("inf")), _run_family(activate, fn, device))
        del calls
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return best


def _length(seq: int) -> str:
    return f"{seq // 1024}K" if seq % 1024 == 0 else str(seq)


def report(best: dict, args, device: torch.device) -> list[str]:
    """The table (ms, one column per length and masking) and the ring / SDPA lines of the family 'auto' picks."""
    capability = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    auto = concrete_kernel("auto", device.type, capability)
    columns = [(seq, masking) for seq in args.seqs for masking in ("plain", "documents")]
    names = list(dict.fromkeys(name for name, _, _ in best))
    head = ["fwd+bwd ms", *[f"{_length(seq)} {masking}" for seq, masking in columns]]
    rows = [head] + [[name, *[f"{best[(name, m, s)] * 1e3:.2f}" if (name, m, s) in best else "-"
                             for s, m in columns]] for name in names]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"attention kernels, bf16 causal, q (1, {args.heads}, seq, {args.head_dim}), {args.kv_heads} K/V heads; "
             f"documents: {DOCUMENT_MIX}; fastest of {args.reps}; auto = {auto}"]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    for seq in args.seqs:
        ring, sdpa = best[(f"ring at CP=1, {auto}", "plain", seq)], best[("SDPA", "plain", seq)]
        docs = best[(f"ring at CP=1, {auto}", "documents", seq)]
        lines.append(f"ring at CP=1 / SDPA, causal fwd+bwd, bf16, seq {seq}, kernel {auto}: {ring * 1e3:.2f} ms / "
                     f"{sdpa * 1e3:.2f} ms = {ring / sdpa:.3f}; packed documents / plain at CP=1: {docs / ring:.3f}")
        timed = {packed: best.get((row, "documents", seq)) for packed, row in PACKED_ROWS.items()}
        rates = {packed: packed_tflops(seconds, seq, args) for packed, seconds in timed.items() if seconds}
        text = ", ".join(f"{PACKED_ROWS[p].split(', ')[1]} {r:.0f} TFLOP/s" for p, r in rates.items())
        ratio = (f"; cuDNN THD / flash varlen {rates['cudnn_thd'] / rates['flash']:.2f}x" if len(rates) == 2
                 else "")
        lines.append(f"packed documents per call, fwd+bwd, seq {seq} ({document_pairs(seq):,} pairs): {text}{ratio}; "
                     f"one packed call / plain SDPA: {best[(PACKED_ROWS['flash'], 'documents', seq)] / sdpa:.3f}")
    return lines


def run(args, device: torch.device) -> list[str]:
    """Measures and reports on a one-rank process group (NCCL on a GPU, gloo on CPU), which it makes and ends."""
    from tests.distributed import free_port

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", world_size=1, rank=0,
                            init_method=f"tcp://127.0.0.1:{free_port()}",
                            device_id=device if device.type == "cuda" else None)
    try:
        return report(measure(args, device), args, device)
    finally:
        dist.destroy_process_group()


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="8192,65536", help="comma-separated lengths (multiples of 2)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    args.seqs = [int(s) for s in str(args.seqs).split(",")]
    return args


def main() -> int:
    args = parse()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (no CUDA device)"
    print(f"{where}, torch {torch.__version__}; command: "
          f"{' '.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])}", flush=True)
    print("\n".join(run(args, device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
