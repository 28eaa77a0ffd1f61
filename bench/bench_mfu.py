"""Trainer throughput and MFU vs a minimal single-file eager PyTorch training loop of the same model, in one run.

    .venv/bin/python bench/bench_mfu.py [--steps 8] [--rounds 2] [--only NAME] [--profile]

Shapes: the CPU-sized Llama (dim 512, 8 heads of 64, 4 layers, vocab 2048, seq 4096, batch 1) in fp32 and bf16,
and the debug model (dim 256, 16 heads, 6 layers) at seq 512, batch 8, fp32. Every run is a fresh process with 2 threads
(1 process on the 2 cores); runs alternate minimal / trainer / trainer / minimal ... so load from other processes
hits both alike; the best median tok/s of each side is kept. MFU = flops_per_token (models/llama.py: causal
attention counted as half) x tok/s / the GEMM peak measured here in the same dtype (2 threads, 2048^3 matmuls).

The minimal loop (`MinimalLlama` below, written for this benchmark only) is what a user would write in one file:
Llama blocks with RoPE, SDPA (causal), SwiGLU, RMSNorm computed in float32; AdamW (foreach), grad clipping at 1.0,
loss.item() every step; in bf16 the parameters are bf16 (no master copy). The trainer runs train.py under torchrun
(NPROC=1), real data loader, metrics and all; in bf16 it keeps fp32 master weights through FSDP2 mixed precision
(1 rank).
The trainer is also run in-process (train.Trainer.train_step, same code as train.py's loop) to measure its CPU time,
the load-independent column. --profile prints the top operators (torch.profiler) of 3 steps of each; it is how the
one gap found so far was traced: a redundant torch.set_num_threads(2) in pick_device made every later CPU flash
attention backward ~18% slower (35.8 -> 42.4 ms per call on the debug shape); pick_device now skips the call when
the count is already right.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness.launch_env import child_env  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from bench.bench_cp_variants import OtherLoad  # noqa: E402
from training.metrics import read_metrics  # noqa: E402

SHAPES = {  # name: (model overrides on the debug config, seq, batch, dtype)
    "cpu512_fp32": ({"dim": 512, "n_heads": 8, "n_layers": 4}, 4096, 1, "float32"),
    "cpu512_bf16": ({"dim": 512, "n_heads": 8, "n_layers": 4}, 4096, 1, "bfloat16"),
    "debug_seq512_fp32": ({}, 512, 8, "float32"),
}
SKIP = 2  # warm-up steps dropped
PROFILED_STEPS = 3


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class MinimalBlock(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.attn_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, s, self.heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rotate(x, cos, sin):
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


class MinimalLlama(nn.Module):
    def __init__(self, vocab, dim, heads, layers, hidden, theta=500000.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MinimalBlock(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, dim // heads, 2).float() / (dim // heads))

    def forward(self, tokens):
        angles = torch.arange(tokens.size(1)).float()[:, None] * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.out(self.norm(x))


def _model_config(name):
    from models.llama import model_config
    return model_config("debug", **SHAPES[name][0])


def _measure(step, steps, profile_title=None) -> dict:
    """Median tokens/s of the steps after warm-up, by wall time and by this process's CPU time (all threads)."""
    wall, cpu = [], []
    for i in range(steps):
        w, c = time.perf_counter(), time.process_time()
        if profile_title and i == SKIP:
            _profiled(step, profile_title)
        else:
            step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return {"wall": statistics.median(wall[SKIP:]), "cpu": statistics.median(cpu[SKIP:])}


def minimal_worker(name, steps, profile):
    overrides, seq, batch, dtype_name = SHAPES[name]
    cfg, dtype = _model_config(name), getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = MinimalLlama(cfg.vocab_size, cfg.dim, cfg.n_heads, cfg.n_layers, cfg.ffn_hidden_dim).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step():
        row = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
        logits = model(row[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), row[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    result = _measure(step, steps, f"minimal loop, {name}" if profile else None)
    print(json.dumps({k: batch * seq / v for k, v in result.items()}))


def _profiled(fn, title, steps=PROFILED_STEPS):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    print(f"\n### profile: {title} ({steps} steps, top operators by self CPU time)", file=sys.stderr)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60),
          file=sys.stderr)


def _trainer_args(name, steps, out):
    overrides, seq, batch, dtype = SHAPES[name]
    args = [os.path.join(ROOT, "recipes/debug.toml"), "--training.steps", str(steps), "--training.seq_len", str(seq),
            "--training.local_batch_size", str(batch), "--training.dtype", dtype, "--parallelism.dp_shard", "1",
            "--job.dump_folder", out, "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1"]
    for key, value in overrides.items():
        args += [f"--model.{key}", str(value)]
    return args


def trainer_worker(name, steps, profile):
    """One process, no torchrun: train.Trainer's own train_step (data fetch included), timed like the minimal loop."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    from train import Trainer
    from config.recipe import load_config
    _, seq, batch, _ = SHAPES[name]
    with tempfile.TemporaryDirectory() as out:
        args = _trainer_args(name, steps, out)
        trainer = Trainer(load_config(args[0], args[1:]))
        data = iter(trainer.dataloader)
        result = _measure(lambda: trainer.train_step([next(data)]), steps,
                          f"trainer train_step, {name}" if profile else None)
        trainer.close()
    print(json.dumps({k: batch * seq / v for k, v in result.items()}))


def _free_port():
    from tests.distributed import free_port
    return free_port()


def _env():
    env = child_env()
    env.pop("OMP_NUM_THREADS", None)  # both sides take the 2 cores (the trainer's pick_device does the same)
    return env


def run_worker(kind, name, steps, profile=False):
    """{"wall": tok/s, "cpu": tok/s by CPU time} from a fresh 2-thread process (profile tables go to stderr)."""
    cmd = [sys.executable, __file__, "--worker", kind, "--only", name, "--steps", str(steps)]
    out = subprocess.run(cmd + (["--profile"] if profile else []), check=True, text=True, stdout=subprocess.PIPE,
                         stderr=None if profile else subprocess.DEVNULL, env=dict(_env(), OMP_NUM_THREADS="2"),
                         cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_trainer(name, steps):
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.join(ROOT, "train.py"), *_trainer_args(name, steps, out)]
        subprocess.run(cmd, check=True, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        records = read_metrics(out)
    return statistics.median(r["tokens_per_sec"] for r in records[SKIP:])


def gemm_peak(dtype_name):
    from training.hardware import measure_gemm_peak
    torch.set_num_threads(2)
    return measure_gemm_peak(getattr(torch, dtype_name), torch.device("cpu"), size=2048, seconds=2.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side per shape (order rotates)")
    parser.add_argument("--only", choices=sorted(SHAPES), default=None)
    parser.add_argument("--profile", action="store_true", help="print torch.profiler tables of one step of each")
    parser.add_argument("--worker", choices=("minimal", "trainer"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "minimal":
        return minimal_worker(args.only, args.steps, args.profile)
    if args.worker:
        return trainer_worker(args.only, args.steps, args.profile)
    names = [args.only] if args.only else list(SHAPES)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; command: "
          f"{' '.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])}")
    from models.llama import flops_per_token
    peaks = {d: gemm_peak(d) for d in sorted({SHAPES[n][3] for n in names})}
    sides = {"minimal": lambda n: run_worker("minimal", n, args.steps),
             "train.py": lambda n: {"wall": run_trainer(n, args.steps)},
             "trainer in-process": lambda n: run_worker("trainer", n, args.steps)}
    rows = []
    for name in names:
        best = {side: {} for side in sides}
        with OtherLoad(own=2) as load:
            for r in range(args.rounds):
                order = list(sides)[r % len(sides):] + list(sides)[:r % len(sides)]
                for side in order:
                    for key, value in sides[side](name).items():
                        best[side][key] = max(best[side].get(key, 0.0), value)
        flops = flops_per_token(_model_config(name), SHAPES[name][1], causal=True)
        rows.append((name, best, flops, peaks[SHAPES[name][3]], load.mean))
        if args.profile:
            for kind in ("minimal", "trainer"):
                run_worker(kind, name, SKIP + 1, profile=True)  # the last "step" is PROFILED_STEPS steps
    print("\n| shape | GEMM peak GFLOP/s | minimal tok/s (MFU) | train.py tok/s (MFU) | train.py / minimal | "
          "CPU-time ratio, trainer / minimal | other runnable tasks |")
    print("|---|---|---|---|---|---|---|")
    for name, best, flops, peak, load in rows:
        minimal, trainer = best["minimal"], best["train.py"]
        inproc = best["trainer in-process"]
        note = " (> 0.5: disturbed)" if load > 0.5 else ""
        mfu = {side: flops * best[side]["wall"] / peak for side in ("minimal", "train.py")}
        print(f"| {name} | {peak / 1e9:.0f} | {minimal['wall']:.0f} ({mfu['minimal']:.1%}) | "
              f"{trainer['wall']:.0f} ({mfu['train.py']:.1%}) | {trainer['wall'] / minimal['wall']:.3f} | "
              f"{inproc['cpu'] / minimal['cpu']:.3f} | {load:.1f}{note} |")
    print("goal: trainer / minimal >= 0.95. CPU-time ratio: tokens per CPU-second of the in-process trainer's "
          "train_step over the minimal loop's (load-independent).")


if __name__ == "__main__":
    main()
