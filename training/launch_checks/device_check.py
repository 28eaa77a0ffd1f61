"""Fail fast on a machine that cannot run the recipe: a GPU-sized recipe without GPUs is one line, not a stuck or
swapping CPU job, and the line says how many GPUs it needs and how to check the plan here (--dry-run); so is an
attention kernel the GPU cannot run (cuDNN below SM 8.0, FA3/FA4 not installed or on the wrong GPU)."""
from __future__ import annotations

import math
import os

import torch

from config import RecipeError
from config.schema import Config
from models.llama import recipe_model_config
from parallelisms.cp.kernel_blocks import kernel_problem, module_installed
from training.planning.workload import parameter_count

GPU_SIZED_PARAMETERS = 1e9
"""With hardware.device = "auto", a model this large counts as GPU-sized (the 8B on CPU would not finish a step)."""


def needs_gpus(cfg: Config) -> bool:
    device = cfg.hardware.device
    if device != "auto":
        return device == "cuda"
    return parameter_count(recipe_model_config(cfg)) >= GPU_SIZED_PARAMETERS


def check_gpus(cfg: Config, world_size: int) -> None:
    """Raises RecipeError when the recipe needs GPUs this machine does not have (checked before torchrun)."""
    if not needs_gpus(cfg):
        return
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("NPROC") or world_size)
    per_node = cfg.hardware.gpus_per_node
    nodes = math.ceil(world_size / per_node)
    if visible >= local_ranks:
        return
    where = cfg.recipe_path
    plan = f"{world_size} GPUs ({nodes} node(s) x {min(world_size, per_node)})"
    have = "no GPU" if visible == 0 else f"{visible} GPU(s) for {local_ranks} local ranks"
    raise RecipeError(f"{where}: this recipe needs {plan} and this machine has {have}. Check the plan here with "
                      f"./run_train.sh {where} --dry-run ; on a cluster: sbatch --nodes={nodes} slurm/train.sbatch "
                      f"{where}")


def local_gpu() -> tuple[str, tuple[int, int] | None]:
    """(device type, compute capability) of the device this process would train on (its first GPU, else the CPU)."""
    if torch.cuda.is_available():
        return "cuda", tuple(torch.cuda.get_device_capability(0))
    return "cpu", None


def check_attention_kernel(cfg: Config) -> None:
    """Raises RecipeError when `[parallelism] attention_kernel` names a kernel this machine cannot run (checked
    before torchrun, so no process group starts)."""
    asked = cfg.parallelism.attention_kernel
    device_type, capability = local_gpu()
    problem = kernel_problem(asked, device_type, capability, torch.backends.cudnn.is_available(), module_installed)
    if problem:
        raise RecipeError(f"{cfg.recipe_path}: parallelism.attention_kernel = \"{asked}\" cannot run here: {problem}. "
                          f"Use \"auto\" (cuDNN on Hopper, FlashAttention-2 elsewhere) or \"flash\".")
