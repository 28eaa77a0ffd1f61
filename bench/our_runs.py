"""Our trainer as the GPU benches run it (bench/bench_gpu.py, bench/bench_predictions.py): the bench shape's recipe
overrides, a train.py run that ends with every process it started when it outlives its limit, the dry run's
prediction for the same overrides (the accelerator a CUDA device's name maps to: config/accelerators.py)."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import tempfile

from harness import forked_launch
from harness.launch_env import ROOT, child_env
from harness.process_tree import end_process_group


def last_error(text: str) -> str:
    """The last line of a log that names an error (else its last line), shortened."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["no output"])[-1][-300:]


def our_overrides(args, out: str, documents: bool, compile_: str | None = None, float8: str = "off") -> list[str]:
    """The recipe overrides of our side: the bench shape on one GPU, bf16, no AC, attention masked by document or
    plain causal, training.compile `compile_` (default --compile). The dry run's prediction takes the same ones."""
    return [os.path.join(ROOT, "recipes", "debug.toml"), "--job.dump_folder", out,
            "--model.dim", str(args.dim), "--model.n_layers", str(args.n_layers), "--model.n_heads", str(args.n_heads),
            "--model.n_kv_heads", str(args.n_kv_heads), "--training.seq_len", str(args.seq),
            "--training.local_batch_size", str(args.batch), "--training.steps", str(args.steps),
            "--training.dtype", "bfloat16", "--parallelism.dp_shard", "1", "--data.document_masking",
            "true" if documents else "false", "--metrics.enable_tensorboard", "false", "--optimizer.lr", str(args.lr),
            "--training.compile", compile_ or args.compile, "--activation_checkpoint.mode", args.ac,
            "--training.float8", float8]


def run_in_session(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """The command's result (text output captured). Past `timeout` it is ended with every process it started
    (harness/process_tree.py: torchrun's ranks run in sessions of their own and would go on holding the GPU, and
    this pipe, during the runs after it), then subprocess.TimeoutExpired is raised."""
    with subprocess.Popen(cmd, env=env or child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_process_group(proc.pid)
            proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


DRY_RUN_PRELOAD = ("train", "training.planning.dry_run", "harness.forked_launch")
"""What the dry runs' server process imports once (~4.5 CPU-s of torch, DTensor and the trainer, more than half of a
bench-shape dry run): each dry run is a fresh child forked from it, as the tests' ranks are (tests/distributed.py)."""


def dry_run_stage(overrides, accelerator: str, timeout: float) -> dict:
    """dry_run.json's first stage for train.py with `overrides(dump_folder)` (the recipe and its overrides) on
    `accelerator`; RuntimeError with the dry run's last error line when it fails. The runs it predicts are GPU runs
    (hardware.device = "cuda"), planned as such wherever it runs: their host memory is a GPU node's, not this box's.
    Each dry run is a child of a server process that imported the trainer once (a forkserver: it never touched the
    caller's CUDA context, so a bench on a GPU may call this after its own GPU runs)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(DRY_RUN_PRELOAD))  # read when the server starts: the first call
    with tempfile.TemporaryDirectory() as out:
        argv = [*overrides(out), "--dry-run", "--hardware.accelerator", accelerator, "--hardware.device", "cuda"]
        log_path = os.path.join(out, "dry_run.log")
        child = ctx.Process(target=forked_launch.run_as_child, args=(0, argv, child_env(), ROOT, log_path, log_path))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join(5)
            raise subprocess.TimeoutExpired(["train.py", *argv], timeout)
        if child.exitcode:
            with open(log_path) as f:
                raise RuntimeError(last_error(f.read()))
        with open(os.path.join(out, "dry_run.json")) as f:
            return json.load(f)["stages"][0]
