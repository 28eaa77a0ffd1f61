"""Issue 57 item 6: torchrun forwards SIGTERM/SIGUSR1 to each rank's whole process group, which holds inductor's
compile workers (the SubprocPool sidecar that compiles Triton kernels on a GPU, and its pool). Unprotected, the
signal killed them and the next compile waited on a dead pool: a new shape between the signal and the save (step 1's
lazy backward, a ramp stage, an evaluation) never saved. The rank here is a process of its own session, as torchrun
starts each rank; its pool is torch's own (`AsyncCompile.process_pool`, forced on without triton, which the CPU
wheel lacks: the pool is the same code either way, Triton only decides whether torch warms it)."""
import os
import subprocess
import sys

import pytest

from harness.launch_env import child_env
from tests.trainer_runs import ROOT

RANK = """
import operator, os, signal, sys, time
from torch._inductor.async_compile import AsyncCompile
from training.preemption import StopSignals, start_compile_workers_deaf_to
stops = StopSignals(["SIGTERM", "SIGUSR1"])  # the trainer's handlers, first
if sys.argv[1] == "deaf":
    assert start_compile_workers_deaf_to(stops.names, triton=True)  # what the trainer does when it compiles
pool = AsyncCompile.process_pool()  # torch's own pool (warmed by its inductor backend at the first compile)
assert pool.submit(operator.mul, 6, 7).result(timeout=60) == 42
os.killpg(0, signal.SIGUSR1)  # torchrun's forward: the rank's whole process group
os.killpg(0, signal.SIGTERM)
time.sleep(2)
assert stops.received == "SIGUSR1", stops.received  # the rank still notes the first signal
print("compiled after the signals:", pool.submit(operator.mul, 6, 7).result(timeout=10), flush=True)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["deaf", "plain"])
def test_compile_workers_survive_the_signals_torchrun_forwards_to_the_rank(mode):
    done = subprocess.run([sys.executable, "-c", RANK, mode], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, start_new_session=True,
                          env=child_env(TORCHINDUCTOR_COMPILE_THREADS="2"))
    if mode == "deaf":
        assert done.returncode == 0 and "compiled after the signals: 42" in done.stdout, done.stderr[-3000:]
    else:  # torch's pool without the trainer's start: the signal killed it and the job waited (the defect)
        assert done.returncode != 0 and "TimeoutError" in done.stderr, done.stdout + done.stderr[-3000:]


def test_no_pool_is_started_where_torch_would_not_start_one():
    """Without triton (the CPU wheel) torch builds its C++ kernels from the rank's threads and starts no pool: the
    trainer starts none either (a sidecar process per rank for nothing)."""
    from training.preemption import start_compile_workers_deaf_to
    assert start_compile_workers_deaf_to(["SIGTERM"], triton=False) is False
