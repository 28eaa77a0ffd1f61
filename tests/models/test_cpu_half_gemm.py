"""bf16/fp16 GEMMs rerouted to float32 kernels on a CPU without native half GEMMs (models/cpu_half_gemm.py).

Checked against float64 products of the same half operands: the rerouted result is the exact product rounded once to
the half dtype (float32 accumulation: within one half-precision rounding plus float32's), for every op and layout the
trainer's linear layers and losses reach, forward and backward; float32 and other dtypes are untouched. Run in a
child process, since the kernels stay registered for the life of the process that installs them."""
import subprocess
import sys

import pytest

from harness.launch_env import child_env
from models.cpu_half_gemm import native_half_gemm
from tests.trainer_runs import ROOT

CHECKS = r"""
import torch
from models.cpu_half_gemm import _addmm, _baddbmm, _bmm, _mm, reroute_half_gemms

torch.manual_seed(0)
assert reroute_half_gemms("cuda") is None  # never on CUDA
a, b, bias = torch.randn(33, 70), torch.randn(70, 18), torch.randn(18)
A, B = torch.randn(3, 33, 70), torch.randn(3, 70, 18)
cases = [(_mm, torch.mm, (a, b), {}), (_addmm, torch.addmm, (bias, a, b), dict(beta=0.5, alpha=2.0)),
         (_bmm, torch.bmm, (A, B), {}), (_baddbmm, torch.baddbmm, (torch.randn(3, 33, 18), A, B), dict(beta=2.0))]
for dtype in (torch.bfloat16, torch.float16):
    eps = torch.finfo(dtype).eps
    for ours, theirs, args, scalars in cases:
        half = [t.to(dtype) for t in args]
        got = ours(*half, **scalars)
        exact = theirs(*(t.double() for t in half), **scalars)
        assert got.dtype == dtype and got.shape == exact.shape and got.is_contiguous()
        err = ((got.double() - exact).abs() / exact.abs().clamp(min=1.0)).max().item()
        assert err <= eps, (ours.__name__, dtype, err)
for ours, theirs, args, scalars in cases:  # float32: torch's own kernel, bit for bit
    assert torch.equal(ours(*args, **scalars), theirs(*args, **scalars)), ours.__name__
x = torch.randn(8, 70, dtype=torch.bfloat16, requires_grad=True)
linear = torch.nn.Linear(70, 18).bfloat16()
reference = [t.detach().clone().requires_grad_() for t in (x, linear.weight, linear.bias)]
installed = reroute_half_gemms("cpu")
print("installed" if installed is not None else "native")
linear(x).square().sum().backward()
out = torch.nn.functional.linear(*(t.double() for t in reference)).square().sum()
out.backward()
for got, want in zip((x.grad, linear.weight.grad, linear.bias.grad), reference):
    err = ((got.double() - want.grad) .abs() / want.grad.abs().max()).max().item()
    assert err <= 3e-2, err  # bf16 gradients of a bf16 layer against float64 ones
"""


def test_half_gemms_are_float32_products_rounded_once():
    result = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, cwd=ROOT,
                            env=child_env(OMP_NUM_THREADS="1"), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.strip() == ("native" if native_half_gemm() else "installed"), result.stdout


@pytest.mark.skipif(native_half_gemm(), reason="this CPU's torch has native bf16 GEMMs: nothing is rerouted here")
def test_a_bf16_linear_layer_reaches_the_float32_kernels():
    """Where the reroute is installed, a bf16 linear layer's forward and backward products (addmm forward, mm for
    each gradient) all go through its float32 path: counted as calls, not timed (a CPU's speed is no test)."""
    script = r"""
import torch
import models.cpu_half_gemm as half
calls = []
product = half._product
half._product = lambda op, *args, **kwargs: calls.append(str(op)) or product(op, *args, **kwargs)
lib = half.reroute_half_gemms("cpu")
x = torch.randn(8, 70, dtype=torch.bfloat16, requires_grad=True)
torch.nn.Linear(70, 18).bfloat16()(x).sum().backward()
print(sorted(calls))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                            env=child_env(OMP_NUM_THREADS="1"), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.strip() == "['aten.addmm.out', 'aten.mm.out', 'aten.mm.out']", result.stdout
