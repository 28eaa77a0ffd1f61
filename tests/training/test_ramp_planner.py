"""`--plan-ramp` on a tiny model: the parts that need no measurement against closed forms, and the plans against
the dry run's own measurement of the layouts the planner did not take (minimality, the smallest GPU count)."""
import concurrent.futures
import math
import os
import sys

import pytest

from config import RecipeError
from tests.distributed import fresh_process_context

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2**30
TINY = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.vocab_size", "512", "--training.seq_len", "256", "--training.steps", "9",
        "--training.local_batch_size", "1",
        "--activation_checkpoint.mode", "full", "--training.dtype", "bfloat16"]


def _in_fresh_process(fn, *args, timeout=300):
    """Every probe starts its own (fake) default process group: keep them out of the pytest process."""
    ctx = fresh_process_context()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)


def _tiny(*overrides):
    from config.recipe import load_config

    return load_config(os.path.join(ROOT, "recipes", "debug.toml"), TINY + list(overrides))


def _memory_gib(usable_mib: float) -> str:
    from training.planning.dry_run import RUNTIME_RESERVE_GIB

    return repr(RUNTIME_RESERVE_GIB + usable_mib / 1024)


# ---- no measurement -------------------------------------------------------------------------------------------------

def test_rope_rule_is_never_below_the_men_bound_and_never_decreases():
    from training.planning.rope_rule import round_up_125, stage_rope_theta

    theta = 500000.0
    for seq_len in (8192, 65536, 262144, 524288, 1048576):
        new = stage_rope_theta(seq_len, theta)
        bound = 0.0424 * seq_len**1.628  # Men et al. 2024, Fig. 1
        assert new >= bound and new >= theta
        assert new == theta or new < 2.5 * bound  # the next 1/2/5 step, no more
        mantissa = new / 10 ** math.floor(math.log10(new))
        assert round(mantissa, 9) in (1, 2, 5)
        theta = new
    assert stage_rope_theta(8192, 500000.0) == 500000.0  # the pretrained base is above the bound at 8K
    assert [round_up_125(x) for x in (0.9, 1.0, 1.01, 2.5, 7e6)] == [1.0, 1.0, 2.0, 5.0, 1e7]


def test_stage_lengths_grow_geometrically_by_powers_of_two_to_the_target():
    from training.planning.ramp_lengths import stage_lengths

    assert stage_lengths(8192, 1048576, 4) == [8192, 32768, 262144, 1048576]
    default = stage_lengths(8192, 1048576)
    assert default[0] == 8192 and default[-1] == 1048576
    assert all(1 < b / a <= 8 for a, b in zip(default, default[1:]))
    assert stage_lengths(4096, 4096) == [4096]
    assert stage_lengths(512, 3000, 2) == [512, 3000]  # the target need not be a power of two
    with pytest.raises(RecipeError, match="--stages 9"):
        stage_lengths(512, 2048, 9)


def test_plan_flags_are_taken_out_and_overrides_kept():
    from training.planning.ramp_lengths import PlanRequest, default_out, parse_plan_args

    request, rest = parse_plan_args(["--gpus", "8", "--target-seq-len=1048576", "--model.name", "llama3_70b",
                                     "--offload", "on", "--stages", "4", "--tokens-per-stage", "1000"])
    assert request == PlanRequest(gpus=8, target_seq_len=1048576, offload="on", stages=4, tokens_per_stage=1000)
    assert rest == ["--model.name", "llama3_70b"]
    assert default_out("recipes/llama3_8b_1m.toml", request) == os.path.join("recipes", "llama3_8b_1m_8gpu.toml")
    assert default_out("x/debug.toml", PlanRequest(4, 3000)) == os.path.join("recipes", "debug_3000_4gpu.toml")
    with pytest.raises(RecipeError, match="--target-seq-len"):
        parse_plan_args(["--gpus", "8"])
    with pytest.raises(RecipeError, match="whole number"):
        parse_plan_args(["--gpus", "eight", "--target-seq-len", "8"])


def test_tokens_per_step_and_steps_per_stage():
    from training.planning.ramp_lengths import PlanRequest, stage_steps, tokens_per_step_for

    base = _tiny()  # local_batch_size 1 x dp_shard 2 rows of 256 = 512 tokens per step
    assert tokens_per_step_for(base, 4, [256, 512]) == 512
    assert tokens_per_step_for(base, 4, [256, 1024]) == 1024
    assert tokens_per_step_for(base, 4, [256, 1024, 3072]) == 3072  # one whole row of the longest
    base.training.tokens_per_step = 8192
    assert tokens_per_step_for(base, 4, [256, 2048]) == 8192
    assert stage_steps(base, PlanRequest(4, 2048), 2, 8192) == [4, 5]  # the base's 9 steps split evenly
    assert stage_steps(base, PlanRequest(4, 2048, tokens_per_stage=20000), 2, 8192) == [3, 3]


# ---- plans, measured ------------------------------------------------------------------------------------------------

def _plan_and_check(usable_mib: float):
    """A 3-stage plan to 8K on 4 GPUs and the dry run's measurement of the last stage at half
    the planned CP."""
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    from training.planning.dry_run import PlanRow, measure_row
    from training.planning.ramp_lengths import PlanRequest
    from training.planning.ramp_planner import StageAsk, plan_ramp, stage_candidate
    from training.planning.ramp_recipe import render_recipe

    base = _tiny("--hardware.device_memory_gib", _memory_gib(usable_mib), "--training.tokens_per_step", "32768")
    request = PlanRequest(gpus=4, target_seq_len=8192, stages=3, offload="off")
    plans = [plan_ramp(base, request)]  # a rerun gives the same plan: bench/bench_ramp_planner.py
    texts = [render_recipe(p, "recipes/x.toml", "recipes/debug.toml") for p in plans]
    last = plans[0].stages[-1]
    ask = StageAsk(base, 4, 1, False, last.seq_len, last.rope_theta, plans[0].tokens_per_step)
    half = stage_candidate(ask, last.chosen.cp // 2)
    half_peak = measure_row(PlanRow("half", half), 4, 8).peak_gib
    stages = [dict(seq_len=s.seq_len, cp=s.chosen.cp, peak=s.measured.peak_gib, predicted=s.chosen.predicted_gib,
                   step_s=s.step_s) for s in plans[0].stages]
    return dict(texts=texts, stages=stages, half_peak=half_peak, usable=plans[0].usable_gib,
                cp_max_step_s=measure_row(PlanRow("max", stage_candidate(ask, 4)), 4, 8).times["predicted_s"])


@pytest.fixture(scope="module")
def tight_plan():
    """12 MiB usable: the tiny model's 8K row needs CP (about 5 MiB per 1K tokens a rank holds)."""
    return _in_fresh_process(_plan_and_check, 12.0)


@pytest.mark.slow
def test_every_planned_stage_fits(tight_plan):
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): the planned recipe's dry run (the tight
    plan, shared with the next two tests), 35 s."""
    assert [s["seq_len"] for s in tight_plan["stages"]] == [256, 2048, 8192]
    for stage in tight_plan["stages"]:
        assert stage["peak"] <= tight_plan["usable"]
        assert stage["predicted"] == pytest.approx(stage["peak"], rel=0.15)  # the line against the measurement


@pytest.mark.slow
def test_last_stage_cp_is_minimal_and_no_slower_than_the_largest(tight_plan):
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): the tight plan, shared with the tests
    around it."""
    last = tight_plan["stages"][-1]
    assert last["cp"] > 1
    assert tight_plan["half_peak"] > tight_plan["usable"]  # the dry run's probe: half the CP does not fit
    assert last["step_s"] <= tight_plan["cp_max_step_s"]


@pytest.mark.slow
def test_written_recipe_names_why_and_the_rope_source(tight_plan):
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): the tight plan, shared with the tests
    above, 29 s."""
    text = tight_plan["texts"][0]
    assert text.count("\n[[ramp]]\n") == 3
    flat = " ".join(line.lstrip("#").strip() for line in text.splitlines())  # comments wrap at 118 columns
    assert "Men et al. 2024" in flat and "Not a smaller CP: cp 1:" in flat
    assert "tokens_per_step = 32768" in text


def _impossible(usable_mib: float):
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    from training.planning.dry_run import PlanRow, measure_row
    from training.planning.ramp_lengths import PlanRequest
    from training.planning.ramp_planner import StageAsk, plan_ramp, stage_candidate

    base = _tiny("--hardware.device_memory_gib", _memory_gib(usable_mib), "--training.tokens_per_step", "8192")
    try:
        plan_ramp(base, PlanRequest(gpus=1, target_seq_len=2048, stages=1, offload="on"))
    except RecipeError as e:
        message = str(e)
    else:
        return dict(message=None)
    named = int(message.split("rerun with --gpus ")[1].rstrip("."))
    below = named // 2  # the largest CP on half the GPUs, with offload: the least memory a layout there can take
    peak_below = measure_row(PlanRow("below", stage_candidate(StageAsk(base, below, 1, True, 2048, 5e5, 8192), below)),
                             below, 8).peak_gib
    return dict(message=message, named=named, peak_below=peak_below)


@pytest.mark.slow
def test_impossible_target_names_the_smallest_gpu_count():
    """2.5 MiB usable: the tiny model's state alone (about 2.3 MiB unsharded, plus the optimizer's temporaries) does
    not fit one GPU. Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): the planner's dry runs for
    every GPU count, 55 s."""
    result = _in_fresh_process(_impossible, 2.5)
    assert result["message"] is not None
    assert "\n" not in result["message"] and "smallest GPU count that fits is" in result["message"]
    assert result["named"] > 1
    assert result["named"] == 2 or result["peak_below"] > 2.5 / 1024


def _auto_plan(usable_mib: float, mode: str):
    """A 2-stage plan to 4K on 1 GPU with `--offload auto`, on the 4-layer tiny model; the written recipe resolved."""
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    import tempfile

    from config.recipe import load_config
    from training.planning.dry_run import measure_row, plan_rows
    from training.launch_checks.preflight import preflight_stages
    from training.planning.ramp_lengths import PlanRequest
    from training.planning.ramp_planner import plan_ramp
    from training.planning.ramp_recipe import render_recipe

    base = _tiny("--model.n_layers", "4", "--activation_checkpoint.mode", mode, "--hardware.device_memory_gib",
                 _memory_gib(usable_mib), "--training.tokens_per_step", "4096")
    plan = plan_ramp(base, PlanRequest(gpus=1, target_seq_len=4096, stages=2, offload="auto"))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "auto.toml")
        with open(path, "w") as f:
            f.write(render_recipe(plan, path, "recipes/debug.toml"))
        recipe = load_config(path)
        written = preflight_stages(recipe, 1, check_data=False)
        dry_run_host = [measure_row(row, 1, 8).host_gib for row in plan_rows(recipe, 1)]  # each stage its own
    return dict(dry_run_host=dry_run_host, offload=[s.chosen.offload for s in plan.stages], peaks=[s.measured.peak_gib for s in plan.stages],
                host=[s.measured.host_gib for s in plan.stages], rejected=plan.stages[-1].rejected,
                written=[(s.cfg.activation_checkpoint.offload, s.cfg.activation_checkpoint.mode) for s in written])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "none"])
def test_auto_offload_only_in_the_stage_that_needs_it(mode):
    """23.9 MiB usable: the dry run measures the 4K stage at 24.4 MiB without offload and 23.3 MiB with it, the
    256-token stage at 6.5 MiB (25.2, 24.1 and 6.7 before the chunked loss let go of its input gradient, with a
    24.6 MiB budget). A base without checkpointing is planned again with it on every stage (one model
    build has one mode, and offload needs one). Slow tier since issue 56 (the fast tier runs in minutes; CI runs both):
    the planner's dry runs of each stage, 39-53 s each."""
    result = _in_fresh_process(_auto_plan, 23.9, mode)
    assert result["offload"] == [False, True]
    assert all(peak <= 23.9 / 1024 for peak in result["peaks"])
    assert result["host"][0] == 0 and result["host"][1] > 0
    assert result["rejected"] and all(why.startswith("without offload cp 1") for why in result["rejected"])
    assert result["written"] == [(False, "full"), (True, "full")]
    # The written recipe's dry run: the 4K stage's block inputs (4 layers x 4096 tokens x 64 bf16) on host only.
    assert result["dry_run_host"] == [0.0, 4 * 4096 * 64 * 2 / GIB]


# ---- end to end -----------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_planned_recipe_passes_check_and_dry_run_unchanged(tmp_path):
    """plan -> the written file -> --check -> --dry-run, through the launcher, the file untouched in between. The
    plan and the dry run are modes run_train.sh execs `train.py` for as they are: tests/trainer_runs.run_train forks
    them from the forkserver, which imported the trainer once (2 x ~4 CPU-s of imports fewer); --check runs in
    run_train.sh's own launcher process."""
    import json

    from tests.trainer_runs import run_train

    out = tmp_path / "tiny_8k_4gpu.toml"

    def launch(*args):
        return run_train(*map(str, args), timeout=300)

    planned = launch("recipes/debug.toml", "--plan-ramp", "--gpus", 4, "--target-seq-len", 8192, "--stages", 3,
                     "--out", out, *TINY, "--hardware.device_memory_gib", _memory_gib(12.0),
                     "--training.tokens_per_step", 32768, "--data.cache_dir", tmp_path / "cache")
    assert planned.returncode == 0, planned.stdout + planned.stderr[-2000:]
    assert "total:" in planned.stdout and "GPU-hours" in planned.stdout
    written = out.read_text()
    checked = launch(out, "--check")
    lines = checked.stdout.strip().splitlines()  # the launch check prints the ranks once and starts no torchrun
    assert checked.returncode == 0 and lines[-1] == "4" and lines.count("4") == 1, checked.stdout + checked.stderr[-2000:]
    dry = launch(out, "--dry-run", "--job.dump_folder", tmp_path / "dry")
    assert dry.returncode == 0, dry.stdout + dry.stderr[-2000:]
    assert out.read_text() == written
    stages = json.loads((tmp_path / "dry" / "dry_run.json").read_text())["stages"]
    assert [(s["seq_len"], s["fits"]) for s in stages] == [(256, True), (2048, True), (8192, True)]
    assert stages[-1]["cp"] > 1


# ---- the frontier's memory cuts ---------------------------------------------------------------------------------------

CUTS_BASE = ["--model.n_layers", "4", "--model.dim", "256", "--model.n_heads", "8", "--model.n_kv_heads", "4",
             "--training.loss_chunk_tokens", "512", "--training.tokens_per_step", "16384", "--parallelism.dp_shard",
             "1", "--training.cpu_offload", "true", "--model.mlp_chunk_tokens", "1024", "--model.norm_chunk_tokens",
             "1024", "--hardware.device_memory_gib"]


def _cut_plans(usable_mib: float, host_mib: float):
    """Two one-stage plans to 16K on 1 GPU with activation offload, the state on the host: on the default host and on
    a host of `host_mib`; each with what the planner turned on and its stage's measured peak and host per node, and
    for the second the dry run's measurement of the stage with each cut it turned on taken back out."""
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    from training.planning.dry_run import PlanRow, measure_row
    from training.planning.memory_probe import with_section
    from training.planning.ramp_lengths import PlanRequest
    from training.planning.ramp_planner import plan_ramp

    out = []
    for host in (None, host_mib):
        base = _tiny(*CUTS_BASE, _memory_gib(usable_mib), *(["--hardware.host_memory_gib", repr(host / 1024)]
                                                            if host else []))
        plan = plan_ramp(base, PlanRequest(gpus=1, target_seq_len=16384, stages=1, offload="on"))
        (stage,) = plan.stages
        ac, p = plan.base.activation_checkpoint, plan.base.parallelism
        turned = dict(groups=p.attention_sublayer_groups, prefetch=ac.offload_prefetch, keep_last=ac.offload_keep_last)
        without = {}
        for name, section, values in (("groups", "parallelism", dict(attention_sublayer_groups=0)),
                                      ("prefetch", "activation_checkpoint", dict(offload_prefetch=True)),
                                      ("keep_last", "activation_checkpoint", dict(offload_keep_last=0))):
            turned_on = dict(groups=turned["groups"] > 1, prefetch=turned["prefetch"] is False,
                             keep_last=turned["keep_last"] > 0)[name]
            if host and turned_on:
                row = measure_row(PlanRow(name, with_section(stage.chosen.cfg, section, **values)), 1, 8)
                without[name] = (row.peak_gib * 1024, (row.host_gib + row.host.tensors / 2**30) * 1024)
        out.append(dict(note=plan.note, turned=turned, peak=stage.measured.peak_gib * 1024,
                        host=(stage.measured.host_gib + stage.measured.host.tensors / 2**30) * 1024, without=without))
    return out


@pytest.mark.slow
def test_the_planner_turns_on_the_memory_cuts_it_needs_and_no_more():
    """91 MiB usable: this attention-heavy tiny model's 16K stage (state on the host, activation offload) measures
    112.8 MiB, 94.3 with the sublayer in 4 K/V head groups, 88.3 with its block inputs also brought back one at a
    time (no prefetch): the planner turns on those two, in that order, and not `offload_keep_last`. With a 158 MiB
    host (the 16K stage's block inputs, 32 MiB, and the state's host side, 134 MiB, do not fit it) it also keeps the
    last two blocks' inputs on the device (host 150 MiB). Each plan's stage fits, and with any cut it turned on
    taken out (on the small host, where all three are on) the dry run says it does not."""
    default_host, small_host = _in_fresh_process(_cut_plans, 91.0, 158.0)
    assert default_host["turned"] == dict(groups=4, prefetch=False, keep_last=0), default_host
    assert small_host["turned"] == dict(groups=4, prefetch=False, keep_last=2), small_host
    assert default_host["note"] == ("parallelism.attention_sublayer_groups = 4, chosen by the planner: 16,384 tokens fit "
                                    "no layout without it; activation_checkpoint.offload_prefetch = false, chosen by "
                                    "the planner: 16,384 tokens fit no layout without it"), default_host["note"]
    for result, host in ((default_host, float("inf")), (small_host, 158.0)):
        assert result["peak"] <= 91.0 and result["host"] <= host, result
    assert sorted(small_host["without"]) == ["groups", "keep_last", "prefetch"], small_host
    for name, (peak, host_taken_out) in small_host["without"].items():
        assert peak > 91.0 or host_taken_out > 158.0, (name, small_host)
