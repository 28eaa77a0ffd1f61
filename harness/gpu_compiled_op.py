"""The GPU report's first step: the compiled CP op as a GPU user runs it, settled before anything else.

    python -m harness.gpu_report --compiled-op OUTDIR

`training.compile = true` compiles each whole block with context-parallel attention as the registered op pair
(parallelisms/cp/op.py); with packed documents at CP 1 and `attention_kernel = "auto"` the op's body runs cuDNN's THD
call on an H100/H200 (FlashAttention's varlen ops elsewhere). No GPU has run that yet, so this step comes first in
the report: three runs of the same two steps of one rank (the report's bench shape, documents masked, bf16):
  - eager, the reference;
  - compiled, AC none: each step's loss and grad norm within COMPILED_BOUND of eager's, one graph per block kind
    built in step 1 and none after it, no graph break;
  - compiled with `op` activation checkpointing: the same bounds and counters (the checkpoint stays eager around the
    compiled block, its policy saving the CP op's output and every other matmul: activation_checkpoint.py).
It prints one FIGURES line (harness/report_summary.py renders it) and exits 1 when a bound or a counter fails, after
printing the figures. `measure(..., device_type="cpu")` is the same code on the CPU at a tiny shape
(tests/test_gpu_report.py), so its plumbing cannot rot where no GPU is.
"""
from __future__ import annotations

import os
import subprocess
import sys

from harness.launch_env import ROOT, child_env
from training.metrics import read_metrics

COMPILED_BOUND = 1e-3
"""Relative, per step, loss and grad norm of a compiled run against eager, bf16: inductor fuses the norms and the
residual adds, skipping eager's bf16 roundings of their intermediates (on the CPU: 1.0e-4 over 3 steps of the debug
model, tests/training/test_float8_runs.py's compile test; 2 steps here)."""
STEPS = 2
"""Step 1 compiles; step 2 is the first that could compile again (a new document plan, a failed guard)."""
RUNS = {
    "eager": ["--training.compile", "false"],
    "compiled": ["--training.compile", "true"],
    "compiled, op AC": ["--training.compile", "true", "--activation_checkpoint.mode", "op"],
}


def _train(what: str, args: list[str], out: str) -> list[dict]:
    """One run on one rank under torchrun (as run_train.sh starts it); its metrics.jsonl records. A failure ends the
    step in one line (the run's own output is above it in the log)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *args,
               "--job.dump_folder", out]
    done = subprocess.run(command, cwd=ROOT, env=child_env())
    if done.returncode:
        raise SystemExit(f"compiled op: the {what} run failed (exit {done.returncode}); its output is above")
    return read_metrics(out)


def _max_relative(records: list[dict], reference: list[dict], key: str) -> float:
    return max(abs(r[key] - ref[key]) / abs(ref[key]) for r, ref in zip(records, reference))


def measure(out: str, seq_len: int, shape: dict, dtype: str = "bfloat16") -> tuple[dict, list[str]]:
    """The three runs; returns (figures, failures): failures name each bound or counter that does not hold."""
    recipe = [os.path.join(ROOT, "train.py"), os.path.join(ROOT, "recipes", "debug.toml"),
              *[arg for key, value in shape.items() for arg in (f"--model.{key}", str(value))],
              "--training.seq_len", str(seq_len), "--training.local_batch_size", "1", "--training.dtype", dtype,
              "--parallelism.dp_shard", "1", "--data.document_masking", "true",
              "--parallelism.attention_kernel", "auto", "--training.steps", str(STEPS), "--metrics.log_freq", "1",
              "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1"]
    runs = {name: _train(name, recipe + extra, os.path.join(out, name.replace(", ", "_").replace(" ", "_")))
            for name, extra in RUNS.items()}
    eager = runs["eager"]
    figures = {"kind": "compiled_op", "shape": ", ".join(f"{k} {v}" for k, v in shape.items()), "seq_len": seq_len,
               "dtype": dtype, "steps": STEPS, "documents_kernel": eager[-1].get("documents_kernel", "-"),
               "bound": COMPILED_BOUND, "runs": {}}
    failures = []
    for name, records in runs.items():
        row = {"loss": [r["loss"] for r in records], "peak_gib": max(r["memory"] for r in records),
               "step_s": records[-1]["step_time"]}
        if name != "eager":
            row["loss_rel"] = _max_relative(records, eager, "loss")
            row["grad_norm_rel"] = _max_relative(records, eager, "grad_norm")
            first, last = records[0]["compile"], records[-1]["compile"]
            row.update(graphs=last["unique_graphs"], graph_breaks=sum(last["graph_breaks"].values()),
                       first_step_s=last.get("first_step_s"))
            if max(row["loss_rel"], row["grad_norm_rel"]) > COMPILED_BOUND:
                failures.append(f"{name}: loss {row['loss_rel']:.1e} / grad norm {row['grad_norm_rel']:.1e} "
                                f"from eager, bound {COMPILED_BOUND:.0e}")
            if row["graph_breaks"] or last["unique_graphs"] != first["unique_graphs"]:
                failures.append(f"{name}: {row['graph_breaks']} graph break(s), graphs {first['unique_graphs']} "
                                f"after step 1 and {last['unique_graphs']} after step {STEPS}")
        figures["runs"][name] = row
    return figures, failures
