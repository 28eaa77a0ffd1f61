"""Float8 numerics on a real GPU (issue 38: "numerics within the CPU bounds"): the debug model's one step with
torchao's Float8Linear on CUDA, whose `torch._scaled_mm` is the Hopper float8 GEMM, against the float64 emulation of
the recipe's scaled matmuls (tests/training/float8_reference.py, on the CPU), against the same model in float64
without float8, and against the same step in bf16.

Measured on one H100 (torch 2.11, torchao 0.18), with torchao's recipes (fast accumulation in the forward GEMM) /
with the forward's fast accumulation turned off (measured once, to rule it out):
- loss against the emulation: 1.6e-6 / 1.2e-6 tensorwise, 3.0e-6 / 1.6e-6 rowwise (held to 1e-4; the CPU to 1e-6);
  against bf16 8e-5 and 7e-5 (the CPU test's bound, 1e-3).
- gradients against the emulation: worst parameter 3.6e-2 / 3.3e-2 tensorwise, 1.9e-2 / 1.9e-2 rowwise, where the
  CPU's float32 torchao is 3e-4 (FLOAT8_GRAD_BOUND 1e-3). The Hopper GEMM does not reproduce the emulation's
  roundings: its products and accumulation are not the CPU's float32 ones, and this step's attention-side gradients
  amplify small differences (float32 on the CPU is already 3e-4 from float64 here, where bf16 is 0.9e-2).
- what that costs: each parameter's gradient distance from the exact float64 gradient (no float8) is at most 1.058x
  the emulation's (float8 itself: 10.1% tensorwise, 7.7% rowwise from exact). `FROM_EXACT_RATIO` bounds that; the
  CPU test holds the same ratio (measured 1.00001).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")  # pinned in requirements.txt: a missing torchao fails here (tests/conftest.py)

from tests.gpu.devices import CUDA_ONLY, require  # noqa: E402
from tests.training.float8_reference import one_step_against_emulation  # noqa: E402
from tests.training.test_float8 import FROM_EXACT_RATIO  # noqa: E402

FROM_EMULATION_BOUND = 6e-2
"""Worst parameter's relative gradient distance, GPU float8 against the float64 emulation (measured 3.6e-2)."""


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("device", CUDA_ONLY)
def test_one_step_on_the_gpu_matches_float64_emulation(device, recipe):
    dev = require(device)
    if torch.cuda.get_device_capability(dev) < (8, 9):
        pytest.skip("float8 GEMMs need compute capability 8.9 or newer (H100, L4, ...)")
    step = one_step_against_emulation(recipe, dev)
    worst = {key: max(getattr(step, key).values()) for key in ("from_emulation", "from_exact", "emulation_from_exact",
                                                            "bf16_from_exact")}
    ratio = max(step.from_exact[k] / step.emulation_from_exact[k] for k in step.from_exact)
    print(f"\n{recipe}: loss {step.loss:.7f}, emulated {step.emulated_loss:.7f}, bf16 "
          f"{step.bf16_loss:.7f}; worst gradient distance {worst}; worst ratio from exact {ratio:.3f}")
    print({k: (round(step.from_emulation[k], 5), round(step.from_exact[k], 5), round(step.emulation_from_exact[k], 5))
           for k in step.from_exact})
    assert abs(step.loss - step.emulated_loss) <= 1e-4 * step.emulated_loss, step
    assert abs(step.loss - step.bf16_loss) <= 1e-3 * step.bf16_loss, step
    assert worst["from_emulation"] <= FROM_EMULATION_BOUND, step.from_emulation
    assert ratio <= FROM_EXACT_RATIO, (step.from_exact, step.emulation_from_exact)
