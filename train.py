"""Entry point: recipe -> mesh -> data -> model -> parallelize -> train loop.

Launched by run_train.sh under torchrun:  train.py [RECIPE.toml] [--section.key value ...] [--print-config]
`--help [SECTION]` prints the modes and overrides, or one section's keys from the schema (config/help.py).
`--dry-run` (one process, no torchrun) measures every stage's memory per rank on a fake process group and prints it
with a roofline step time (training/planning/dry_run.py).
`--check` validates the recipe and the launch (data paths, degrees vs ranks), prepares any missing token store and
prints the number of ranks it needs, without starting a process group: run_train.sh calls it first so bad input
fails in one line. `--prepare-data` tokenizes the recipe's sources into their stores and stops. `--show-rows N
[--json]` prints the first N training rows of the first stage (training/show_rows.py) and stops.
`--plan-ramp --gpus N --target-seq-len L [--out F] [--offload auto|on|off] [--stages K] [--tokens-per-stage T]`
writes a recipe whose [[ramp]] stages grow the context to L on N GPUs, each measured to fit (training/planning/ramp_recipe.py).
Before anything else, a torch older than the oldest supported one (2.11) stops here in one line
(config/torch_support.py).
"""
from __future__ import annotations

import os
import sys

from config.torch_support import exit_if_unsupported_torch

exit_if_unsupported_torch()  # first: on an older torch the imports below would fail with a traceback, not one line

from config import RecipeError  # noqa: E402
from config.command_line import parse_cli  # noqa: E402
from config.recipe import load_config, to_toml  # noqa: E402
from data.sources import build_run_tokenizer, check_sources, open_stores, prepare_data  # noqa: E402
from models.llama import recipe_model_config  # noqa: E402
from parallelisms.float8 import check_float8  # noqa: E402
from training.checkpoint_shapes import preflight_checkpoint  # noqa: E402
from training.checkpoint_disk import DISK_EXIT_CODE, CheckpointDiskError, check_checkpoint_disk  # noqa: E402
from training.launch_checks.device_check import check_attention_kernel, check_gpus  # noqa: E402
from training.launch_checks.preflight import preflight_stages, required_ranks  # noqa: E402
from training.rank_positions import is_collective_timeout, report_hang  # noqa: E402
from training.trainer import Trainer  # noqa: E402


def show_rows_count(argv: list[str]) -> tuple[int | None, list[str]]:
    """`--show-rows N` taken out of argv: (N or None, the other arguments)."""
    if "--show-rows" not in argv:
        return None, argv
    at = argv.index("--show-rows")
    value = argv[at + 1] if at + 1 < len(argv) else ""
    if not value.isdigit() or int(value) < 1:
        raise RecipeError(f"--show-rows needs a number of rows >= 1 (e.g. --show-rows 4), got {value!r}.")
    return int(value), argv[:at] + argv[at + 2:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if "--help" in argv or "-h" in argv:  # before the recipe is read: help never starts or checks anything
            from config.help import help_text

            at = argv.index("--help" if "--help" in argv else "-h")
            section = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else None
            print(help_text(section), end="")
            return 0
        show_count, argv = show_rows_count(argv)
        recipe, overrides, flags = parse_cli(argv)
        if "--plan-ramp" in flags:  # one process: probes on a fake process group, then a recipe is written
            from training.planning.ramp_lengths import parse_plan_args
            from training.planning.ramp_recipe import run_plan_ramp

            request, overrides = parse_plan_args(overrides)
            tail = " ".join(a for a in argv if a not in (recipe, "--plan-ramp"))
            return run_plan_ramp(load_config(recipe, overrides), request, f" {tail}" if tail else "")
        cfg = load_config(recipe, overrides)
        if "--print-config" in flags:
            print(to_toml(cfg))
            return 0
        world = int(os.environ.get("WORLD_SIZE") or os.environ.get("NPROC") or 0) or required_ranks(cfg)
        if "--dry-run" in flags:  # one process, fake process group: memory and speed of every stage (no GPU needed)
            from training.planning.dry_run import run_dry_run  # here: its memory tracker imports half of torch's compiler

            return run_dry_run(cfg, world)
        preflight_stages(cfg, world, check_data=False)
        model_cfg = recipe_model_config(cfg)
        if show_count is not None:  # one process, no GPU: the first training rows as the model gets them
            from training.show_rows import show_rows

            show_rows(cfg, show_count, "--json" in flags, model_cfg.vocab_size, world,
                      log=lambda line: print(line, file=sys.stderr))
            return 0
        if "--prepare-data" in flags:  # one process, any machine (a login node too): tokenize every source, stop
            check_sources(cfg)
            prepare_data(cfg, model_cfg.vocab_size)
            return 0
        check_gpus(cfg, world)  # a GPU-sized recipe without GPUs stops here, in one line
        check_attention_kernel(cfg)  # and so does an attention kernel this machine cannot run
        check_float8(cfg)  # and float8 linear layers without a torchao that runs them
        check_sources(cfg)  # data paths (after the GPU check: on a laptop the GPU count is the news)
        preflight_checkpoint(cfg, model_cfg)
        nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        disk_warning = check_checkpoint_disk(cfg, model_cfg, world, nodes)  # refuses when not one save fits
        if disk_warning and "RANK" not in os.environ:  # said once, by the launch check
            print(disk_warning, file=sys.stderr)
        if "--check" in flags:
            from training.launch_checks.host_memory import check_host_memory

            check_host_memory(cfg, world)  # a stage the node's host memory cannot hold: one line, not the OOM killer
            if cfg.data.dataset == "text" or cfg.eval.niah:  # before any process group: tokenizer and data errors,
                tokenizer = build_run_tokenizer(cfg, model_cfg.vocab_size)  # stale stores, too short NIAH lengths
            if cfg.data.dataset == "text":  # and a missing store prepared here, once
                open_stores(cfg, tokenizer, log=lambda line: print(line, file=sys.stderr))
            if cfg.eval.niah:
                from training.evaluation.niah import check_niah_lengths

                check_niah_lengths(cfg, tokenizer)
            print(world)
            return 0
        trainer = Trainer(cfg)
    except RecipeError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    hung = False
    try:
        trainer.run()  # stopped on a signal or not, every rank exits 0: training/launcher.py sets the exit code
    except CheckpointDiskError as e:  # a save failed on the disk: one line, not DCP's traceback of every rank
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return DISK_EXIT_CODE
    except RuntimeError as e:  # a collective timed out: who never arrived, in one line (training/rank_positions.py)
        if not is_collective_timeout(e):
            raise
        hung = True
        import traceback

        report_hang(trainer.rank, trainer.hang_report(traceback.format_exc()))
        return 1
    finally:
        trainer.close(hung=hung)
    return 0


if __name__ == "__main__":
    try:
        exit_code = main()
    except BaseException:  # printed as Python would, but the exit below is taken in any case
        import traceback

        traceback.print_exc()
        exit_code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and the process group is gone; skip interpreter teardown, where a c10d/gloo thread still
    # alive at static destruction now and then aborts a run that succeeded ("terminate called without an active
    # exception", seen once in ~300 CI launches), and where, after an error, multiprocessing would join the data
    # loader's workers forever: they ignore the SIGTERM it ends them with (training/preemption.py); left alone, they
    # see their rank gone and exit.
    os._exit(exit_code)
