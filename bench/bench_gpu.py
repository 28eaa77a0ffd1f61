"""One GPU: our trainer vs its peers on the same Llama shape, sequence length and batch (tok/s, peak memory and MFU
side by side in one run), and the attention kernels: each family the CP layer can pick, ring attention at CP=1 and
plain SDPA (fwd+bwd time at --seq and 64K, plain causal and packed documents; bench/bench_attention_kernels.py).

    python bench/bench_gpu.py [--short] [--rounds 3] [--steps 10] [--seq 8192] [--batch 1] [--dim 2048]
                              [--n-layers 8] [--n-heads 16] [--n-kv-heads 8] [--torchtitan-attention flex|varlen]
                              [--compile false|true|auto] [--ac none|full] [--long-seq 65536]
                              [--float8 off|tensorwise|rowwise]

The trainers are compared at --seq and again at --long-seq (TorchTitan at --seq only), each with our trainer eager
(--compile, default false) and compiled (training.compile = true, what a CUDA run defaults to): issue 36's lines
(ours eager and compiled against the transformers loop at 8K, eager at 64K with peak memory) in one run. After each
table, the dry run's prediction of each of our runs (step time and peak memory, on the accelerator the device's
name maps to) is printed beside the measured figures.

Without a CUDA device it prints one line and exits 0. --short (about a minute): one run of each side of the
transformers comparison, 6 steps, 3 ring repetitions, no TorchTitan runs. `./run_tests.sh --gpu --report` runs
bench/bench_gpu_report.py instead: these runs at 8K and 64K, one row printed per run, under a time budget.

Two peers, each on the work it does the same way as ours:
- Hugging Face transformers' LlamaForCausalLM (bench/transformers_peer.py: the plain loop a user writes, fp32 master
  weights, bf16 autocast, fused AdamW, SDPA causal attention) against our trainer with plain causal attention. It
  runs on any torch, so every GPU image gets a comparison.
- TorchTitan 0.3.0 (bench/torchtitan_config.py), when it imports here, against our trainer with document masking:
  TorchTitan 0.3.0 always masks attention by document (flex or varlen), so ours runs with data.document_masking =
  true (ring attention at cp 1, per-document pieces on the plain kernels).
Every side runs as a fresh process (ours and TorchTitan under torchrun, 1 rank): bf16 compute with fp32 master
weights, AdamW, no activation checkpointing, no torch.compile of the model, no CUDA graphs; the trainers on the same
English text (pydoc, shipped with Python) with a tokenizer of the model's vocabulary each, transformers on random
tokens. Runs alternate (ours, peer, peer, ours, ...), each run's tok/s is the median over the steps after --warmup,
the best run of each side is kept. Peak memory is the allocator's max_memory_allocated (ours and transformers).

MFU: tok/s x FLOPs per token / the GPU's dense bf16 peak (training/hardware.py; H100 SXM 989 TFLOP/s, TorchTitan's
number too). FLOPs per token = 6 x (parameters without the embedding) + attention. Our trainer counts causal attention
as half of full attention (12 x layers x heads x head_dim x seq / 2); TorchTitan counts it in full. The table prints
both systems on both bases; the ratio of the two systems does not depend on the basis.

TorchTitan is found by import; if it is missing or does not import, one line says why and which release this torch
needs, and the transformers comparison stands alone. TorchTitan 0.3.0 needs torch >= 2.12 (on 2.11 it fails with
`cannot import name 'DataParallelMeshDims'`). 0.2.2 is the release for torch 2.10-2.11, but its TOML job config
(`--job.config_file`, a TransformerModelArgs flavor registered through `experimental.custom_import`) has not been
run by this bench on any GPU, so the bench does not drive it: with 0.2.2 it says so in one line. The GPU machines
have no network, so bring TorchTitan's wheels (0.3.0 needs Python >= 3.11): on a machine with pip access,
    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d wheels \\
        torchtitan==0.3.0 tyro docstring-parser typeguard torch_checkpointing spmd_types==0.2.3 \\
        "datasets<4.8" "dill<0.4.1" "multiprocess<0.70.19" torchdata==0.11.0 torchao==0.18.0
(plus any other package `pip check` names there), copy the folder over, and on the GPU machine:
    WHEELS=wheels ./run_tests.sh --gpu --report OUTDIR    (or: python -m pip install --no-index --no-deps wheels/*.whl)
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.our_runs import dry_run_stage, last_error, our_overrides, run_in_session  # noqa: E402
from bench.transformers_peer import add_shape_args  # noqa: E402
from config.accelerators import accelerator_of  # noqa: E402
from training.metrics import read_metrics  # noqa: E402
from bench.torchtitan_config import JOB_ENV  # noqa: E402
from harness.launch_env import child_env  # noqa: E402

TT_STEP = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+|N/A)%?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _model_config(args):
    from models.llama import model_config
    return model_config("debug", dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                        n_kv_heads=args.n_kv_heads)


def predicted(args, documents: bool, accelerator: str | None, compile_: str | None = None,
              float8: str = "off") -> tuple[float, float] | None:
    """(step s, peak GiB) the dry run predicts for our side's run on `accelerator` (None: no accelerator to
    price it on, or the dry run failed: one line says why)."""
    if accelerator is None:
        return None
    try:
        stage = dry_run_stage(lambda out: our_overrides(args, out, documents, compile_, float8), accelerator,
                              args.timeout)
    except RuntimeError as err:
        print(f"dry run: {err}", flush=True)
        return None
    return stage["predicted_step_s"], stage["predicted_peak_gib_per_rank"]


def prediction_rows(args, best: dict, accelerator: str | None) -> list[str]:
    """Predicted vs measured, one row per side of ours that ran (step time and peak memory)."""
    rows = [f"| run ({accelerator or 'no accelerator file'}) | measured step s | predicted step s | "
            "predicted / measured | measured peak GiB | predicted peak GiB | predicted / measured |",
            "|---|---|---|---|---|---|---|"]
    for side in ("ours", "ours-compiled", "ours-float8", "ours-documents"):
        if best.get(side) is None:
            continue
        compile_ = "true" if side == "ours-compiled" else args.compile
        guess = predicted(args, side == "ours-documents", accelerator, compile_,
                          args.float8 if side == "ours-float8" else "off")
        if guess is None:
            continue
        step_s = args.seq * args.batch / best[side][0]
        rows.append(f"| {SIDES[side]}, seq {args.seq:,}, AC {args.ac}, compile {compile_} | {step_s:.4f} | "
                    f"{guess[0]:.4f} | {guess[0] / step_s:.2f} | {best[side][2]:.2f} | {guess[1]:.2f} | "
                    f"{guess[1] / best[side][2]:.3f} |")
    return rows if len(rows) > 2 else []


def run_ours(args, out: str, documents: bool, compile_: str | None = None,
             float8: str = "off") -> tuple[float, float, float]:
    """(median tok/s after warm-up, median MFU as the trainer logs it, peak GiB) of one train.py run, attention
    masked by document or plain causal."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           os.path.join(ROOT, "train.py"), *our_overrides(args, out, documents, compile_, float8)]
    done = run_in_session(cmd, args.timeout)
    if done.returncode:
        raise RuntimeError(f"train.py failed: {last_error(done.stderr)}")
    records = read_metrics(out)
    kept = records[args.warmup:] or records
    return (statistics.median(r["tokens_per_sec"] for r in kept), statistics.median(r["mfu"] for r in kept),
            max(r["memory"] for r in records))


def run_transformers(args) -> tuple[float, float, float]:
    """(median tok/s after warm-up, NaN: it logs no MFU, peak GiB) of one bench/transformers_peer.py run."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "transformers_peer.py"), "--dim", str(args.dim), "--n-layers",
           str(args.n_layers), "--n-heads", str(args.n_heads), "--n-kv-heads", str(args.n_kv_heads), "--seq",
           str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--lr", str(args.lr)]
    done = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(f"transformers' run failed: {last_error(done.stderr)}")
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    return result["tokens_per_sec"], float("nan"), result["peak_gib"]


def _torch_minor() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return int(major), int(minor)


def torchtitan_unavailable() -> str | None:
    """None when a TorchTitan this bench drives (0.3.x) imports here, else one line: why not, and which release
    this torch needs."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("torchtitan")
    except PackageNotFoundError:
        installed = None
    need = ("0.3.0" if _torch_minor() >= (2, 12) else "0.2.2 (0.3.0 needs torch >= 2.12), which this bench does not "
            "drive yet (its TOML job config has not been run by it)")
    if installed is None:
        return f"TorchTitan is not installed; torch {torch.__version__} needs TorchTitan {need}"
    if not installed.startswith("0.3."):  # before the import probe: a release not driven costs no import
        return (f"TorchTitan {installed} is installed, but this bench drives only 0.3.0 (bench/torchtitan_config.py): "
                f"{installed}'s TOML job config has not been run by it")
    probe = subprocess.run([sys.executable, "-c", "import torchtitan, torchtitan.train"],
                           env=child_env(), capture_output=True, text=True, timeout=300)
    if probe.returncode:
        return (f"TorchTitan {installed} does not import here ({last_error(probe.stderr)}); torch "
                f"{torch.__version__} needs TorchTitan {need}")
    return None


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
    done = run_in_session(cmd, args.timeout, child_env(**{JOB_ENV: json.dumps(job)}))
    log = ANSI.sub("", done.stdout + "\n" + done.stderr)
    steps = {int(m.group(1)): (float(m.group(2).replace(",", "")), m.group(3)) for m in TT_STEP.finditer(log)}
    if done.returncode or not steps:
        raise RuntimeError(f"TorchTitan's run failed (exit {done.returncode}): {last_error(log)}")
    kept = [steps[s] for s in sorted(steps) if s > args.warmup]
    mfus = [float(m) / 100 for _, m in kept if m != "N/A"]
    return statistics.median(t for t, _ in kept), statistics.median(mfus) if mfus else float("nan")


SIDES = {"ours": "ours (train.py), causal", "ours-compiled": "ours (train.py), causal, torch.compile (CUDA's default)",
         "ours-float8": "ours (train.py), causal, float8 linear layers (--float8)",
         "transformers": "transformers LlamaForCausalLM, causal",
         "ours-documents": "ours (train.py), documents masked", "torchtitan": "TorchTitan 0.3.0, documents masked"}


def compare_trainers(args) -> None:
    from models.llama import flops_per_token
    from training.hardware import Device, peak_flops

    cfg = _model_config(args)
    peak, source = peak_flops(Device("cuda", "nccl", torch.device("cuda")), torch.bfloat16)
    pairs = [("ours", "transformers")] + ([] if args.short else [("ours-compiled",)])
    if args.float8 != "off":
        pairs.append(("ours-float8",))
    missing = ("--short leaves TorchTitan out (about a minute per run)" if args.short else
               "not run at the long length" if args.seq != args.first_seq else torchtitan_unavailable())
    if missing:
        print(f"TorchTitan: {missing}; comparing with transformers only", flush=True)
    else:
        pairs.append(("ours-documents", "torchtitan"))
    best: dict = {side: None for pair in pairs for side in pair}
    dropped = set()  # peers whose run failed: one line said why, and our side of their pair runs on alone
    with tempfile.TemporaryDirectory() as tmp:
        assets = None if missing else write_torchtitan_assets(os.path.join(tmp, "assets"), cfg.vocab_size)
        for r in range(args.rounds):
            for pair in pairs:
                for side in pair if r % 2 == 0 else pair[::-1]:
                    if side in dropped:
                        continue
                    out = os.path.join(tmp, f"{side}-{r}")
                    try:
                        if side.startswith("ours"):
                            result = run_ours(args, out, documents=side == "ours-documents",
                                              compile_="true" if side == "ours-compiled" else None,
                                              float8=args.float8 if side == "ours-float8" else "off")
                        elif side == "transformers":
                            result = run_transformers(args)
                        else:
                            result = (*run_torchtitan(args, assets, out), float("nan"))
                    except (RuntimeError, subprocess.TimeoutExpired) as err:
                        if side.startswith("ours"):
                            raise
                        print(f"{SIDES[side]}: {(str(err).splitlines() or [type(err).__name__])[0]}; our side "
                              f"only from here", flush=True)
                        dropped.add(side)
                        continue
                    print(f"round {r + 1} {side}: {result[0]:,.0f} tok/s", flush=True)
                    if best[side] is None or result[0] > best[side][0]:
                        best[side] = result
    causal, full = flops_per_token(cfg, args.seq, causal=True), flops_per_token(cfg, args.seq, causal=False)
    print(f"\nLlama dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.num_kv_heads} heads of {cfg.head_dim}, "
          f"vocab {cfg.vocab_size}, seq {args.seq}, batch {args.batch}, bf16; peak {peak / 1e12:.0f} TFLOP/s "
          f"({source}); best of {args.rounds} run(s) each, {args.steps} steps, median after {args.warmup}")
    print("| system | tok/s | peak GiB | MFU, causal attention as half | MFU, attention in full | MFU as logged |")
    print("|---|---|---|---|---|---|")
    for side, label in SIDES.items():
        if best.get(side) is None:
            continue
        tps, logged, memory = best[side]
        print(f"| {label} | {tps:,.0f} | {_cell(memory, '.2f')} | {causal * tps / peak:.1%} | {full * tps / peak:.1%} "
              f"| {_cell(logged, '.1%')} |")
    for ours, peer in (("ours", "transformers"), ("ours-compiled", "transformers"), ("ours-float8", "ours"),
                       ("ours-documents", "torchtitan")):
        if best.get(ours) and best.get(peer):
            print(f"{ours} / {SIDES[peer].split(',')[0]}: tok/s {best[ours][0] / best[peer][0]:.3f}"
                  + (f", peak memory {best[ours][2] / best[peer][2]:.3f}" if best[peer][2] == best[peer][2] else ""))
    if args.short:  # a quick look: the dry runs would double its time
        print("\n--short: no dry-run prediction rows (python -m harness.gpu_report --measure-step OUT: the 64K step's)")
        return
    rows = prediction_rows(args, best, accelerator_of(torch.cuda.get_device_name()))
    if rows:
        print("\nthe dry run's prediction beside the measured step (./run_train.sh recipes/debug.toml --dry-run with "
              "the same overrides and hardware.accelerator):\n" + "\n".join(rows), flush=True)


def _cell(value: float, spec: str) -> str:
    return "-" if value != value else format(value, spec)  # NaN: the system does not report it


def attention_kernels(args, device: torch.device) -> None:
    """bench/bench_attention_kernels.py on the bench shape's heads: every kernel family the CP layer can pick, ring at
    CP=1 and SDPA, at --seq and 64K, plain causal and packed documents."""
    from bench.bench_attention_kernels import parse, run

    cfg = _model_config(args)
    seqs = ",".join(str(s) for s in dict.fromkeys([args.seq, 65536]))
    kernel_args = parse(["--seqs", seqs, "--reps", str(args.reps), "--heads", str(cfg.n_heads), "--kv-heads",
                         str(cfg.num_kv_heads), "--head-dim", str(cfg.head_dim)])
    print("\n" + "\n".join(run(kernel_args, device)), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(parser)
    parser.add_argument("--long-seq", type=int, default=65536,
                        help="the trainers compared again at this length (0: not; --short: not)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped from each run's median")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side; the best is kept")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--reps", type=int, default=10, help="attention kernel repetitions")
    parser.add_argument("--torchtitan-attention", choices=("flex", "varlen"), default="flex")
    parser.add_argument("--only", choices=("trainers", "ring"), default=None)
    parser.add_argument("--compile", choices=("auto", "true", "false"), default="false",
                        help="our side's training.compile (auto: on, as a CUDA run defaults to)")
    parser.add_argument("--float8", choices=("off", "tensorwise", "rowwise"), default="off",
                        help="also run ours with training.float8 (same --compile) and print float8 / bf16")
    parser.add_argument("--ac", choices=("none", "full", "selective", "op"), default="none",
                        help="our side's activation_checkpoint.mode")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per training run")
    parser.add_argument("--short", action="store_true",
                        help="about a minute: 1 round of ours vs transformers, 6 steps, 3 ring repetitions")
    args = parser.parse_args()
    if args.short:
        args.rounds, args.steps, args.warmup, args.reps, args.timeout = 1, 6, 2, 3, min(args.timeout, 50)
    if not torch.cuda.is_available():
        print(f"bench_gpu: no CUDA device visible to torch {torch.__version__}; nothing measured")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; command: "
          f"{' '.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])}", flush=True)
    if args.only in (None, "ring"):
        attention_kernels(args, torch.device("cuda", 0))
    if args.only in (None, "trainers"):
        args.first_seq = args.seq
        for seq in dict.fromkeys([args.seq] + ([args.long_seq] if args.long_seq and not args.short else [])):
            compare_trainers(argparse.Namespace(**{**vars(args), "seq": seq}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
