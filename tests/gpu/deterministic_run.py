"""Runs a script (train.py under torchrun) with PyTorch's deterministic algorithms on, so two CUDA runs of the same
steps give the same bits, as CPU runs do anyway: by default the flash and memory-efficient attention backwards add dQ
up with atomics in whatever order the thread blocks finish, and cuBLAS needs a fixed workspace configuration.

    python -m torch.distributed.run ... tests/gpu/deterministic_run.py train.py [ARGS...]
"""
from __future__ import annotations

import os
import runpy
import sys

if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle exists
    import torch

    torch.use_deterministic_algorithms(True)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
