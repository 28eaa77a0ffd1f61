"""Activation checkpointing on the debug model at a long sequence: peak memory of one forward+backward per mode,
and how many attention kernels each mode runs (op-selective must recompute none).

Each mode runs in a fresh process (the CPU peak is the process's peak resident set, with malloc set to return large
blocks at once), from the same seed and batch; "peak step MiB" is that peak minus the resident set just before the
step (the model's weights).

    python bench/bench_activation_checkpoint.py [--seq-len 4096] [--modes none,op,full]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(mode: str, seq_len: int, batch: int, every: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, ROOT)
    from models.llama import Llama, model_config
    from parallelisms.activation_checkpoint import ATTENTION_OPS, apply_activation_checkpointing

    class AttentionKernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in ATTENTION_OPS
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    cfg = model_config("debug")
    model = Llama(cfg)
    apply_activation_checkpointing(model, mode, every)
    model.init_weights(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    before = _resident_mib()
    kernels = AttentionKernels()
    start = time.perf_counter()
    with kernels:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "peak_step_mib": peak - before, "attention_kernels": kernels.count,
            "recomputed_attention": kernels.count - cfg.n_layers, "seconds": seconds, "loss": loss.item(),
            "grad_norm": torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters())).item()}


def run_mode(mode: str, seq_len: int, batch: int, every: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--seq-len", str(seq_len),
           "--batch", str(batch), "--every", str(every)]
    # Large blocks straight from mmap and one arena: freed tensors leave the resident set at once, so its peak is
    # the peak of live tensors rather than of malloc's caching.
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--every", type=int, default=2, help="selective mode: checkpoint every k-th block")
    parser.add_argument("--modes", default="none,selective,op,full")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.seq_len, args.batch, args.every)))
        return
    rows = [run_mode(m, args.seq_len, args.batch, args.every) for m in args.modes.split(",")]
    print(f"debug model (6 layers), fp32, batch {args.batch} x seq {args.seq_len}, one forward+backward per process")
    print(f"{'mode':<10} {'peak step MiB':>14} {'attention kernels':>18} {'recomputed':>11} {'step s':>7} "
          f"{'loss':>9} {'grad norm':>10}")
    for r in rows:
        print(f"{r['mode']:<10} {r['peak_step_mib']:>14.0f} {r['attention_kernels']:>18} "
              f"{r['recomputed_attention']:>11} {r['seconds']:>7.2f} {r['loss']:>9.5f} {r['grad_norm']:>10.6f}")
    by_mode = {r["mode"]: r for r in rows}
    if {"none", "op", "full"} <= set(by_mode):
        mem = [by_mode[m]["peak_step_mib"] for m in ("none", "op", "full")]
        print(f"peak memory none > op > full: {mem[0] > mem[1] > mem[2]} "
              f"(op / none = {mem[1] / mem[0]:.2f}, full / none = {mem[2] / mem[0]:.2f}); "
              f"op recomputes {by_mode['op']['recomputed_attention']} attention calls")


if __name__ == "__main__":
    main()
