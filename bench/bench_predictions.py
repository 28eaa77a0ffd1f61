"""The dry run's step time and peak memory against measured runs of our trainer, over a grid of one-GPU runs of the
bench shape (issue 37: sequence length x activation checkpointing x document masking, and float8 or compile).

    python bench/bench_predictions.py [--seqs 8192,32768,65536] [--ac none,full] [--documents off,on]
        [--float8 off] [--compile false] [--attention-kernel auto,cudnn] [--dim 2048 --n-layers 8 --n-heads 16 --n-kv-heads 8]
        [--measured measured.json] [--profile-step 0] [--timeout 120]     # on a GPU: measure
    python bench/bench_predictions.py --predict measured.json [--accelerator h100-sxm]  # anywhere: predict, compare

Measuring needs the GPU; predicting does not (the dry run prices a recipe on the CPU, with the accelerator's rates
file, training/planning/rates/<accelerator>.json). So a short GPU lease measures only (`--measured FILE`, written
after every run, so a lease cut short keeps what it ran), and the table is made afterwards from that file with
`--predict FILE`, on any machine, with the rates file as it is then. On a GPU without --measured or --predict it
does both.

Each run is a fresh `train.py` process under torchrun (1 rank) with bench/bench_gpu.py's overrides of the bench shape
(bench/our_runs.py): bf16 compute, fp32 master weights, AdamW, batch 1. Its step time is the median of metrics.jsonl's
step_time over the steps after the warm-up (the step --profile-step profiled is left out: the profiler slows it); its
peak is the largest `memory` (torch.cuda.max_memory_allocated, GiB). The table gives predicted / measured for each
and how many runs fall within 15% (issue 37's bound). `tests/test_bench_predictions.py` runs both halves on the CPU.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.our_runs import dry_run_stage, last_error, our_overrides, run_in_session  # noqa: E402
from config.accelerators import accelerator_of  # noqa: E402
from training.metrics import read_metrics  # noqa: E402

BOUND = 0.15
"""Issue 37's bound on |predicted / measured - 1|."""


def steps_for(seq: int) -> tuple[int, int]:
    """(steps, warm-up steps) of one run: enough timed steps for a median, few at the long lengths."""
    return (10, 3) if seq <= 16384 else (7, 2) if seq <= 32768 else (6, 2)


def grid(args) -> list[dict]:
    """One dict per run: the overrides' knobs."""
    runs = [{"seq": seq, "ac": ac, "documents": documents == "on", "float8": float8, "compile": compile_,
             "dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
             "attention_kernel": kernel}
            for seq, ac, documents, float8, compile_, kernel in itertools.product(
                args.seqs, args.ac, args.documents, args.float8, args.compile, args.attention_kernel)]
    # a kernel that differs from "auto" only for documents (cuDNN THD) is not rerun without them
    return [r for r in runs if r["documents"] or r["attention_kernel"] == args.attention_kernel[0]]


def _namespace(run: dict, steps: int) -> argparse.Namespace:
    return argparse.Namespace(dim=run["dim"], n_layers=run["n_layers"], n_heads=run["n_heads"],
                              n_kv_heads=run["n_kv_heads"], seq=run["seq"], batch=1, steps=steps, lr=3e-4,
                              compile=run["compile"], ac=run["ac"])


def overrides(run: dict, out: str, steps: int) -> list[str]:
    return [*our_overrides(_namespace(run, steps), out, run["documents"], run["compile"], run["float8"]),
            "--parallelism.attention_kernel", run_kernel(run)]


def run_kernel(run: dict) -> str:
    """The attention_kernel a run is replayed (and priced) with. A measured run that names the documents kernel it
    ran is priced on that kernel: `auto` took FlashAttention-2 varlen for documents until cuDNN THD's GPU tests
    passed (bench/measurements/h200_documents_2026-11-28, commit 902c7b3) and takes THD since, so such a run's
    `auto` is "flash" now."""
    kernel = run.get("attention_kernel", "auto")
    return "flash" if kernel == "auto" and run.get("documents_kernel") == "flash_varlen" else kernel


def label(run: dict) -> str:
    kernel = run.get("attention_kernel", "auto")
    extra = "".join([", documents" if run["documents"] else "", f", float8 {run['float8']}" if run["float8"] != "off"
                     else "", ", compiled" if run["compile"] == "true" else "",
                     f", attention_kernel {kernel}" if kernel != "auto" else ""])
    shape = "" if (run["dim"], run["n_layers"]) == (2048, 8) else f"dim {run['dim']} x {run['n_layers']} layers, "
    seq = f"{run['seq'] // 1024}K" if run["seq"] % 1024 == 0 else str(run["seq"])
    return f"{shape}{seq}, AC {run['ac']}{extra}"


def measure(run: dict, timeout: float, profile_step: int, keep: str | None) -> dict:
    """One train.py run on this GPU: its median step time and peak memory (or why it failed)."""
    steps, warmup = steps_for(run["seq"])
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.join(ROOT, "train.py"), *overrides(run, out, steps)]
        if profile_step:
            cmd += ["--metrics.profile_step", str(profile_step)]
        start = time.perf_counter()
        try:
            done = run_in_session(cmd, timeout)
        except subprocess.TimeoutExpired:
            return {**run, "error": f"no result within {timeout:.0f} s"}
        wall = time.perf_counter() - start
        if done.returncode:
            return {**run, "error": last_error(done.stderr or done.stdout), "wall_s": wall}
        records = read_metrics(out)
        timed = [r for r in records[warmup:] if not r.get("profiled")] or records
        result = {**run, "measured_step_s": statistics.median(r["step_time"] for r in timed),
                  "measured_peak_gib": max(r["memory"] for r in records), "timed_steps": len(timed), "wall_s": wall,
                  "first_step_s": records[0]["step_time"],
                  **{key: records[-1][key] for key in ("documents_kernel", "cudnn_thd_graphs") if key in records[-1]}}
        profile = os.path.join(out, f"profile_step{profile_step}_rank0.json")
        if profile_step and os.path.exists(profile):
            with open(profile) as f:
                result["profile"] = json.load(f)
            if keep:
                os.makedirs(keep, exist_ok=True)
                shutil.copy(profile, os.path.join(keep, f"profile_{label(run).replace(' ', '').replace(',', '_')}"
                                                        ".json"))
    return result


def predict(run: dict, accelerator: str, timeout: float) -> dict:
    """The dry run's (step s, peak GiB, parts) for the same overrides on `accelerator`, or why it failed."""
    steps, _ = steps_for(run["seq"])
    try:
        stage = dry_run_stage(lambda out: overrides(run, out, steps), accelerator, timeout)
    except RuntimeError as err:
        return {"error": str(err)}
    return {"step_s": stage["predicted_step_s"], "peak_gib": stage["predicted_peak_gib_per_rank"],
            "parts": stage.get("predicted_parts_s", {}), "rates_source": stage.get("rates_source", "")}


def table(measured: dict, accelerator: str, timeout: float) -> list[str]:
    """The markdown table of predicted vs measured, and a last line counting the runs within BOUND."""
    lines = [f"{measured['device_name']}, torch {measured['torch']}; predictions on {accelerator}",
             "| run | measured step s | predicted step s | predicted / measured | measured peak GiB | "
             "predicted peak GiB | predicted / measured |", "|---|---|---|---|---|---|---|"]
    within = ran = 0
    for run in measured["runs"]:
        if "error" in run:
            lines.append(f"| {label(run)} | failed: {run['error'][:120]} | | | | | |")
            continue
        guess = predict(run, accelerator, timeout)
        if "error" in guess:
            lines.append(f"| {label(run)} | {run['measured_step_s']:.4f} | dry run failed: {guess['error'][:120]} "
                         f"| | | | |")
            continue
        ratio, memory = guess["step_s"] / run["measured_step_s"], guess["peak_gib"] / run["measured_peak_gib"]
        ran += 1
        within += abs(ratio - 1) <= BOUND
        lines.append(f"| {label(run)} | {run['measured_step_s']:.4f} | {guess['step_s']:.4f} | {ratio:.2f} | "
                     f"{run['measured_peak_gib']:.2f} | {guess['peak_gib']:.2f} | {memory:.3f} |")
    lines.append(f"{within} of {ran} predicted step times within {BOUND:.0%} of the measured ones")
    return lines


def _list(kind):
    return lambda text: [kind(x) for x in text.split(",")]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=_list(int), default=[8192, 32768, 65536])
    p.add_argument("--ac", type=_list(str), default=["none", "full"])
    p.add_argument("--documents", type=_list(str), default=["off"])
    p.add_argument("--float8", type=_list(str), default=["off"])
    p.add_argument("--compile", type=_list(str), default=["false"])
    p.add_argument("--attention-kernel", type=_list(str), default=["auto"],
                   help="parallelism.attention_kernel values; those after the first run with documents only")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--n-kv-heads", type=int, default=8)
    p.add_argument("--measured", help="measure on this GPU and write (or extend) this JSON file")
    p.add_argument("--predict", help="a measured JSON file: print predicted vs measured for its runs")
    p.add_argument("--accelerator", help="the dry run's hardware.accelerator (default: from the device's name)")
    p.add_argument("--profile-step", type=int, default=0, help="also profile this step of each run (metrics.profile_step)")
    p.add_argument("--keep-profiles", help="copy each run's step profile into this folder")
    p.add_argument("--timeout", type=float, default=180, help="seconds per run")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: for tests (tiny shapes)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    path = args.predict
    if not args.predict:
        if args.device == "cuda" and not torch.cuda.is_available():
            print(f"bench_predictions: no CUDA device visible to torch {torch.__version__}; nothing measured "
                  f"(--predict FILE prints the table of an earlier measurement)")
            return 0
        name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        path = args.measured or os.path.join(tempfile.mkdtemp(), "measured.json")
        measured = {"device_name": name, "torch": torch.__version__, "runs": []}
        if args.measured and os.path.exists(args.measured):
            with open(args.measured) as f:
                measured = json.load(f)
        for run in grid(args):
            result = measure(run, args.timeout, args.profile_step, args.keep_profiles)
            measured["runs"].append(result)
            with open(path, "w") as f:
                json.dump(measured, f, indent=1)
            shown = (f"failed: {result['error']}" if "error" in result else
                     f"step {result['measured_step_s']:.4f} s, peak {result['measured_peak_gib']:.2f} GiB "
                     f"({result['wall_s']:.0f} s run)")
            print(f"{label(run)}: {shown}", flush=True)
        if args.measured:
            return 0
    with open(path) as f:
        measured = json.load(f)
    accelerator = args.accelerator or accelerator_of(measured["device_name"])
    if accelerator is None:
        print(f"bench_predictions: no accelerator for {measured['device_name']!r}; name one with --accelerator")
        return 2
    print("\n".join(table(measured, accelerator, args.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
