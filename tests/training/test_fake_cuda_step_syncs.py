"""Issue 27, acceptance 1 on fake CUDA: the trainer's micro-step at cp 2 x dp 2 with documents and placement by work
makes 0 host syncs. Every rank's micro-batches and plans come from the trainer's loader path (placement and the
documents plan made by the step loader's collate function); each micro-step (`step.move_batch` to "cuda",
`step.micro_step`, the per-micro-step metric) runs the CUDA path (bf16: varlen flash calls) on fake CUDA tensors with
a real autograd backward, under a fake process group of 4 ranks (training/planning/step_sync_probe.py). A device-to-host copy
or a `_local_scalar_dense` there would be the host waiting for the GPU.

Outside the micro-step and not counted here: `Trainer.train_step` reads the loss and the grad norm back once per
optimizer step (`loss.item()`, `float(grad_norm)`, for the finite-loss check and the log); gradient clipping itself
makes none (asserted below)."""
import json
import os
import subprocess
import sys

import pytest

from harness.launch_env import child_env
from tests.trainer_runs import ROOT

pytestmark = pytest.mark.timeout(300)


def test_counter_on_a_device_run_ignores_scalar_reads_of_host_tensors():
    """Plans keep host integers (Ulysses' exchange plan reads them with int()): no wait for the device there."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    from training.planning.fake.counter import DispatchCounter

    with FakeTensorMode():
        device = torch.empty(3, device="cuda")
        with DispatchCounter() as syncs:
            with unset_fake_temporarily():  # as the exchange plans make their host integers
                int(torch.arange(3)[1])
            device.cpu(), device.sum()
    assert syncs.counts == {"device_to_host": 1}
    with DispatchCounter(strict=True) as syncs:
        int(torch.arange(3)[1])
    assert syncs.counts == {"_local_scalar_dense": 1}


FIXED_LAYOUT_MESHES = {  # name: the probe's overrides (documents on, zigzag instead of the documents layout)
    "ring cp2 x dp2": ["--parallelism.cp_impl", "ring"],
    "ulysses cp2 x dp2": ["--parallelism.cp_impl", "ulysses"],
    "hybrid cp4": ["--parallelism.cp", "4", "--parallelism.dp_shard", "1", "--parallelism.cp_impl", "hybrid"],
}
PROBES = {  # name: overrides of tests/training/fake_cuda_step_ranks.py's run (bf16 on every one)
    "documents cp2 x dp2": [],
    "cp1 zigzag": ["--parallelism.cp", "1", "--parallelism.dp_shard", "4", "--parallelism.cp_load_balancer", "zigzag"],
    **{name: ["--parallelism.cp_load_balancer", "zigzag", *overrides]
       for name, overrides in FIXED_LAYOUT_MESHES.items()},
}
PROBES_LIMIT_S = 800
"""The five probes' one process (a hang guard): 32 CPU-s alone at the probes' 2 blocks (70 at the debug model's 6;
99 as five processes); each probe had 270 s in a process of its own."""
_RUN_PROBES = """import json, sys
from tests.training.fake_cuda_step_ranks import main
print(json.dumps({name: main(["--training.dtype", "bfloat16", *overrides])
                  for name, overrides in json.loads(sys.argv[1]).items()}))"""


@pytest.fixture(scope="module")
def probes() -> dict:
    """{probe name: its per-rank record, keyed "0".."3"}: tests/training/fake_cuda_step_ranks.py's main (the trainer's
    micro-steps on 4 fake-CUDA ranks, one rank after another) for every probe of PROBES, one after another in one
    process with the fake CUDA runtime preloaded (each probe makes and ends its own fake process group per rank): one
    interpreter's imports instead of five (~4 CPU-s each). Skipped where the fake CUDA runtime cannot be built."""
    from training.planning.fake.cuda import fake_cuda_env

    try:
        env = fake_cuda_env(child_env())
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot build the fake CUDA runtime ({type(e).__name__})")
    result = subprocess.run([sys.executable, "-c", _RUN_PROBES, json.dumps(PROBES)], capture_output=True, text=True,
                            timeout=PROBES_LIMIT_S, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(records) == sorted(PROBES)
    for per_rank in records.values():
        assert sorted(per_rank) == ["0", "1", "2", "3"]
    return records


@pytest.mark.slow
@pytest.mark.timeout(PROBES_LIMIT_S + 60)  # the first test of the file runs the probes' fixture
def test_trainer_micro_step_on_fake_cuda_at_cp2_dp2_with_documents_and_placement_makes_no_host_sync(probes):
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): a 4-rank trainer micro-step on fake CUDA,
    run with the file's other probes in one process (the `probes` fixture)."""
    per_rank = probes["documents cp2 x dp2"]
    print({rank: (r["counts"], r["micro_steps"]) for rank, r in per_rank.items()})
    for record in per_rank.values():
        assert record["counts"] == {}, record["places"]
        assert record["stopped"] is None, record
        assert record["micro_steps"] == 2
        # the step really ran the CUDA path: varlen flash calls forward and backward, not the CPU kernels
        calls = record["attention_calls"]
        assert calls.get("aten._flash_attention_forward.default", 0) > 0, calls
        assert calls.get("aten._flash_attention_backward.default", 0) > 0, calls
        assert not any("for_cpu" in name for name in calls), calls
        assert record["clip_counts"] == {}


@pytest.mark.slow
@pytest.mark.timeout(PROBES_LIMIT_S + 60)
def test_at_cp1_the_probe_runs_the_trainers_packed_plan_whatever_the_load_balancer(probes):
    """Issue 50: the probe builds its loader with the trainer's own function (training/batch_plans
    stage_step_loader). Its former copy planned documents only for the documents load balancer, so at CP 1 with
    zigzag the micro-step planned the packed form itself from device ids and the probe reported a device-to-host
    copy that the trainer, whose loader makes that plan on the host, never makes. Now: no sync, and one packed
    varlen call per layer forward and backward (the probes' 2 layers: fake_cuda_step_ranks.RUN) on every rank. Slow tier since issue 56 (the
    fast tier runs in minutes; CI runs both): the probe's packed plans on fake CUDA ranks
    (the `probes` fixture's process)."""
    per_rank = probes["cp1 zigzag"]
    for record in per_rank.values():
        assert record["counts"] == {} and record["stopped"] is None, record
        assert record["attention_calls"] == {"aten._flash_attention_forward.default": 2,
                                             "aten._flash_attention_backward.default": 2}, record


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FIXED_LAYOUT_MESHES))
@pytest.mark.timeout(PROBES_LIMIT_S + 60)
def test_a_fixed_layout_with_documents_reads_no_device_tensor_back(name, probes):
    """Issue 57, item 5: with document masking on a fixed layout (zigzag here) the data workers hand the batch its
    ids on the host (cp/plan_host.HostDocumentIds) and the step cuts every rank's pieces from them. Before, the
    first layer read the ids back from the device (`torch.stack(...).cpu()` in plan_pieces.py): one
    device-to-host copy per micro-step (measured on this probe: {"device_to_host": 1} on every rank for ring and
    Ulysses; hybrid also stopped at its exchange plan's host integers, computed on fake tensors). Now none, and the
    step runs to its end through the CUDA varlen kernels. Slow tier (a 4-rank probe on fake CUDA each, in the
    `probes` fixture's one process)."""
    per_rank = probes[name]
    for record in per_rank.values():
        assert record["counts"] == {} and record["stopped"] is None, record
        calls = record["attention_calls"]
        assert calls.get("aten._flash_attention_forward.default", 0) > 0, calls
        assert calls.get("aten._flash_attention_backward.default", 0) > 0, calls


def test_fake_cuda_libraries_are_cached_per_torch_installation(tmp_path, monkeypatch):
    """The fake CUDA libraries link to one torch by rpath: a cache keyed by torch's version alone handed a second
    checkout (another .venv, same version) a library pointing at the first's torch, and after that checkout was
    deleted every fake-CUDA test failed with "libc10.so: cannot open shared object file". The builder is run for two
    torch installations of one version (the compiler stubbed: it records its command and writes the output): each
    gets its own library, linked with an rpath to its own library folder, and a second build of one is the cache's."""
    import training.planning.fake.cuda as fake_cuda

    commands = []

    def compile_(command, **kwargs):
        commands.append(command)
        open(command[command.index("-o") + 1], "w").close()
    monkeypatch.setattr(fake_cuda.subprocess, "run", compile_)
    monkeypatch.setattr(fake_cuda.tempfile, "gettempdir", lambda: str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    built = {}
    for venv in ("venv-a", "venv-b", "venv-a"):
        monkeypatch.setattr(fake_cuda.torch, "__file__", str(tmp_path / venv / "torch" / "__init__.py"))
        built.setdefault(venv, set()).add(fake_cuda.build_torch_library("lib", "src", ["c10"]))
    assert len(built["venv-a"]) == 1 and built["venv-a"] != built["venv-b"], built
    assert len(commands) == 2, commands  # venv-a's second build came from the cache
    rpaths = [next(arg for arg in c if arg.startswith("-Wl,-rpath,")) for c in commands]
    assert rpaths == [f"-Wl,-rpath,{tmp_path / venv / 'torch' / 'lib'}" for venv in ("venv-a", "venv-b")]
