"""The dry run: memory measured on a fake process group against independent references, the roofline against
closed-form counts, and the launcher's behaviour (table, named fix, fail-fast without GPUs)."""
import concurrent.futures
import os
import re
import subprocess
import sys
import time

import pytest

from harness.launch_env import child_env
from tests.distributed import forked_train, fresh_process_context

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2**30


def _in_fresh_process(fn, *args, timeout=240):
    """Each probe initialises its own (fake) default process group: keep it out of the pytest process."""
    ctx = fresh_process_context()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)


def _debug_cfg(*overrides):
    from config.recipe import load_config

    return load_config(os.path.join(ROOT, "recipes", "debug.toml"), list(overrides))


def _probe(overrides, world, mode):
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    from training.planning.memory_probe import measure_memory, measure_rank

    cfg = _debug_cfg(*overrides)
    if mode == "full":
        return vars(measure_rank(cfg, world))
    return vars(measure_memory(cfg, world, cfg.model.n_layers, extrapolate_above=0))


def _meta_parameter_count(name, n_layers):
    import torch

    from models.llama import Llama, count_parameters, model_config

    with torch.device("meta"):
        return count_parameters(Llama(model_config(name, n_layers=n_layers)))


def test_persistent_state_is_the_closed_form_fsdp_shard():
    """FSDP over 2 ranks, fp32: each rank holds half of every parameter, its gradient and two AdamW moments."""
    memory = _in_fresh_process(_probe, ["--model.n_layers", "2", "--training.seq_len", "128"], 2, "full")
    n = _meta_parameter_count("debug", 2)
    assert memory["params"] == pytest.approx(4 * n / 2, rel=1e-3)
    assert memory["grads"] == pytest.approx(4 * n / 2, rel=1e-3)
    assert memory["optimizer"] == pytest.approx(8 * n / 2, rel=1e-3)  # + one 4-byte step counter per tensor


@pytest.mark.slow
def test_two_depths_extrapolate_exactly_to_the_full_depth():
    """CP 2 x FSDP 2, bf16: measuring 3, 4 and 5 blocks predicts 8 (memory peaks and the ring's bytes), and the
    evaluation's peak, measured at 3 and 4 blocks only (memory_probe._eval_on_state_line), predicts it too. Slow tier
    since issue 56 (the fast tier runs in minutes; CI runs both): probes at 3, 4, 5 and 8 blocks, 42 s."""
    overrides = ["--model.n_layers", "8", "--parallelism.cp", "2", "--parallelism.dp_shard", "2",
                 "--training.dtype", "bfloat16", "--training.seq_len", "256", "--training.local_batch_size", "2",
                 "--eval.long_doc_loss", "true"]
    full = _in_fresh_process(_probe, overrides, 4, "full")
    line = _in_fresh_process(_probe, overrides, 4, "extrapolated")
    assert line["blocks_measured"] == (3, 4)  # 5 checked the line
    assert full["peak_eval"] > 0
    for key in ("params", "grads", "optimizer", "peak_forward_backward", "peak_optimizer_step", "cp_ring_bytes",
                "peak_eval"):
        assert line[key] == pytest.approx(full[key], rel=1e-9), key
    # The ring's own closed form: per block, K/V go (P - 1) hops forward and backward, float32 dK/dV P hops.
    # The evaluation (one row, forward only) sends its K/V (P - 1) hops once; the probe counts it in cp_ring_bytes.
    kv = 2 * 2 * (256 // 2) * 16 * 16 * 2  # K + V: batch 2, 128 local tokens, 16 kv heads, head_dim 16, bf16
    assert full["eval_ring_bytes"] == line["eval_ring_bytes"] == 8 * kv // 2
    assert full["cp_ring_bytes"] - full["eval_ring_bytes"] == 8 * (kv + kv + 2 * 2 * kv)


SMALL = ["--model.n_layers", "2", "--training.seq_len", "256", "--training.local_batch_size", "2"]
PREDICTED_MESHES = {  # name: (recipe overrides, world size)
    "1 rank fp32": (["--parallelism.dp_shard", "1"], 1),
    "fp32 dp_shard2": (["--parallelism.dp_shard", "2"], 2),
    "bf16 dp_shard2": (["--parallelism.dp_shard", "2", "--training.dtype", "bfloat16"], 2),
    "fp32 cp2 ring": (["--parallelism.dp_shard", "1", "--parallelism.cp", "2", "--parallelism.cp_impl", "ring"], 2),
    "bf16 dp_shard2 x cp2 full AC": (["--parallelism.dp_shard", "2", "--parallelism.cp", "2", "--training.dtype",
                                      "bfloat16", "--activation_checkpoint.mode", "full"], 4),
    "fp32 tp2": (["--parallelism.dp_shard", "1", "--parallelism.tp", "2"], 2),
    "fp32 cp2 ulysses documents": (["--parallelism.dp_shard", "1", "--parallelism.cp", "2", "--parallelism.cp_impl",
                                    "ulysses", "--data.document_masking", "true"], 2),
}


def _fake_peaks(names):
    """The dry run's measurement of every mesh, one after another in this one process (each its own fake group)."""
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    from training.planning.memory_probe import measure_rank

    out = {}
    for name in names:
        overrides, world = PREDICTED_MESHES[name]
        out[name] = measure_rank(_debug_cfg(*SMALL, *overrides), world).peak
    return out


def _real_peaks(rank, world, names):
    """run_ranks body: the same recipes on real tensors and gloo, every mesh of this world size in one launch."""
    from tests.training.real_step_memory import real_step_peaks

    return {name: real_step_peaks(_debug_cfg(*SMALL, *PREDICTED_MESHES[name][0]), world) for name in names}


@pytest.fixture(scope="module")
def predicted_and_real():
    """{mesh: (dry-run peak, real peak of rank 0)}: one fresh process for the dry run's measurements, running while
    the real launches (one per world size: 1, 2 and 4 ranks) do."""
    from tests.distributed import run_ranks

    ctx = fresh_process_context()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        fake = pool.submit(_fake_peaks, list(PREDICTED_MESHES))
        real = {}
        for world in sorted({w for _, w in PREDICTED_MESHES.values()}):
            names = [n for n, (_, w) in PREDICTED_MESHES.items() if w == world]
            ranks = run_ranks(_real_peaks, world, args=(names,), timeout=150)
            real.update({n: ranks[0][n]["peak"] for n in names})
        fake = fake.result(timeout=150)
    return {name: (fake[name], real[name]) for name in PREDICTED_MESHES}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", list(PREDICTED_MESHES))
def test_dry_run_peak_matches_a_real_run(mesh, predicted_and_real):
    """The dry run's peak (fake process group, fake tensors, FSDPMemTracker) against the same recipe's step run for
    real on gloo ranks, rank 0 both (tests/training/real_step_memory.py: live tensor storages, gloo's own staging
    copies not counted since NCCL does not allocate them), debug model, 2 layers, seq 256, local batch 2.
    Measured (dry run / real, MiB, chunked loss on): 1 rank fp32 63.63 / 63.63, fp32 dp_shard2 58.38 / 58.38, bf16
    dp_shard2 42.41 / 42.41, fp32 cp2 ring 44.32 / 44.32, bf16 dp_shard2 x cp2 full AC 22.81 / 22.81, fp32 cp2
    Ulysses with documents 44.82 / 44.82 (0.0 % on these six), fp32 tp2 33.60 / 33.85 (-0.7 %; +37 % before the
    probe kept DTensor's shape propagation out of its fake mode, fake.world._sharding_propagation_in_its_own_fake_mode).
    Ulysses' dry run failed on its exchange plan (data-dependent under fake tensors) until the plan was built from
    real host integers. The allocator's own events put the real cp2 meshes 0.16 and 0.12 MiB higher (the CPU attention backward's
    internal scratch, which no tensor-level count sees). The 3-37 % gaps reported before on these meshes came from the
    old reference (profiler op events' net memory ordered by start time), not from the dry run. The 15 % bound is the
    acceptance bar (issue 15), not the error. Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): a
    real step on gloo ranks beside each dry run, 45-50 s each."""
    predicted, real = predicted_and_real[mesh]
    print(f"{mesh}: dry run {predicted / 2**20:.2f} MiB, real {real / 2**20:.2f} MiB "
          f"({predicted - real:+,.0f} bytes, {100 * (predicted - real) / real:+.1f} %)")
    assert predicted == pytest.approx(real, rel=0.15)


def test_roofline_counts_match_closed_forms():
    from models.llama import flops_per_token, model_config
    from training.planning.accelerators import ACCELERATORS
    from training.planning.roofline import roofline
    from training.planning.workload import Layout, Workload

    m, acc = model_config("llama3_8b"), ACCELERATORS["h100-sxm"]
    n = _meta_parameter_count("llama3_8b", 32)
    seq = 262144
    common = dict(model=m, seq_len=seq, local_batch_size=1, grad_accum=1, dtype="bfloat16", ac_mode="full",
                  ac_every=1, reshard_after_forward=True)
    cost = roofline(Workload(layout=Layout(1, 1, 1, 8, 1, gpus_per_node=8), cp_ring_bytes=123.0, **common), acc)
    # models.llama also counts 6 FLOPs per RMSNorm weight, which the roofline leaves out: 6e-6 of the total.
    model_flops = cost["mfu_overlap"] * cost["overlap_s"] * acc.bf16_flops
    assert model_flops == pytest.approx(flops_per_token(m, seq, causal=True) * seq / 8, rel=1e-5)
    # FSDP over 8 ranks: bf16 all-gather twice (forward, backward) + fp32 reduce-scatter, 7/8 of the bytes each.
    assert cost["nvlink_s"] * acc.nvlink_bytes_per_s == pytest.approx(n * 7 / 8 * (2 * 2 + 4) + 123.0, rel=1e-9)
    assert cost["ib_s"] == 0
    # CP 32 on 8-GPU nodes: the ring crosses InfiniBand; FSDP over cp x dp_shard = 64 ranks too.
    wide = roofline(Workload(layout=Layout(1, 1, 2, 32, 1, gpus_per_node=8), cp_ring_bytes=5.0, **common), acc)
    assert wide["nvlink_s"] == 0 and wide["ib_s"] * acc.ib_bytes_per_s == pytest.approx(n * 63 / 64 * 8 + 5.0,
                                                                                         rel=1e-9)


def _run_train(*args, timeout=540):
    """A dry run takes 1-2 minutes alone; the limit leaves room for a CI box whose cores are shared with other tests
    (the 4M run took 300 s+ with three other multi-rank runs beside it)."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env.pop("NPROC", None)
    start = time.monotonic()
    if "--dry-run" in args:  # run_train.sh runs `train.py --dry-run` as it is: here forked, the imports done once
        done = forked_train(0, list(args), child_env(base=env), ROOT, timeout)
    else:
        done = subprocess.run([os.path.join(ROOT, "run_train.sh"), *args], capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=timeout)
    return done, time.monotonic() - start


def table_rows(stdout: str) -> list[dict]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = []
    for line in lines[start + 1:]:
        if not re.match(r"\d+ ", line):
            break
        rows.append(dict(zip(header, re.split(r"\s{2,}", line.strip()))))
    return rows


@pytest.mark.slow
def test_dry_run_names_the_stage_that_does_not_fit_and_checks_the_fix():
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): a failing dry run and its checked fix, 27
    s."""
    done, _ = _run_train("--dry-run", "--hardware.device_memory_gib", "2.12", "--model.n_layers", "2")
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]
    (row,) = table_rows(done.stdout)
    assert row["fits"] == "NO" and row["seq_len"] == "512" and float(row["peak GiB"]) > 0.12
    assert "stage 1 (recipe, seq_len 512) does NOT fit" in done.stdout
    assert 'activation_checkpoint.mode = "full"' in done.stdout
    assert "checked with the same measurement: peak" in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("CUDA_VISIBLE_DEVICES")), reason="a GPU may be visible")
def test_gpu_sized_recipe_fails_fast_without_gpus():
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): launches of the GPU-sized recipes, 16
    s."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done, seconds = _run_train("recipes/llama3_8b_1m.toml", timeout=60)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "needs 64 GPUs (8 node(s) x 8)" in lines[0] and "--dry-run" in lines[0], lines[0]
    print(f"refused in {seconds:.1f} s")  # reported, not asserted: timings on a shared box are noise


@pytest.mark.slow
def test_1m_recipe_dry_run_fits():
    done, seconds = _run_train("recipes/llama3_8b_1m.toml", "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    print(f"dry run of the 1M recipe: {seconds:.0f} s")  # reported, not asserted
    rows = table_rows(done.stdout)
    assert rows and all(float(r["peak GiB"]) <= 78 and r["fits"] == "yes" for r in rows), rows
    print(done.stdout)


@pytest.mark.slow
def test_dry_run_lands_within_20_percent_of_torchtitans_measured_peak():
    """TorchTitan reported 84.5 GiB for Llama 3.1 8B, seq 262,144, CP 8 on 8 H100, full AC, bf16."""
    done, _ = _run_train("recipes/llama3_8b_256k_torchtitan.toml", "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    (row,) = table_rows(done.stdout)
    assert float(row["peak GiB"]) == pytest.approx(84.5, rel=0.20)
    print(done.stdout)
