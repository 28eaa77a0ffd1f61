"""The GPU report's measured steps (harness/gpu_report.py): `train.py --dry-run`'s prediction of a recipe against
train.py on this GPU, device peak and host peak side by side.

Two uses of the one measurement (`measure_step`):
- the offload step (`offload_step`, in the report's plan): Llama 3.2 3B's shape with `training.cpu_offload` (FSDP2's
  CPU offload on a mesh of one), every block checkpointed with its input offloaded, tiled MLP and norms: the recipe
  recipes/llama3_8b_500k_1gpu.toml with the 3B model, at 128K tokens on one GPU, or the longest length whose
  predicted step fits what is left of the step's limit (`pick_seq_len`; the step's output and the page say which).
  Its device peak is the trainer's `memory` (max_memory_allocated), its host peak the trainer's `host_memory` (the
  rank's peak resident set), against the dry run's `peak_device_gib_per_rank` and `host_peak_gib_per_rank`: under
  cpu_offload the host is where the whole training state lives, so a host plan that is wrong costs a node.
- the bench shape's 64K step (`--measure-step OUT`, by hand; tests/test_gpu_report.py runs its plumbing on the CPU):
  the one the report ran before the offload step took its time.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from harness.launch_env import ROOT, child_env
from harness.report_summary import FIGURES
from config.accelerators import accelerator_of
from training.metrics import read_metrics

BENCH_SHAPE = {"dim": 2048, "n_layers": 8, "n_heads": 16, "n_kv_heads": 8}
"""bench/bench_gpu.py's default Llama shape, handed to it explicitly so that the bench and the 64K step agree."""
STEP_SEQ_LEN = 65536
STEP_STEPS = 3

OFFLOAD_LIMIT_S = 115
"""The offload step's limit. An estimate until a GPU runs it: the dry run (5-8 s on a 2-core CPU box: 7.9 s wall
for 128K), the trainer's set-up (OFFLOAD_SETUP_S) and one step at 128K, predicted 30.96 s (band 30.88..31.03) on
h100-sxm and 33.85 s (31.40..36.71) on h200, times FIRST_STEP_SLACK."""
OFFLOAD_SETUP_S = 50.0
"""Seconds from torchrun's start to the first step of the 3B offload run: an estimate (no GPU has run it). What it
holds: the interpreter and CUDA (about 10 s per launch on the first H200's compiled-op step), the 3.2B parameters
initialised on the host, 48 GiB of pinned parameters, gradients and AdamW state and the 21 GiB activation arena
pinned (cudaHostAlloc pins at a few GB/s)."""
FIRST_STEP_SLACK = 1.25
"""The first step builds cuDNN's graphs and touches the host optimizer's state: the prediction's slow end times this."""
OFFLOAD_STEPS = 1
"""One step: two at 128K do not fit the limit (a second ~31-37 s); its step time is then the first step's, warm-up
included (the page says so)."""
OFFLOAD_SEQ_LENS = (131072, 98304, 65536, 32768)
"""Tried longest first; the first whose predicted step fits what is left of the limit runs."""
OFFLOAD_RECIPE = "llama3_8b_500k_1gpu.toml"
OFFLOAD_OVERRIDES = ["--model.name", "llama3_2_3b", "--checkpoint.enable", "false", "--metrics.enable_tensorboard",
                     "false", "--lr_scheduler.warmup_steps", "1"]
"""The 1-GPU long-context recipe (cpu_offload, AC full with offload, MLP and norms tiled at 64K) on Llama 3.2 3B
(dim 3072, 28 layers, 24/8 heads, ffn 8192: models/model_config.py), without checkpoints."""


def _run(what: str, command: list[str], env: dict) -> None:
    """Runs one command of a measured step into this log; a failure ends the step in one line (the cause is above)."""
    done = subprocess.run(command, cwd=ROOT, env=env)
    if done.returncode:
        raise SystemExit(f"measured step: {what} failed (exit {done.returncode}); its output is above")


def _device() -> tuple[str, str, float]:
    """(accelerator for the dry run, device name, host GiB of this machine)."""
    import torch

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 0.0
    accelerator = accelerator_of(name, memory) if cuda else "h100-sxm"  # the table's (config/accelerators.py)
    if accelerator is None:
        raise SystemExit(f"measured step: no accelerator in config/accelerators.py for {name!r}: nothing to predict "
                         f"with; add its data sheet there")
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return accelerator, name, host_gib


def _train_command(recipe: str, overrides: list[str], seq_len: int, steps: int, host_gib: float) -> list[str]:
    """train.py on recipes/`recipe` with `overrides`, one row of `seq_len` tokens, `steps` steps, this machine's host
    memory: what the dry run plans and the run measures alike."""
    return [os.path.join(ROOT, "train.py"), os.path.join(ROOT, "recipes", recipe), *overrides, "--training.seq_len",
            str(seq_len), "--training.local_batch_size", "1", "--training.steps", str(steps),
            "--hardware.host_memory_gib", f"{max(host_gib, 1.0):.0f}"]


def dry_run(recipe: list[str], accelerator: str, folder: str) -> dict:
    """The recipe's first stage in dry_run.json (training/planning/dry_run.write_json), planned without a GPU."""
    _run("train.py --dry-run", [sys.executable, *recipe, "--dry-run", "--hardware.accelerator", accelerator,
                                 "--job.dump_folder", folder], env=child_env(CUDA_VISIBLE_DEVICES=""))
    with open(os.path.join(folder, "dry_run.json")) as f:
        return json.load(f)["stages"][0]


def measure_step(out: str, seq_len: int = STEP_SEQ_LEN, shape: dict = BENCH_SHAPE, steps: int = STEP_STEPS,
                 recipe: str = "debug.toml", overrides: list[str] | None = None, stage: dict | None = None,
                 note: str = "") -> dict:
    """The dry run's prediction and a real run of the same recipe, one rank, batch 1, bf16. Default: the debug
    recipe at `shape` with plain causal attention (the dry run measures document masking as causal, an upper bound,
    so causal is the case its memory is exact for). `stage`: the dry run's stage when the caller planned already.
    Prints the figures as one JSON line (report_summary.FIGURES) and returns them."""
    accelerator, name, host_gib = _device()
    if overrides is None:
        overrides = [*[arg for key, value in shape.items() for arg in (f"--model.{key}", str(value))],
                     "--training.dtype", "bfloat16", "--parallelism.dp_shard", "1", "--data.document_masking",
                     "false", "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1"]
    command = _train_command(recipe, overrides, seq_len, steps, host_gib)
    if stage is None:
        stage = dry_run(command, accelerator, os.path.join(out, "dry_run"))
    run_dir = os.path.join(out, "run")
    _run("train.py", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                      *command, "--job.dump_folder", run_dir], env=child_env())
    records = read_metrics(run_dir)
    figures = {
        "recipe": recipe, "shape": ", ".join(f"{key} {value}" for key, value in shape.items()), "seq_len": seq_len,
        "steps": steps, "accelerator": accelerator, "device": name, "note": note,
        "cpu_offload": stage.get("cpu_offload", False),
        "predicted_peak_gib": stage["predicted_peak_gib_per_rank"],  # the one predicted peak (cuda_path_table)
        "predicted_host_gib": stage.get("host_peak_gib_per_rank"),
        "predicted_pinned_gib": stage.get("host_pinned_gib_per_rank"),
        "predicted_step_s": stage["predicted_step_s"], "predicted_step_s_band": stage["predicted_step_s_band"],
        "measured_peak_gib": max(r["memory"] for r in records),
        "measured_host_gib": max((r["host_memory"] for r in records if "host_memory" in r), default=None),
        "measured_pinned_gib": max((r["offload_pinned_bytes"] / 2**30 for r in records
                                    if "offload_pinned_bytes" in r), default=None),
        "measured_step_s": statistics.median(r["step_time"] for r in records[1:] or records)}
    print(FIGURES + json.dumps(figures), flush=True)
    return figures


def pick_seq_len(predicted: dict[int, list[float]], left_s: float, steps: int = OFFLOAD_STEPS,
                 setup_s: float = OFFLOAD_SETUP_S) -> tuple[int | None, str]:
    """The longest length whose run fits `left_s` (set-up plus `steps` at the band's slow end x FIRST_STEP_SLACK),
    from the dry run's bands by length, and the line that says so; (None, why) when none fits."""
    for seq in sorted(predicted, reverse=True):
        need = setup_s + steps * predicted[seq][1] * FIRST_STEP_SLACK
        if need <= left_s:
            longest = max(predicted)
            why = "" if seq == longest else (f" ({longest:,} did not fit: its run needs "
                                             f"~{_need(predicted, longest, steps, setup_s)})")
            return seq, f"{seq:,} tokens: ~{need:.0f} s predicted of {left_s:.0f} s left{why}"
    return None, f"no length fits {left_s:.0f} s left: " + ", ".join(
        f"{seq:,} needs ~{_need(predicted, seq, steps, setup_s)}" for seq in sorted(predicted, reverse=True))


def _need(predicted: dict[int, list[float]], seq: int, steps: int, setup_s: float) -> str:
    return f"{setup_s + steps * predicted[seq][1] * FIRST_STEP_SLACK:.0f} s" if seq in predicted else "? s"


def offload_step(out: str, limit_s: float = OFFLOAD_LIMIT_S, lengths: tuple = OFFLOAD_SEQ_LENS,
                 shape_overrides: list[str] | None = None, steps: int = OFFLOAD_STEPS) -> int:
    """The report's offload step: the dry run at each length, longest first, until one fits the time left; then
    `measure_step` on it. `shape_overrides`: the CPU test's tiny model in place of the 3B one."""
    start = time.perf_counter()
    accelerator, _, host_gib = _device()
    overrides = OFFLOAD_OVERRIDES + (shape_overrides or [])
    stages: dict[int, dict] = {}
    chosen, line = None, ""
    for seq in lengths:
        stages[seq] = dry_run(_train_command(OFFLOAD_RECIPE, overrides, seq, steps, host_gib), accelerator,
                              os.path.join(out, f"dry_run_{seq}"))
        left = limit_s - (time.perf_counter() - start) - 5  # 5 s for the figures and the page
        chosen, line = pick_seq_len({s: st["predicted_step_s_band"] for s, st in stages.items()}, left, steps)
        if chosen is not None:
            break
    print(f"offload step: {line}", flush=True)
    if chosen is None:
        return 1
    measure_step(out, chosen, shape={"model": "llama3_2_3b"} if shape_overrides is None else {"model": "tiny"},
                 steps=steps, recipe=OFFLOAD_RECIPE, overrides=overrides, stage=stages[chosen], note=line)
    return 0
