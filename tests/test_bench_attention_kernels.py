"""bench/bench_attention_kernels.py without a GPU: the same code on CPU kernels (one family, flash-CPU) prints every
call's cell side by side, plain and documents, and the ring / SDPA lines the GPU report summarizes."""
import os
import subprocess
import sys

from harness.launch_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_kernel_table_runs_on_cpu_and_names_every_call():
    result = subprocess.run([sys.executable, os.path.join("bench", "bench_attention_kernels.py"), "--seqs", "256,512",
                             "--reps", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "32"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=child_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    table = {line.split("  ")[0].strip(): line.split()[-4:] for line in lines
             if line.startswith(("SDPA", "block, ", "ring at CP=1, "))}
    assert set(table) == {"SDPA", "block, flash", "ring at CP=1, flash"}, result.stdout
    assert table["SDPA"][1] == table["SDPA"][3] == "-"  # no documents column for SDPA
    assert all(float(cell) > 0 for cell in table["ring at CP=1, flash"]), table  # plain and documents, both lengths
    ratios = [line for line in lines if line.startswith("ring at CP=1 / SDPA")]
    assert len(ratios) == 2 and all("kernel flash" in line and "packed documents / plain" in line for line in ratios)
