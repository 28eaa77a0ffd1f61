"""`./run_tests.sh --gpu --report DIR`: one command that checks a freshly booted, possibly air-gapped GPU node.

    WHEELS=DIR ./run_tests.sh --gpu --report [OUTDIR]   (WHEELS: optional, a folder of .whl files; OUTDIR: by
                                                         default bench/measurements/<gpu>_gpu_report_<date>)

In order, each step a process group of its own under a time limit (killed at the limit, then the next step runs):
  1. with WHEELS set, `python -m pip install --no-index --no-deps WHEELS/*.whl` into this interpreter: the pure-Python
     requirements an image may lack (torchdata, and TorchTitan's for the bench) from local files, no network;
  2. the compiled CP op (harness/gpu_compiled_op.py): two steps at CP 1 with documents and `auto` (cuDNN THD on an
     H100/H200) eager, compiled, and compiled under `op` activation checkpointing, against each other;
  3. every tests/gpu/test_gpu_*.py as its own pytest process (`-m gpu`, `-s`: what a test prints reaches the log as it
     happens), with pytest-timeout per test (thread method, so a hang dumps every thread's stack into the log before
     the process ends), so one hung or crashed file costs its own limit and the others still run; the files run in
     LANES lanes side by side on the GPU;
  4. the bench (bench/bench_gpu_report.py): our trainer eager, compiled and with documents at 8K and 64K on the
     bench shape beside the transformers loop (and TorchTitan where a release bench_gpu drives imports), one run
     each, in the order they settle, each started only while its estimated time fits the step's budget;
  5. the offload step (harness/gpu_measure_step.py): Llama 3.2 3B's shape with training.cpu_offload at 128K tokens
     (or the longest length that fits its limit, said so): the dry run's device and host peaks and step time
     against train.py on this GPU.
Each step's output goes to OUTDIR/<step>.log; OUTDIR/summary.md (harness/report_summary.py, from the logs alone) is
written again after every step, so a run cut short still leaves what it measured, and printed at the end. Exit 0 when
every step was ok. `python -m harness.gpu_report --fake OUTDIR` is the CPU twin: the same runner and summary over the
compiled-op step at a tiny shape (tests/test_gpu_report.py runs it in the fast tier). Without a visible GPU, run_tests.sh prints one line and exits 0
before this module runs.

The lone steps' limits and the longest lane's add up to TOTAL_LIMIT_S of wall time (9 minutes). The first H200 set
them (bench/measurements/h200_gpu_report_2026-12-04: one after another under the first guesses, 10 of 13 steps were
cut); the report's own table shows each step's seconds next to its limit, so the next node's numbers can set them.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from harness.gpu_measure_step import BENCH_SHAPE, OFFLOAD_LIMIT_S, measure_step, offload_step
from harness.launch_env import ROOT, child_env
from harness.process_tree import end_process_group
from harness.report_summary import FIGURES, FOOTER_EXIT, FOOTER_KILLED, HEADER, all_ok, parse_step, summarize

TOTAL_LIMIT_S = 540
"""The report's wall-clock bound: the steps that run alone, plus the longest lane of test files (below). 9 minutes
(issue 57's bound), so that one call fits a 15-minute GPU lease with the node's start; 8 before the bench at two
lengths and the 3B offload step replaced bench_gpu --short and the bench shape's 64K step."""
WHEELS_LIMIT_S = 15
"""Installing the wheel folder: two wheels (torchao, torchdata) took about 1 s on an H100 node; with
nvidia-cudnn-frontend's (11.6 MB) 9-10 s on an H200 (bench/measurements/h200_gpu_report_2026-12-04)."""
LANES = 4
"""The test files run in this many lanes side by side on the one GPU (each lane its files one after another, each
file its own process and limit): on the first H200 every file's pytest start and CUDA set-up took 10-12 s, and one
after another the files needed ~9 minutes of limits; in four lanes they took 3.5 minutes (that lease's second call).
They check numbers, not speed, and each measures its own process's memory, so sharing the GPU changes no verdict.
The steps that time things (the compiled op, the bench, the offload step) run alone."""
FILE_LIMIT_S = {"test_gpu_trainer.py": 170, "test_gpu_cp.py": 150, "test_gpu_cpu_offload.py": 85,
                "test_gpu_memory.py": 80, "test_gpu_documents_layout.py": 70, "test_gpu_float8.py": 70,
                "test_gpu_cudnn_thd.py": 45, "test_gpu_block_kernels.py": 30, "test_gpu_activation_offload.py": 25,
                "test_gpu_varlen.py": 25, "test_gpu_host_arena.py": 25}
"""Seconds per file, each with its pytest start and CUDA set-up (10-12 s). Measured on the first H200 in four lanes
(bench/measurements/h200_gpu_report_2026-12-04): trainer 127 s (five launches), cpu_offload 54 s and memory 47 s of
test, cudnn_thd + block_kernels + varlen 34 s together, activation_offload 15 s, host_arena 12 s. test_gpu_cp,
documents_layout and float8 did not finish there (their CP ranks run as threads over many small cases, whose cuDNN
graphs are built per shape; float8 compiles): their limits are estimates until a node has run them."""
DEFAULT_FILE_LIMIT_S = 25
NOT_IN_REPORT = {"test_gpu_tier_entry.py"}
"""The tier's entry checks: no cuda variants (they run in the fast tier, on machines without GPUs)."""
PER_TEST_MARGIN_S = 5
"""Each file's tests get its limit less this (GPU_TEST_LIMIT_S, tests/gpu/devices.py): pytest-timeout dumps the
stacks of a hung test before the file is ended."""
BENCH_LIMIT_S = 85
"""The bench step's limit; the bench gets BENCH_BUDGET_S of it and starts a run only while its estimate fits what is
left (bench/bench_gpu_report.py RUN_ESTIMATES: estimates from the first H200's launches, about 10 s of start and
CUDA set-up each, until a GPU has run this step). What is left of 540 s after the wheels (15), the compiled op (120),
the longest test lane (205) and the offload step (115): about the 8K runs (ours eager, transformers, documents,
compiled: ~85 s estimated); the 64K runs (~115 s more) and TorchTitan (~60 s) run where they fit, the rest are listed
as not run. The whole set: `python bench/bench_gpu_report.py` with no budget."""
BENCH_BUDGET_S = 78
"""BENCH_LIMIT_S less the interpreter's start, the peak-FLOP read and the last row's printing."""
COMPILED_OP_LIMIT_S = 120
"""Three one-rank launches of two steps at 8K tokens (eager, compiled, compiled under `op` AC): 98 s on the first
H200 with four test lanes beside it (compiles of 6.9 and 8.6 s); 70 s alone was not enough."""
COMPILED_OP_SEQ_LEN = 8192
FAKE_SHAPE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
FAKE_SEQ_LEN = 256
FAKE_COMPILED_OP_LIMIT_S = 180
"""The CPU twin's limit: inductor's cold C++ compile of the tiny block is most of its ~45 CPU-s, and a CI box runs
two other test workers beside it."""


@dataclass
class Step:
    name: str
    kind: str
    """pytest | wheels | compiled | bench | step: how report_summary reads its log."""
    command: list[str]
    limit_s: float
    lane: int | None = None
    """None: the step runs alone; a number: the test-file lane it runs in, beside the other lanes (LANES)."""
    env: dict | None = None
    """Variables the step's process gets on top of the report's."""


def lanes_of(limits: dict[str, float], lanes: int = LANES) -> dict[str, int]:
    """name -> lane: the longest first, each into the lane with the least time so far (the lanes end close together,
    so the report's bound is the longest lane, not the sum)."""
    load = [0.0] * lanes
    placed = {}
    for name in sorted(limits, key=lambda n: (-limits[n], n)):
        lane = min(range(lanes), key=lambda i: (load[i], i))
        placed[name] = lane
        load[lane] += limits[name]
    return placed


def wall_limit_s(steps: list[Step]) -> float:
    """The longest the plan can take: the lone steps' limits plus the longest lane's."""
    lanes: dict[int, float] = {}
    for step in steps:
        if step.lane is not None:
            lanes[step.lane] = lanes.get(step.lane, 0.0) + step.limit_s
    return sum(s.limit_s for s in steps if s.lane is None) + max(lanes.values(), default=0.0)


def gpu_test_files() -> list[str]:
    files = sorted(glob.glob(os.path.join(ROOT, "tests", "gpu", "test_gpu_*.py")))
    return [f for f in files if os.path.basename(f) not in NOT_IN_REPORT]


def plan(out_dir: str, wheels: list[str], fake: bool = False) -> list[Step]:
    """The steps in the order they run; the wheels step only when there are wheels. `fake`: the CPU twin's one step,
    the compiled op at a tiny shape."""
    steps = []
    if wheels:
        steps.append(Step("wheels", "wheels", [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                                               "--disable-pip-version-check", *wheels], WHEELS_LIMIT_S))
    steps.append(Step("compiled_op", "compiled", [sys.executable, "-m", "harness.gpu_report", "--compiled-op",
                                                   os.path.join(out_dir, "compiled_op"), *(["--fake"] if fake else [])],
                      FAKE_COMPILED_OP_LIMIT_S if fake else COMPILED_OP_LIMIT_S))
    if fake:
        return steps
    files = {os.path.basename(path): path for path in gpu_test_files()}
    limits = {name: FILE_LIMIT_S.get(name, DEFAULT_FILE_LIMIT_S) for name in files}
    lane_of = lanes_of(limits)
    for name in sorted(files, key=lambda n: (lane_of[n], -limits[n], n)):
        per_test = int(limits[name] - PER_TEST_MARGIN_S)  # below the file's: pytest-timeout dumps stacks first
        steps.append(Step(name, "pytest", [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-ra",
                                           "-s", f"--timeout={per_test}", "--timeout-method=thread",
                                           os.path.relpath(files[name], ROOT)], limits[name], lane_of[name],
                          {"GPU_TEST_LIMIT_S": str(per_test)}))
    shape = [arg for key, value in BENCH_SHAPE.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
    steps.append(Step("bench_gpu", "bench", [sys.executable, os.path.join("bench", "bench_gpu_report.py"),
                                             "--budget-s", str(BENCH_BUDGET_S), *shape], BENCH_LIMIT_S))
    steps.append(Step("offload_3b", "step", [sys.executable, "-m", "harness.gpu_report", "--offload-step",
                                             os.path.join(out_dir, "offload_3b")], OFFLOAD_LIMIT_S))
    return steps


def run_step(step: Step, log_path: str) -> str:
    """Runs one step in its own process group, its output into `log_path` between the runner's header and footer.
    At the limit the whole group (torchrun and its ranks too) is ended; so is whatever a step leaves behind when
    it ends (pytest-timeout's exit does not wait for a test's trainer processes), so that no step's processes hold
    the GPU during the next one."""
    with open(log_path, "w") as log:
        log.write(HEADER.format(name=step.name, kind=step.kind, limit=step.limit_s, command=" ".join(step.command))
                  + "\n")
        log.flush()
        start = time.perf_counter()
        process = subprocess.Popen(step.command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env=child_env(**(step.env or {})), start_new_session=True)
        try:
            rc = process.wait(timeout=step.limit_s)
            footer = FOOTER_EXIT.format(rc=rc, seconds=time.perf_counter() - start)
        except subprocess.TimeoutExpired:
            footer = FOOTER_KILLED.format(limit=step.limit_s, seconds=time.perf_counter() - start)
        end_process_group(process.pid)
        process.wait()
        log.write("\n" + footer + "\n")
    with open(log_path) as f:
        return f.read()


def compiled_op_step(out: str, fake: bool) -> int:
    """Step 2 (harness/gpu_compiled_op.py): its FIGURES line, then one line per failed bound or counter."""
    from harness.gpu_compiled_op import measure

    if fake:
        figures, failures = measure(out, FAKE_SEQ_LEN, FAKE_SHAPE, dtype="float32")
    else:
        figures, failures = measure(out, COMPILED_OP_SEQ_LEN, BENCH_SHAPE)
    print(FIGURES + json.dumps(figures), flush=True)
    for failure in failures:
        print(f"compiled op: {failure}", flush=True)
    return 1 if failures else 0


def report(out_dir: str, wheels: list[str], title: str, fake: bool = False) -> int:
    """Runs the plan: a lone step by itself, a run of lane steps as LANES threads side by side (each lane's files one
    after another); summary.md is written again as each step ends (steps in plan order), and printed at the end."""
    os.makedirs(out_dir, exist_ok=True)
    steps = plan(out_dir, wheels, fake)
    title += f"; logs in {out_dir}; limits {wall_limit_s(steps):.0f} s of wall time in all"
    print(f"GPU report: {title}", flush=True)
    logs: dict[int, str] = {}
    lock = threading.Lock()

    def run(index: int) -> None:
        step = steps[index]
        text = run_step(step, os.path.join(out_dir, f"{step.name}.log"))
        row = parse_step(text)
        with lock:
            logs[index] = text
            lane = "" if step.lane is None else f", lane {step.lane + 1}"
            print(f"[{index + 1}/{len(steps)}] {step.name}{lane}: {row.result} ({row.seconds:.0f} s of "
                  f"{step.limit_s:.0f})", flush=True)
            with open(os.path.join(out_dir, "summary.md"), "w") as f:
                f.write(summarize([logs[i] for i in sorted(logs)], title))

    index = 0
    while index < len(steps):
        if steps[index].lane is None:
            run(index)
            index += 1
            continue
        end = index
        while end < len(steps) and steps[end].lane is not None:
            end += 1
        by_lane: dict[int, list[int]] = {}
        for i in range(index, end):
            by_lane.setdefault(steps[i].lane, []).append(i)
        threads = [threading.Thread(target=lambda ids=ids: [run(i) for i in ids]) for ids in by_lane.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        index = end
    ordered = [logs[i] for i in sorted(logs)]
    print("\n" + summarize(ordered, title), end="")
    return 0 if all_ok(ordered) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--measure-step"] and len(argv) == 2:  # the bench shape's 64K step, by hand
        measure_step(argv[1])
        return 0
    if argv[:1] == ["--offload-step"] and len(argv) == 2:
        return offload_step(argv[1])
    if argv[:1] == ["--compiled-op"] and len(argv) in (2, 3) and argv[2:] in ([], ["--fake"]):
        return compiled_op_step(argv[1], fake=argv[2:] == ["--fake"])
    if argv[:1] == ["--fake"] and len(argv) == 2:
        import torch

        return report(os.path.abspath(argv[1]), [], f"CPU twin (--fake), torch {torch.__version__}", fake=True)
    if len(argv) > 1 or argv[:1] and argv[0].startswith("-"):
        print("usage: ./run_tests.sh --gpu --report [OUTDIR]   (WHEELS=DIR: install DIR/*.whl first; OUTDIR: "
              "bench/measurements/<gpu>_gpu_report_<date> by default)")
        return 2
    import torch

    if not torch.cuda.is_available():
        print(f"GPU report: no GPU visible to torch {torch.__version__}, so nothing ran")
        return 0
    wheels = []
    if os.environ.get("WHEELS"):
        wheels = sorted(glob.glob(os.path.join(os.path.abspath(os.environ["WHEELS"]), "*.whl")))
        if not wheels:
            print(f"GPU report: WHEELS={os.environ['WHEELS']} holds no .whl files: point WHEELS at the folder "
                  f"`pip download` wrote, or unset it")
            return 2
    title = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA "
             f"{torch.version.cuda}")
    import datetime

    out_dir = argv[0] if argv else default_report_folder(torch.cuda.get_device_name(), datetime.date.today())
    print(f"GPU report: writing {out_dir}", flush=True)
    return report(os.path.abspath(out_dir), wheels, title)


def default_report_folder(device_name: str, day, root: str = ROOT) -> str:
    """Where a report goes when no folder is named: bench/measurements/<gpu>_gpu_report_<date> (the GPU's model, e.g.
    h100 from "NVIDIA H100 80GB HBM3"), as the committed reports are named, with _2, _3 ... when that one exists:
    a second run on the same day keeps the first's figures."""
    words = [w for w in device_name.lower().replace("-", " ").split() if w not in ("nvidia", "tesla", "geforce")]
    base = os.path.join(root, "bench", "measurements", f"{words[0] if words else 'gpu'}_gpu_report_{day.isoformat()}")
    folder, n = base, 1
    while os.path.exists(folder):
        n += 1
        folder = f"{base}_{n}"
    return folder


if __name__ == "__main__":
    sys.exit(main())
