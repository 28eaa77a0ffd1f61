"""Measures, on this GPU, each class of work the step model prices (training/planning/step_model.py) and writes the
accelerator's rates file (training/planning/rates/<accelerator>.json, read by training/planning/rates.py):

- gemm: bf16 FLOP/s of one Llama block's linear layers at --tokens tokens (forward, input-gradient and
  weight-gradient GEMMs of the q/k/v/o and w1/w3/w2 shapes);
- attention: FLOP/s of one causal call per kernel family this GPU can run (cudnn, flash, fa3/fa4 when installed),
  forward and backward timed apart, at each --lengths block length (the step model's FLOP count: forward 4 x visible
  pairs x heads x head dim, backward 2.5x);
- hbm: bytes/s of a 1 GiB device-to-device copy (read + write);
- optimizer: bytes/s of fused AdamW over --optimizer-params float32 parameters, counted as the step model counts them
  (32 bytes per parameter: read p, g, m, v, write p, m, v).

    python bench/bench_rates.py --accelerator h100-sxm [--dim 4096 --ffn 14336 --heads 32 --kv-heads 8
        --head-dim 128 --tokens 8192 --lengths 8192,65536 --reps 10] [--out DIR] [--device cpu]

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
from parallelisms.cp.kernel_blocks import activate_flash_implementation, kernel_for, runnable_kernels  # noqa: E402
from training.planning.rates import RATES_DIR, rates_path  # noqa: E402


def fastest(call, device: torch.device, reps: int) -> float:
    """Seconds of the fastest of `reps` calls after one warm-up (bench_attention_kernels.timed: CUDA events)."""
    call()
    return min(timed(call, device) for _ in range(reps))


def gemm_rate(args, device) -> dict:
    d, t, hd = args.dim, args.tokens, args.head_dim
    outs = (args.heads * hd, args.kv_heads * hd, args.kv_heads * hd, d, args.ffn, args.ffn)  # q k v o w1 w3
    shapes = [(t, d, n) for n in outs] + [(t, args.ffn, d)]  # + w2: (tokens x ffn) @ (ffn x dim)
    flops = seconds = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        for left, right in ((a, w), (g, w.t()), (a.t(), g)):  # forward, input gradient, weight gradient
            seconds += fastest(lambda: left @ right, device, args.reps)
            flops += 2.0 * m * k * n
    return {"value": flops / seconds, "unit": "FLOP/s", "shape": f"one block's GEMMs at {t} tokens, dim {d}, "
            f"ffn {args.ffn}, {args.heads}/{args.kv_heads} heads of {hd}, bf16"}


def attention_rates(args, device) -> list[dict]:
    from torch.nn import attention

    rows = []
    for length in args.lengths:
        make = lambda h: torch.randn(1, length, h, args.head_dim, device=device,  # noqa: E731
                                     dtype=torch.bfloat16).transpose(1, 2)
        q, k, v, grad = make(args.heads), make(args.kv_heads), make(args.kv_heads), make(args.heads)
        forward_flops = 4.0 * length * (length + 1) / 2 * args.heads * args.head_dim
        for family in runnable_kernels(device):
            activate_flash_implementation(family)
            try:
                block = kernel_for(device.type, q.dtype, args.head_dim, False, prefer=family)
                out, lse, aux = block.forward(q, k, v, is_causal=True, scale=None, mask=None)
                fwd = fastest(lambda: block.forward(q, k, v, is_causal=True, scale=None, mask=None), device, args.reps)
                bwd = fastest(lambda: block.backward(grad, q, k, v, out, lse, aux, is_causal=True, scale=None,
                                                     mask=None), device, args.reps)
            finally:
                if family in ("fa3", "fa4"):
                    attention.restore_flash_attention_impl(_raise_warn=False)
            for phase, seconds, flops in (("fwd", fwd, forward_flops), ("bwd", bwd, 2.5 * forward_flops)):
                rows.append({"kernel": family, "phase": phase, "causal": True, "length": length,
                             "head_dim": args.head_dim, "q_heads": args.heads, "kv_heads": args.kv_heads,
                             "seconds": seconds, "flops_per_s": flops / seconds})
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


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--accelerator", required=True, help="the name the recipes use (hardware.accelerator)")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--lengths", default="8192,65536")
    p.add_argument("--copy-bytes", type=int, default=1 << 30)
    p.add_argument("--optimizer-params", type=int, default=1 << 28)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=RATES_DIR)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
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
    for component, measure in (("gemm", gemm_rate), ("hbm", hbm_rate), ("optimizer", optimizer_rate)):
        rates[component] = measure(args, device)
        print(f"{component}: {rates[component]['value']:.4g} {rates[component]['unit']} ({rates[component]['shape']})",
              flush=True)
    rates["attention"] = attention_rates(args, device)
    for row in rates["attention"]:
        print(f"attention {row['kernel']} {row['phase']} at {row['length']}: {row['seconds'] * 1e3:.3f} ms, "
              f"{row['flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = rates_path(args.accelerator, args.out)
    with open(path, "w") as f:
        json.dump(rates, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
