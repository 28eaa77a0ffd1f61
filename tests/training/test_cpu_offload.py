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


SMOLLM2_135M_16K_CP2 = ["--model.dim", "576", "--model.n_layers", "30", "--model.n_heads", "9", "--model.n_kv_heads",
                        "3", "--model.intermediate_size", "1536", "--model.vocab_size", "49152",
                        "--model.tie_embeddings", "tied", "--training.seq_len", "16384", "--training.local_batch_size",
                        "1", "--parallelism.cp", "2", "--parallelism.dp_shard", "1", "--hardware.device", "cpu",
                        "--hardware.host_memory_gib", "24"]
"""The issue's case: SmolLM2-135M's shape at 16K tokens under CP 2 without activation checkpointing on a 24 GiB box,
which the kernel's OOM killer stopped (26 GiB of live tensors and interpreters, measured by the dry run's probe)."""


def test_a_stage_over_the_boxs_memory_stops_before_torchrun_in_one_line(capsys):
    assert train.main(["--check", "recipes/debug.toml", *SMOLLM2_135M_16K_CP2]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "stage recipe (seq_len 16,384) needs" in err and "GiB of host memory per node (2 rank(s)" in err, err
    needed, have = (float(err.split(" needs ")[1].split(" GiB")[0]), float(err.split("the node has ")[1].split(" ")[0]))
    assert needed > have and have <= 24
    assert 'activation_checkpoint.mode = "full"' in err and "--dry-run" in err, err  # the cheapest fix, the plan


def test_a_debug_stage_passes_the_check_without_a_probe(monkeypatch):
    """Far below the box's memory: the launch check measures nothing (every CI run goes through it)."""
    from training.planning import memory_probe
    from training.launch_checks.host_memory import check_host_memory

    monkeypatch.setattr(memory_probe, "measure_memory", lambda *a, **k: pytest.fail("probed a debug stage"))
    check_host_memory(load_config("recipes/debug.toml"), 2)


def test_offload_price_is_the_host_adamw_and_three_shard_copies_per_micro_step():
    """By hand: 1e9 fp32 parameter shard elements (4 GB), 8 ranks sharing an H100 node's 614 GB/s of host memory at
    60-75% of it, 2 micro-steps over 64 GB/s PCIe at 75-85%."""
    from training.planning.offload_cost import offload_step_s

    cost = offload_step_s(4e9, 2, 8, "h100-sxm", 64e9, (0.75, 0.85))
    assert cost["host_optimizer"] == pytest.approx((28e9 / (614e9 / 8 * 0.75), 28e9 / (614e9 / 8 * 0.6)))
    assert cost["host_copies"] == pytest.approx((3 * 4e9 * 2 / (64e9 * 0.85), 3 * 4e9 * 2 / (64e9 * 0.75)))


def test_dry_run_proposes_the_offload_when_the_state_alone_does_not_fit():
    """A GPU whose usable memory is below the rank's training state: the proposed change is cpu_offload, handed back
    as a config for the dry run to measure (e.g. `--hardware.device_memory_gib 2.06 --parallelism.dp_shard 1` on the
    debug model: "checked with the same measurement: peak 0.03 GiB, fits")."""
    from training.planning.dry_run import PlanRow, RowResult, propose_fix
    from training.planning.memory_probe import GIB, RankMemory
    from training.launch_checks.preflight import preflight

    cfg = load_config("recipes/debug.toml", ["--activation_checkpoint.mode", "full", "--parallelism.dp_shard", "1"])
    memory = RankMemory(0.03 * GIB, 0.03 * GIB, 0.06 * GIB, 0.2 * GIB, 0.15 * GIB, None, (6,))
    result = RowResult(PlanRow("recipe", cfg), 1, preflight(cfg, 1), memory, {})
    advice, candidate = propose_fix(result, usable_gib=0.1)
    assert "training.cpu_offload = true" in advice and candidate.training.cpu_offload
    cfg.training.cpu_offload = True  # already offloaded: the next advice (more GPUs), nothing to re-measure
    advice, candidate = propose_fix(RowResult(PlanRow("recipe", cfg), 1, preflight(cfg, 1), memory, {}), 0.1)
    assert "cpu_offload" not in advice and candidate is None


def test_measured_host_rates_replace_the_published_ones():
    """bench/bench_rates.py --host's figures (the node's AdamW bytes/s, a GPU's copy bytes/s) price at their value."""
    from training.planning.offload_cost import offload_step_s

    cost = offload_step_s(4e9, 2, 8, "h100-sxm", 64e9, (0.75, 0.85), measured_host=400e9, measured_copy=50e9)
    assert cost["host_optimizer"] == pytest.approx((28e9 / 50e9, 28e9 / 50e9))
    assert cost["host_copies"] == pytest.approx((24e9 / 50e9, 24e9 / 50e9))
