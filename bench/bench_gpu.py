"""One GPU: our trainer vs TorchTitan on the same Llama shape, sequence length and batch (tok/s and MFU side by side
in one run), and ring attention at CP=1 vs plain SDPA (fwd+bwd time).

    python bench/bench_gpu.py [--rounds 3] [--steps 10] [--seq 8192] [--batch 1] [--dim 2048] [--n-layers 8]
                              [--n-heads 16] [--n-kv-heads 8] [--torchtitan-attention flex|varlen] [--only ...]

Without a CUDA device it prints one line and exits 0. Both trainers run as fresh torchrun processes (1 rank), bf16
compute with fp32 master weights, AdamW, no activation checkpointing, no torch.compile of the model, no CUDA graphs,
on the same English text (pydoc, shipped with Python) with a tokenizer of the model's vocabulary each; runs alternate
(ours, TorchTitan, TorchTitan, ours, ...), each run's tok/s is the median over the steps after --warmup, the best
run of each side is kept. Same work: TorchTitan 0.3.0 always masks attention by document (flex or varlen), so our
trainer runs with data.document_masking = true (ring attention at cp 1, per-document pieces on the plain kernels).

MFU: tok/s x FLOPs per token / the GPU's dense bf16 peak (training/hardware.py; H100 SXM 989 TFLOP/s, TorchTitan's
number too). FLOPs per token = 6 x (parameters without the embedding) + attention. Our trainer counts causal attention
as half of full attention (12 x layers x heads x head_dim x seq / 2); TorchTitan counts it in full. The table prints
both systems on both bases; the ratio of the two systems does not depend on the basis.

TorchTitan is found by import; if it is missing or does not import, one line says so and only our side runs. The GPU
machines have no network, so bring its wheels (TorchTitan 0.3.0 needs Python >= 3.11): on a machine with pip access,
    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d wheels \\
        torchtitan==0.3.0 tyro docstring-parser typeguard torch_checkpointing spmd_types==0.2.3 \\
        "datasets<4.8" "dill<0.4.1" "multiprocess<0.70.19" torchdata==0.11.0
(plus any other package `pip check` names there), copy the folder over, and on the GPU machine:
    pip install --no-index --no-deps --target "$HOME/gpu-site" wheels/*.whl && export PYTHONPATH="$HOME/gpu-site"
TorchTitan 0.3.0 is written against recent torch (2.13 here); with an older torch on the GPU image its import or its
attention call may fail, which the bench reports in one line before running our side alone.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.torchtitan_config import JOB_ENV  # noqa: E402

TT_STEP = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+|N/A)%?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _model_config(args):
    from models.llama import model_config
    return model_config("debug", dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                        n_kv_heads=args.n_kv_heads)


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.update(extra)
    return env


def _last_error(text: str) -> str:
    """The last line of a log that names an error (else its last line), shortened."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["no output"])[-1][-300:]


def run_ours(args, out: str) -> tuple[float, float]:
    """(median tok/s after warm-up, median MFU as the trainer logs it) of one train.py run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           os.path.join(ROOT, "train.py"), os.path.join(ROOT, "recipes", "debug.toml"), "--job.dump_folder", out,
           "--model.dim", str(args.dim), "--model.n_layers", str(args.n_layers), "--model.n_heads", str(args.n_heads),
           "--model.n_kv_heads", str(args.n_kv_heads), "--training.seq_len", str(args.seq),
           "--training.local_batch_size", str(args.batch), "--training.steps", str(args.steps),
           "--training.dtype", "bfloat16", "--parallelism.dp_shard", "1", "--data.document_masking", "true",
           "--metrics.enable_tensorboard", "false", "--optimizer.lr", str(args.lr)]
    done = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(f"train.py failed: {_last_error(done.stderr)}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f][args.warmup:]
    return statistics.median(r["tokens_per_sec"] for r in records), statistics.median(r["mfu"] for r in records)


def torchtitan_unavailable() -> str | None:
    """None when TorchTitan imports here, else one line saying why."""
    probe = subprocess.run([sys.executable, "-c", "import torchtitan, torchtitan.train; print(torchtitan.__version__)"],
                           env=_env(), capture_output=True, text=True, timeout=300)
    if probe.returncode == 0:
        return None
    return f"TorchTitan does not import here ({_last_error(probe.stderr)})"


def write_torchtitan_assets(folder: str, vocab_size: int) -> tuple[str, str]:
    """The same pydoc text as our trainer's, as a JSON-lines dataset folder, and a byte-level BPE tokenizer.json of
    the model's vocabulary trained on it (TorchTitan loads both from disk: no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from data.corpus import load_documents
    documents = load_documents(["pydoc"])
    text_dir, tokenizer_dir = os.path.join(folder, "text"), os.path.join(folder, "tokenizer")
    os.makedirs(text_dir)
    os.makedirs(tokenizer_dir)
    with open(os.path.join(text_dir, "train.jsonl"), "w") as f:
        for doc in documents:
            f.write(json.dumps({"text": doc}) + "\n")
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(documents, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": special[0], "eos_token": special[1]}, f)
    return text_dir, tokenizer_dir


def run_torchtitan(args, assets: tuple[str, str], out: str) -> tuple[float, float]:
    """(median tok/s after warm-up, median MFU as TorchTitan logs it, full-attention basis) of one run."""
    cfg = _model_config(args)
    job = {"dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.num_kv_heads,
           "vocab_size": cfg.vocab_size, "multiple_of": cfg.multiple_of, "ffn_dim_multiplier": cfg.ffn_dim_multiplier,
           "rope_theta": cfg.rope_theta, "seq_len": args.seq, "batch": args.batch, "steps": args.steps,
           "lr": args.lr, "attention": args.torchtitan_attention, "text_dir": assets[0], "tokenizer_dir": assets[1],
           "dump_folder": out}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
           "torchtitan.train", "--module", "bench.torchtitan_config", "--config", "longctx_llama"]
    done = subprocess.run(cmd, env=_env(**{JOB_ENV: json.dumps(job)}), cwd=ROOT, capture_output=True, text=True,
                          timeout=args.timeout)
    log = ANSI.sub("", done.stdout + "\n" + done.stderr)
    steps = {int(m.group(1)): (float(m.group(2).replace(",", "")), m.group(3)) for m in TT_STEP.finditer(log)}
    if done.returncode or not steps:
        raise RuntimeError(f"TorchTitan's run failed (exit {done.returncode}): {_last_error(log)}")
    kept = [steps[s] for s in sorted(steps) if s > args.warmup]
    mfus = [float(m) / 100 for _, m in kept if m != "N/A"]
    return statistics.median(t for t, _ in kept), statistics.median(mfus) if mfus else float("nan")


def compare_trainers(args) -> None:
    from models.llama import flops_per_token
    from training.hardware import Device, peak_flops

    cfg = _model_config(args)
    peak, source = peak_flops(Device("cuda", "nccl", torch.device("cuda")), torch.bfloat16)
    missing = torchtitan_unavailable()
    if missing:
        print(f"{missing}: our side only (pip package torchtitan==0.3.0; see this file's docstring for the wheels)")
    best = {"ours": None, "torchtitan": None}
    with tempfile.TemporaryDirectory() as tmp:
        assets = None if missing else write_torchtitan_assets(os.path.join(tmp, "assets"), cfg.vocab_size)
        for r in range(args.rounds):
            order = ("ours", "torchtitan") if r % 2 == 0 else ("torchtitan", "ours")
            for side in order:
                if side == "torchtitan" and (missing or assets is None):
                    continue
                out = os.path.join(tmp, f"{side}-{r}")
                try:
                    result = run_ours(args, out) if side == "ours" else run_torchtitan(args, assets, out)
                except RuntimeError as err:
                    if side == "ours":
                        raise
                    print(f"{err}: our side only from here")
                    assets = None
                    continue
                print(f"round {r + 1} {side}: {result[0]:,.0f} tok/s", flush=True)
                if best[side] is None or result[0] > best[side][0]:
                    best[side] = result
    causal, full = flops_per_token(cfg, args.seq, causal=True), flops_per_token(cfg, args.seq, causal=False)
    print(f"\nLlama dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.num_kv_heads} heads of {cfg.head_dim}, "
          f"vocab {cfg.vocab_size}, seq {args.seq}, batch {args.batch}, bf16, documents masked; peak "
          f"{peak / 1e12:.0f} TFLOP/s ({source}); best of {args.rounds} run(s) each")
    print("| system | tok/s | MFU, causal attention as half | MFU, attention in full | MFU as the system logs it |")
    print("|---|---|---|---|---|")
    for side, label in (("ours", "ours (train.py)"), ("torchtitan", "TorchTitan 0.3.0")):
        if best[side] is None:
            continue
        tps, logged = best[side]
        print(f"| {label} | {tps:,.0f} | {causal * tps / peak:.1%} | {full * tps / peak:.1%} | {logged:.1%} |")
    if best["ours"] and best["torchtitan"]:
        print(f"ours / TorchTitan tok/s: {best['ours'][0] / best['torchtitan'][0]:.3f}")


def _timed(call, grad, device: torch.device) -> float:
    """Seconds of one fwd+bwd (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call().backward(grad)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    call().backward(grad)
    return time.perf_counter() - begin


def ring_vs_sdpa(args, device: torch.device) -> None:
    """Causal bf16 fwd+bwd of one attention call: ring_attention on a 1-rank group vs F.scaled_dot_product_attention,
    interleaved rep by rep, fastest of --reps each."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from parallelisms.context_parallel import ring_attention
    from tests.distributed import free_port

    cfg = _model_config(args)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", world_size=1, rank=0,
                            init_method=f"tcp://127.0.0.1:{free_port()}",
                            device_id=device if device.type == "cuda" else None)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, cfg.n_heads, args.seq, cfg.head_dim)
    kv_shape = (args.batch, cfg.num_kv_heads, args.seq, cfg.head_dim)
    q = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(kv_shape, generator=gen, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    calls = {"ring at CP=1": lambda: ring_attention(q, k, v, dist.group.WORLD, is_causal=True),
             "SDPA": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
    best = {name: float("inf") for name in calls}
    for _ in range(args.reps):
        for name, call in calls.items():
            best[name] = min(best[name], _timed(call, grad, device))
            q.grad = k.grad = v.grad = None
    dist.destroy_process_group()
    ring, sdpa = best["ring at CP=1"], best["SDPA"]
    print(f"\nring at CP=1 / SDPA, causal fwd+bwd, bf16, q {tuple(shape)}, {cfg.num_kv_heads} K/V heads: "
          f"{ring * 1e3:.2f} ms / {sdpa * 1e3:.2f} ms = {ring / sdpa:.3f} (fastest of {args.reps} each)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--n-heads", type=int, default=16)
    parser.add_argument("--n-kv-heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped from each run's median")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side; the best is kept")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--reps", type=int, default=10, help="ring vs SDPA repetitions")
    parser.add_argument("--torchtitan-attention", choices=("flex", "varlen"), default="flex")
    parser.add_argument("--only", choices=("trainers", "ring"), default=None)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per training run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"bench_gpu: no CUDA device visible to torch {torch.__version__}; nothing measured")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; command: "
          f"{' '.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])}", flush=True)
    if args.only in (None, "ring"):
        ring_vs_sdpa(args, torch.device("cuda", 0))
    if args.only in (None, "trainers"):
        compare_trainers(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
