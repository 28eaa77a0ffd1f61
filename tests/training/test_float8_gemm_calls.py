"""Which float8 GEMM a CPU training step runs (parallelisms/float8.emulates): torchao's emulation under
`training.float8_emulate = "auto"`, never `torch._scaled_mm`, whose CPU kernel depends on the instruction set."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")  # pinned in requirements.txt: a missing torchao fails here (tests/conftest.py)

from config.recipe import load_config  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.trainer_runs import ROOT  # noqa: E402

RECIPE = os.path.join(ROOT, "recipes", "debug.toml")


def _config(*overrides: str):
    return load_config(RECIPE, list(overrides))


def _gemm_calls_body(rank, world_size, emulate):
    """One training step of the one-device bf16 path (autocast over float32 weights, the trainer's own parallelize,
    materialize and optimizer step) under a dispatch counter; returns {op: calls} for the matmul ops and the
    start-up line."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from models.llama import Llama, model_config
    from parallelisms.float8 import describe_float8
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.parallelize import materialize, parallelize
    from training.build import build_optimizer
    from training.step import optimizer_step

    class PlainTensorOps(TorchDispatchMode):
        """Counts the ops run on plain tensors. A call on torchao's float8 tensors is handed on (NotImplemented) to
        the subclass, whose own calls (`_scaled_mm`, or the emulation's `mm`) then come back here: a mode sees
        only the outer `aten.mm` otherwise, whichever GEMM runs inside."""

        def __init__(self):
            super().__init__()
            self.calls = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t not in (torch.Tensor, nn.Parameter) for t in types):
                return NotImplemented
            self.calls[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    cfg = _config("--training.float8", "tensorwise", "--training.float8_emulate", emulate, "--training.dtype",
                  "bfloat16", "--model.n_layers", "1")
    mesh = ParallelDims.resolve(1, 1, 1, 1, 1, world_size).build_mesh("cpu")
    with torch.device("meta"):
        model = Llama(model_config("debug", n_layers=1))
    model = parallelize(model, mesh, cfg)
    materialize(model, torch.device("cpu"), cfg, mesh)
    optimizer, scheduler = build_optimizer(cfg, [model])
    tokens = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    with PlainTensorOps() as counter:
        model(tokens).float().logsumexp(-1).sum().backward()
        optimizer_step(optimizer, scheduler, [model], float8=True)
    calls = {op: n for op, n in counter.calls.items() if op in ("aten.mm", "aten.addmm", "aten._scaled_mm")}
    return calls, describe_float8([model], cfg, "cpu")


def test_cpu_float8_step_makes_no_float8_gemm_call_under_auto():
    """`training.float8_emulate = "auto"` on a CPU: a training step's float8 GEMMs are torchao's emulation (plain
    matmuls of the dequantized operands), never `torch._scaled_mm`, whose CPU kernel depends on the instruction set
    (oneDNN's reference float8 matmul on a CPU with AMX: ~340x slower). A dispatch count, not a timing, so it holds
    on every CPU. With emulation off the same step calls `_scaled_mm` for each of the block's 7 float8 linear layers'
    3 GEMMs (forward, input gradient, weight gradient), which shows the counter sees it. The block is the debug
    model's (dims 256/768) and 16 tokens: the off case's 21 reference-kernel GEMMs cost ~1 s even on an AMX CPU."""
    emulated, line = run_ranks(_gemm_calls_body, world_size=1, args=("auto",), timeout=120)[0]
    assert "aten._scaled_mm" not in emulated and emulated.get("aten.mm", 0) >= 21, emulated
    assert line.endswith("GEMMs emulated (float8 casts, float32 matmul)"), line
    real, line = run_ranks(_gemm_calls_body, world_size=1, args=("false",), timeout=120)[0]
    assert real.get("aten._scaled_mm") == 21, real
    assert "training.float8_emulate = false" in line and "reference float8 matmul" in line, line
