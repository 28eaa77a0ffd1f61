"""`training.cpu_offload`: where it cannot serve, one line before any process group; and the FSDP2 policy it asks for,
pinned only where the run's device is CUDA (tests/training/test_cpu_offload_runs.py trains with it)."""
from __future__ import annotations

import pytest
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

import train
from config import RecipeError
from config.recipe import load_config
from parallelisms.data_parallel import offload_policy


@pytest.mark.parametrize("overrides, key", [
    (["--training.float8", "tensorwise"], "training.float8"),
    (["--parallelism.pp", "2", "--parallelism.dp_shard", "1"], "parallelism.pp"),
])
def test_offload_refuses_float8_and_pipelines_in_one_line(overrides, key, capsys):
    args = ["recipes/debug.toml", "--training.cpu_offload", "true", *overrides]
    with pytest.raises(RecipeError, match=f"training.cpu_offload = true .*{key}.* or cpu_offload = false"):
        load_config(args[0], args[1:])
    assert train.main(["--check", *args]) == 2  # before any process group: the launch check stops it
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "recipes/debug.toml" in err and key in err, err


def test_the_same_recipe_without_offload_is_accepted():
    load_config("recipes/debug.toml", ["--training.float8", "tensorwise"])
    load_config("recipes/debug.toml", ["--training.cpu_offload", "true"])


def test_policy_pins_host_memory_only_for_a_cuda_run():
    """pin_memory needs an accelerator: on a CPU-only torch CPUOffloadPolicy() fails at the first shard."""
    cuda, cpu = offload_policy(True, "cuda"), offload_policy(True, "cpu")
    assert isinstance(cuda, CPUOffloadPolicy) and cuda.pin_memory
    assert isinstance(cpu, CPUOffloadPolicy) and not cpu.pin_memory
    assert type(offload_policy(False, "cuda")) is OffloadPolicy
