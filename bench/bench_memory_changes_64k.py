"""The frontier's memory changes at 65,536 tokens: the real CPU peak drops as the dry run says.

    python bench/bench_memory_changes_64k.py ["tiled norms at 64K" | "attention head groups at 64K"]

The measurement of tests/training/test_memory_changes_peak.py (its fast-tier guard runs at 4K / 8K tokens), at the
length the frontier work is about: the debug model, 4 blocks, full checkpointing, fp32; tiled RMSNorms on one rank,
CP attention in K/V head groups on cp 2. Each change is measured without and with it, by the dry run (fake tensors,
a fake process group) and by a real gloo step (live storages of rank 0; tests/training/real_step_memory.py). Rows
are masked by document so that the CPU's attention costs only the visible pairs (minutes, not hours); the dry run
measures a one-document row, as it does for every recipe. Prints each peak, the two drops and their ratio; exits 1
when a drop differs from the dry run's by more than 10%.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.training.test_memory_changes_peak import AT_64K, peaks_without_and_with  # noqa: E402


def main(names: list[str]) -> int:
    worst = 0.0
    for name in names or list(AT_64K):
        start = time.time()
        fake, real = peaks_without_and_with(name, timeout=3600)
        predicted, measured = fake[0] - fake[1], real[0] - real[1]
        error = abs(measured - predicted) / predicted
        worst = max(worst, error)
        print(f"{name}: peaks MiB without / with: dry run {fake[0] / 2**20:.2f} / {fake[1] / 2**20:.2f}, real "
              f"{real[0] / 2**20:.2f} / {real[1] / 2**20:.2f}; drop predicted {predicted / 2**20:.2f} MiB, real "
              f"{measured / 2**20:.2f} MiB (real / predicted {measured / predicted:.3f}); {time.time() - start:.0f} s",
              flush=True)
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
