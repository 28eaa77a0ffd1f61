"""Measures, on this GPU, each class of work the step model prices (training/planning/price.py) and writes the
accelerator's rates file (training/planning/rates/<accelerator>.json, read by training/planning/rates.py):

- gemm: bf16 FLOP/s of one Llama block's linear layers at --tokens tokens (forward, input-gradient and
  weight-gradient GEMMs of the q/k/v/o and w1/w3/w2 shapes), one row per --gemm-shapes model shape (dim x ffn: the
  bench shape's 2048 x 5632, and dim 4096 at the debug formula's and Llama 3 8B's ffn);
- fp8_gemm: the same GEMMs through torch._scaled_mm in float8 e4m3 with tensorwise scales (training.float8), where
  the device runs them (compute capability 8.9+);
- attention: FLOP/s of one causal call per kernel family this GPU can run (cudnn, flash, fa3/fa4 when installed),
  forward and backward timed apart, at each --lengths block length (the step model's FLOP count: forward 4 x visible
  pairs x heads x head dim, backward 2.5x);
- packed_attention: seconds of one packed-sequence call forward + backward (the CP 1 documents path,
  parallelisms/cp/packed_documents.py) per documents kernel this GPU runs (cuDNN THD where the frontend serves it,
  FlashAttention-2 varlen; the per-document calls on CPU), over web-like documents filling each --packed-lengths
  total (training/planning/documents_cost.py turns them into each kernel's overhead over its per-piece price);
- hbm: bytes/s of a 1 GiB device-to-device copy (read + write);
- optimizer: bytes/s of fused AdamW over --optimizer-params float32 parameters, counted as the step model counts them
  (32 bytes per parameter: read p, g, m, v, write p, m, v);
- with --host, what training.cpu_offload runs off the GPU (training/planning/offload_cost.py): the host's fused CPU
  AdamW (host_optimizer) and pinned host/device copies (host_copy, CUDA only).

    python bench/bench_rates.py --accelerator h100-sxm [--gemm-shapes 2048x5632,4096x11008,4096x14336
        --heads 16 --kv-heads 8 --head-dim 128 --tokens 8192 --lengths 8192,32768,65536 --reps 10] [--out DIR]
        [--device cpu] [--host]

Each rate is the fastest of --reps, and is written with its shape. `--device cpu` runs the same code on the CPU
(small shapes; for the tests): the file then names the CPU and is not one to ship.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.bench_attention_kernels import timed  # noqa: E402
from parallelisms.cp.flash_impls import flash_implementation  # noqa: E402
from parallelisms.cp.kernel_blocks import kernel_for, runnable_kernels  # noqa: E402
from training.planning.rates import RATES_DIR, rates_path  # noqa: E402


def fastest(call, device: torch.device, reps: int) -> float:
    """Seconds of the fastest of `reps` calls after one warm-up (bench_attention_kernels.timed: CUDA events)."""
    call()
    return min(timed(call, device) for _ in range(reps))


def _block_gemms(tokens: int, dim: int, ffn: int, q_out: int, kv_out: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of each GEMM one Llama block runs per step: forward, input gradient and weight gradient of q, k, v,
    o, w1, w3 (tokens x dim @ dim x out) and w2 (tokens x ffn @ ffn x dim)."""
    mkn = [(tokens, dim, n) for n in (q_out, kv_out, kv_out, dim, ffn, ffn)] + [(tokens, ffn, dim)]
    return [shape for m, k, n in mkn for shape in ((m, k, n), (m, n, k), (k, m, n))]


def _bf16_mm(m, k, n, device):
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    return lambda: a @ b


def _fp8_mm(m, k, n, device):
    """torch._scaled_mm as torchao's tensorwise float8 GEMM calls it: e4m3 operands, the right one column-major, one
    float32 scale each, bf16 out."""
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def gemm_rates(args, device, make=_bf16_mm, kind="bf16") -> list[dict]:
    """One row per --gemm-shapes model shape: FLOP/s over one block's GEMMs at --tokens tokens."""
    rows = []
    for dim, ffn in args.gemm_shapes:
        q_out, kv_out = dim, args.kv_heads * args.head_dim  # Llama: query heads x head dim = dim
        flops = seconds = 0.0
        for m, k, n in _block_gemms(args.tokens, dim, ffn, q_out, kv_out):
            seconds += fastest(make(m, k, n, device), device, args.reps)
            flops += 2.0 * m * k * n
        rows.append({"dim": dim, "ffn": ffn, "tokens": args.tokens, "value": flops / seconds, "unit": "FLOP/s",
                     "shape": f"one block's GEMMs at {args.tokens} tokens, dim {dim}, ffn {ffn}, "
                              f"{args.kv_heads} K/V heads of {args.head_dim}, {kind}"})
    return rows


def attention_rates(args, device) -> list[dict]:
    rows = []
    for length in args.lengths:
        make = lambda h: torch.randn(1, length, h, args.head_dim, device=device,  # noqa: E731
                                     dtype=torch.bfloat16).transpose(1, 2)
        q, k, v, grad = make(args.heads), make(args.kv_heads), make(args.kv_heads), make(args.heads)
        forward_flops = 4.0 * length * (length + 1) / 2 * args.heads * args.head_dim
        for family in runnable_kernels(device):
            with flash_implementation(family):
                block = kernel_for(device.type, q.dtype, args.head_dim, False, prefer=family)
                out, lse, aux = block.forward(q, k, v, is_causal=True, scale=None, mask=None)
                fwd = fastest(lambda: block.forward(q, k, v, is_causal=True, scale=None, mask=None), device, args.reps)
                bwd = fastest(lambda: block.backward(grad, q, k, v, out, lse, aux, is_causal=True, scale=None,
                                                     mask=None), device, args.reps)
            for phase, seconds, flops in (("fwd", fwd, forward_flops), ("bwd", bwd, 2.5 * forward_flops)):
                rows.append({"kernel": family, "phase": phase, "causal": True, "length": length,
                             "head_dim": args.head_dim, "q_heads": args.heads, "kv_heads": args.kv_heads,
                             "seconds": seconds, "flops_per_s": flops / seconds})
    return rows


def packed_attention_rates(args, device) -> list[dict]:
    """One row per documents kernel and --packed-lengths total: the fastest packed call forward + backward."""
    from bench.bench_attention_kernels import PACKED_ROWS, _document_ids, _inputs, packed_kernels
    from parallelisms.cp.kernel_cudnn_thd import documents_kernel_name
    from parallelisms.cp.packed_documents import PackedDocuments, packed_attention

    rows = []
    for tokens in args.packed_lengths:
        q, k, v, grad = _inputs(tokens, args, device)
        docs = PackedDocuments.from_ids(_document_ids(tokens, device).cpu().numpy()).to(device)
        for packed in packed_kernels(device):
            def call(p=packed):
                packed_attention(q, k, v, docs, kernel="cudnn" if p == "cudnn_thd" else "flash",
                                 packed=p).backward(grad)
                q.grad = k.grad = v.grad = None
            name = "cudnn_thd" if packed == "cudnn_thd" else documents_kernel_name("flash", device, q.dtype,
                                                                                    args.head_dim)
            rows.append({"kernel": name, "tokens": tokens, "seconds": fastest(call, device, args.reps),
                         "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                         "documents": "web-like (training/planning/cuda_path_probe.web_like_row)",
                         "call": PACKED_ROWS[packed]})
    return rows


def hbm_rate(args, device) -> dict:
    n = args.copy_bytes // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    seconds = fastest(lambda: dst.copy_(src), device, args.reps)
    return {"value": 2.0 * n * 4 / seconds, "unit": "bytes/s", "shape": f"copy of {n * 4 / 2**30:.2f} GiB, read + write"}


def optimizer_rate(args, device) -> dict:
    n = args.optimizer_params
    params = [torch.nn.Parameter(torch.randn(n, device=device))]
    params[0].grad = torch.randn(n, device=device)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    with torch.no_grad():
        seconds = fastest(opt.step, device, args.reps)
    return {"value": 32.0 * n / seconds, "unit": "bytes/s",
            "shape": f"fused AdamW over {n:,} float32 parameters, 32 bytes each"}


def host_rates(args, device) -> dict:
    """--host: what training.cpu_offload runs off the GPU. host_optimizer: fused CPU AdamW over
    --host-optimizer-params float32 parameters with every core of this process (28 bytes each: read p, g, m, v, write
    p, m, v), the node's host rate its ranks share; host_copy (CUDA): pinned host -> device and device -> host copies
    of --copy-bytes, the slower direction."""
    n = args.host_optimizer_params
    params = [torch.nn.Parameter(torch.randn(n))]
    params[0].grad = torch.randn(n)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    with torch.no_grad():
        seconds = fastest(opt.step, torch.device("cpu"), args.reps)
    out = {"host_optimizer": {"value": 28.0 * n / seconds, "unit": "bytes/s",
                              "shape": f"fused CPU AdamW over {n:,} float32 parameters, {torch.get_num_threads()} "
                                       f"threads, 28 bytes each"}}
    if device.type == "cuda":
        host = torch.empty(args.copy_bytes // 4).pin_memory()
        gpu = torch.empty(args.copy_bytes // 4, device=device)
        down = fastest(lambda: gpu.copy_(host, non_blocking=True), device, args.reps)
        up = fastest(lambda: host.copy_(gpu, non_blocking=True), device, args.reps)
        out["host_copy"] = {"value": host.nbytes / max(down, up), "unit": "bytes/s",
                            "shape": f"pinned copies of {host.nbytes / 2**30:.2f} GiB, the slower direction "
                                     f"(H2D {host.nbytes / down / 1e9:.1f}, D2H {host.nbytes / up / 1e9:.1f} GB/s)"}
    return out


def float8_gemm_problem(device) -> str | None:
    """Why float8 GEMMs are not timed here (CUDA needs compute capability 8.9+), or None."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return f"compute capability {torch.cuda.get_device_capability(device)} < (8, 9)"
    try:
        _fp8_mm(16, 16, 16, device)()
    except Exception as e:  # noqa: BLE001 - a build without float8 GEMMs on this device
        return f"torch._scaled_mm fails here: {type(e).__name__}: {str(e)[:120]}"
    return None


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--accelerator", required=True, help="the name the recipes use (hardware.accelerator)")
    p.add_argument("--gemm-shapes", default="2048x5632,4096x11008,4096x14336",
                   help="model shapes (dim x ffn) whose block GEMMs are timed, bf16 and float8")
    p.add_argument("--heads", type=int, default=16, help="query heads of the attention calls")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--lengths", default="8192,32768,65536")
    p.add_argument("--packed-lengths", default="8192,65536",
                   help="tokens of the packed-documents calls (web-like documents)")
    p.add_argument("--copy-bytes", type=int, default=1 << 30)
    p.add_argument("--optimizer-params", type=int, default=1 << 28)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--host", action="store_true", help="also the host's AdamW and pinned copies (cpu_offload)")
    p.add_argument("--host-optimizer-params", type=int, default=1 << 27)
    p.add_argument("--out", default=RATES_DIR)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.packed_lengths = [int(x) for x in args.packed_lengths.split(",")]
    args.gemm_shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.gemm_shapes.split(",")]
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench_rates: no CUDA device visible to torch {torch.__version__}; nothing measured (--device cpu runs "
              f"the same code on the CPU, for tests)")
        return 0
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rates = {"accelerator": args.accelerator, "device_name": name, "torch": torch.__version__,
             "cuda": torch.version.cuda or "", "date": datetime.date.today().isoformat(),
             "command": " ".join(["bench/bench_rates.py", *(argv if argv is not None else sys.argv[1:])])}
    rates["gemm"] = gemm_rates(args, device)
    for row in rates["gemm"]:
        print(f"gemm: {row['value'] / 1e12:.1f} TFLOP/s ({row['shape']})", flush=True)
    if fp8_problem := float8_gemm_problem(device):
        print(f"fp8_gemm: not measured ({fp8_problem})", flush=True)
    else:
        rates["fp8_gemm"] = gemm_rates(args, device, _fp8_mm, "float8 e4m3, tensorwise scales")
        for row in rates["fp8_gemm"]:
            print(f"fp8_gemm: {row['value'] / 1e12:.1f} TFLOP/s ({row['shape']})", flush=True)
    for component, measure in (("hbm", hbm_rate), ("optimizer", optimizer_rate)):
        rates[component] = measure(args, device)
        print(f"{component}: {rates[component]['value']:.4g} {rates[component]['unit']} ({rates[component]['shape']})",
              flush=True)
    if args.host:
        for component, row in host_rates(args, device).items():
            rates[component] = row
            print(f"{component}: {row['value']:.4g} {row['unit']} ({row['shape']})", flush=True)
    rates["attention"] = attention_rates(args, device)
    for row in rates["attention"]:
        print(f"attention {row['kernel']} {row['phase']} at {row['length']}: {row['seconds'] * 1e3:.3f} ms, "
              f"{row['flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    rates["packed_attention"] = packed_attention_rates(args, device)
    for row in rates["packed_attention"]:
        print(f"packed_attention {row['kernel']} at {row['tokens']}: {row['seconds'] * 1e3:.3f} ms fwd+bwd",
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = rates_path(args.accelerator, args.out)
    with open(path, "w") as f:
        json.dump(rates, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
