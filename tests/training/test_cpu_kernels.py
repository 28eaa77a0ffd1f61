"""No CPU kernel whose speed depends on the instruction set: the trainer's CPU steps run no oneDNN reference kernel.

torch hands some CPU ops to oneDNN only on CPUs with the right extensions (bf16 matmuls with AVX-512, float8 GEMMs
with AMX), and where oneDNN has no optimised kernel for the case it runs its reference implementation: on an AMX
CPU the float8 matmul was one (a 256^3 GEMM 275-490 ms, 340x the emulation), and the fast tier did not finish in 30
minutes there while it took 8 elsewhere. Timings cannot catch that on a CPU that takes the other path, so this runs
the trainer's CPU step variants with oneDNN's verbose log on and fails when a primitive ran on a `ref`
implementation for more than `REF_BUDGET_MS` in all: on a CPU without those extensions it passes whatever happens
(oneDNN is not asked), and on one with them it names the primitive and its cost. docs/testing.md lists what the
log showed on the box at hand.
"""
from __future__ import annotations

import os

import pytest

from tests.trainer_runs import ROOT, run_train

RECIPE = os.path.join(ROOT, "recipes", "debug.toml")
REF_BUDGET_MS = 1000.0
"""Reference-kernel time allowed per run (ms): a few tiny reorders may run on `ref` anywhere; a GEMM that does adds
seconds."""
STEP = ["--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--metrics.enable_tensorboard", "false"]
"""Two steps (the second after an optimizer update) of the debug model: every kernel of a step runs at least once."""


def reference_primitives(log: str) -> dict[str, float]:
    """oneDNN verbose `exec` lines whose implementation is a reference one: {'kind impl dtypes': total ms}. A line
    reads `onednn_verbose,v1,primitive,exec,cpu,<kind>,<impl>,<prop>,<memory descriptors>,...,<problem>,<ms>`."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        fields = line.split(",")
        if len(fields) < 9 or fields[0] != "onednn_verbose" or "exec" not in fields[1:4]:
            continue
        at = fields.index("exec")
        kind, impl = fields[at + 2], fields[at + 3]
        if impl.startswith("ref") or ":ref" in impl:
            key = f"{kind} {impl} {fields[at + 5].split(' ')[0]}"
            found[key] = found.get(key, 0.0) + float(fields[-1] or 0)
    return found


def test_the_reference_reader_reads_onednn_lines():
    """The reader against a line of the kind the AMX CPU printed for the float8 matmul, and an optimised one."""
    log = ("onednn_verbose,v1,primitive,exec,cpu,matmul,ref:any,undef,src:f8_e4m3::blocked:ab::f0 "
           "wei:f8_e4m3::blocked:ab::f0 dst:bf16::blocked:ab::f0,attr-scales:src0:0:f32,,256x256:256x256,412.5\n"
           "onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx512_core_amx,undef,src:bf16::blocked:ab::f0 "
           "wei:bf16::blocked:ab::f0 dst:bf16::blocked:ab::f0,,,256x256:256x256,0.05\n")
    assert reference_primitives(log) == {"matmul ref:any src:f8_e4m3::blocked:ab::f0": 412.5}


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    pytest.param(["--training.dtype", "bfloat16", "--training.float8", "rowwise", "--parallelism.dp_shard", "1"],
                 id="one-device-bf16-float8-rowwise"),
    pytest.param(["--training.dtype", "bfloat16", "--training.float8", "tensorwise", "--parallelism.dp_shard", "2"],
                 id="fsdp2-bf16-float8-tensorwise"),
])
def test_cpu_step_runs_no_reference_kernel(tmp_path, variant):
    """The one-device path (torch.autocast over float32 weights) and FSDP2's mixed precision, each with float8
    linear layers (`training.float8_emulate = "auto"`): bf16 matmuls, the float8 casts and the emulated GEMMs, the
    optimizer. Both in one run each, since every kernel of a step shows in the log. Slow tier since issue 56 (the fast
    tier runs in minutes; CI runs both): a trainer step per variant under oneDNN's verbose log, 19-25 s each; the
    dispatch count of float8 (test_float8_gemm_calls.py) stays fast."""
    nproc = int(variant[variant.index("--parallelism.dp_shard") + 1])
    result = run_train(RECIPE, *STEP, *variant, "--job.dump_folder", str(tmp_path), nproc=nproc, forked=True,
                       timeout=240, env={"ONEDNN_VERBOSE": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    found = reference_primitives(result.stdout + result.stderr)
    assert sum(found.values()) <= REF_BUDGET_MS, f"oneDNN reference kernels ran (ms): {found}"
