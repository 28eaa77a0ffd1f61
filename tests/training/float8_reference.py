"""The reference the float8 tests compare torchao with: a float64 copy of a model whose block linear layers run a
scaled matmul written here from the recipes' definitions (torchao's float8 config and kernels are not used): each
GEMM operand quantized to float8 with the recipe's scaling and dequantized, the product taken in float64 (and, for
the real rowwise kernel, rounded to its bf16 output; torchao's emulation, what a CPU runs, keeps it in float32).
`one_step_against_emulation` runs torchao's float8 step on a device against it, against the exact float64 model and
against bf16 (tests/training/test_float8.py on the CPU, tests/gpu/test_gpu_float8.py on a GPU)."""
from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn

from tests.trainer_runs import ROOT

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _quantized(x: torch.Tensor, dtype: torch.dtype, dim: int | None, power_of_2: bool) -> torch.Tensor:
    """x (float64) as the float8 `dtype` holds it, back in float64: scale = float8 max / max|x| over the tensor
    (dim None) or along `dim`, kept in float32 (rowwise: rounded down to a power of two), saturated cast."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    top = torch.finfo(dtype).max
    scale = (top / amax.clamp(min=1e-12)).float()
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scale = scale.double()
    return (x * scale).clamp(-top, top).to(dtype).double() / scale


class _ScaledMatmul(torch.autograd.Function):
    """y = x w^T with both operands float8-quantized, and the backward's two GEMMs likewise: tensorwise scales
    everywhere and an e5m2 output gradient; rowwise: a scale per row of each operand along the GEMM's reduced dim,
    e4m3 throughout. `kernel`: the float8 GEMM is `torch._scaled_mm` (not torchao's emulation), whose rowwise
    kernel writes each GEMM's output in bf16, so that output is rounded to bf16 here too."""

    @staticmethod
    def forward(ctx, x, weight, recipe, kernel):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.kernel = recipe, kernel
        rows = x.reshape(-1, x.shape[-1])
        out = _gemm(_q(rows, E4M3, 1, recipe) @ _q(weight, E4M3, 1, recipe).T, recipe, kernel)
        return out.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        recipe, kernel = ctx.recipe, ctx.kernel
        grad_dtype = E5M2 if recipe == "tensorwise" else E4M3
        grad_rows, rows = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = _gemm(_q(grad_rows, grad_dtype, 1, recipe) @ _q(weight, E4M3, 0, recipe), recipe, kernel)
        grad_w = _gemm(_q(grad_rows, grad_dtype, 0, recipe).T @ _q(rows, E4M3, 0, recipe), recipe, kernel)
        return grad_x.reshape(x.shape), grad_w, None, None


def _q(x, dtype, rowwise_dim, recipe):
    rowwise = recipe == "rowwise"
    return _quantized(x, dtype, rowwise_dim if rowwise else None, rowwise)


def _gemm(out, recipe, kernel):
    return out.to(torch.bfloat16).double() if recipe == "rowwise" and kernel else out


class _EmulatedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, recipe: str, kernel: bool):
        super().__init__()
        self.weight, self.recipe, self.kernel = linear.weight, recipe, kernel

    def forward(self, x):
        return _ScaledMatmul.apply(x, self.weight, self.recipe, self.kernel)


def emulated(model: nn.Module, recipe: str, kernel: bool) -> nn.Module:
    """A float64 copy of `model` with every block linear layer computed by `_ScaledMatmul` (`kernel`: as
    `torch._scaled_mm` computes it, rather than torchao's emulation)."""
    ref = copy.deepcopy(model).double()
    for name, module in list(ref.named_modules()):
        if name.startswith("layers.") and isinstance(module, nn.Linear):
            parent, child = name.rsplit(".", 1)
            setattr(ref.get_submodule(parent), child, _EmulatedLinear(module, recipe, kernel))
    return ref


def _loss_and_grads(model, tokens, labels) -> tuple[float, dict]:
    loss = F.cross_entropy(model(tokens).flatten(0, 1).double(), labels.flatten())
    loss.backward()
    return loss.item(), {name: p.grad.double() for name, p in model.named_parameters()}


@dataclasses.dataclass
class OneStep:
    """One step's losses and each parameter's relative (Frobenius) gradient distances."""
    loss: float  # torchao's Float8Linear, float32, on the device
    emulated_loss: float  # the float64 emulation (`emulated`, above), on the CPU
    bf16_loss: float  # the same model in bf16 without float8, on the device
    from_emulation: dict[str, float]  # torchao's gradients against the emulation's
    from_exact: dict[str, float]  # torchao's against the model's own in float64 without float8
    emulation_from_exact: dict[str, float]  # what float8 itself costs: the emulation against the same
    bf16_from_exact: dict[str, float]  # what bf16 costs: the bf16 model's gradients against the same


def one_step_against_emulation(recipe: str, device: torch.device) -> OneStep:
    """A 2-block debug model, one forward and backward: torchao's Float8Linear in float32 (its GEMM inputs the
    closest to the float64 emulation) on `device`, the float64 emulation and the float64 model without float8 on
    the CPU, and the model in bf16 on `device`. The reference rounds like the GEMM that runs on `device`
    (`training.float8_emulate = "auto"`: torchao's emulation on a CPU, `torch._scaled_mm` on CUDA)."""
    from config.recipe import load_config
    from models.llama import Llama, model_config
    from parallelisms.float8 import apply_float8, emulates

    torch.manual_seed(0)
    base = Llama(model_config("debug", n_layers=2))
    base.init_weights(0)
    tokens, labels = torch.randint(0, 2048, (2, 64)), torch.randint(0, 2048, (2, 64))
    float8 = copy.deepcopy(base)
    cfg = load_config(os.path.join(ROOT, "recipes", "debug.toml"), ["--training.float8", recipe])
    assert apply_float8(float8, cfg, fsdp=False, device_type=device.type) == 14  # 7 per block
    loss, grads = _loss_and_grads(float8.to(device), tokens.to(device), labels.to(device))
    kernel = not emulates(cfg, device.type)
    emulated_loss, emulated_grads = _loss_and_grads(emulated(base, recipe, kernel), tokens, labels)
    _, exact_grads = _loss_and_grads(copy.deepcopy(base).double(), tokens, labels)
    bf16_loss, bf16_grads = _loss_and_grads(copy.deepcopy(base).bfloat16().to(device), tokens.to(device),
                                            labels.to(device))

    def distances(a: dict, b: dict) -> dict[str, float]:
        return {name: ((a[name].cpu() - g).norm() / g.norm()).item() for name, g in b.items()}

    return OneStep(loss, emulated_loss, bf16_loss, distances(grads, emulated_grads), distances(grads, exact_grads),
                   distances(emulated_grads, exact_grads), distances(bf16_grads, exact_grads))
