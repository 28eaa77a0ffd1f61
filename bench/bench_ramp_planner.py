"""The ramp compiler (`--plan-ramp`): planning time, the same plan on a rerun, the last stage's CP against half of it,
and each stage's predicted step time against a hand-written recipe's stage of the same length, in one run.

    .venv/bin/python bench/bench_ramp_planner.py recipes/llama3_8b_1m_8gpu.toml --gpus 8 --target-seq-len 1048576 \
        --stages 4 --compare recipes/llama3_8b_1m_8gpu.toml [--runs 2] [--section.key value ...]

Half the CP is measured with the dry run's own probe at twice the tokens per step (so the rows split over the
doubled data-parallel ranks): the memory answer, whatever the batch allows. The hand-written recipe's stages are
measured the same way (training/planning/dry_run.py's measure_row), so the two step times come from one roofline.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config.recipe import load_config  # noqa: E402
from training.planning.dry_run import PlanRow, measure_row, plan_rows  # noqa: E402
from training.planning.ramp_lengths import PlanRequest  # noqa: E402
from training.planning.ramp_planner import StageAsk, plan_ramp, stage_candidate  # noqa: E402
from training.planning.ramp_recipe import format_plan_table, render_recipe  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--target-seq-len", type=int, required=True)
    parser.add_argument("--stages", type=int, default=0)
    parser.add_argument("--offload", default="auto")
    parser.add_argument("--runs", type=int, default=2, help="plans to time (2: also checks the rerun is identical)")
    parser.add_argument("--compare", default="", help="a hand-written recipe of the same ramp")
    args, overrides = parser.parse_known_args()
    base = load_config(args.recipe, overrides)
    request = PlanRequest(args.gpus, args.target_seq_len, offload=args.offload, stages=args.stages)
    texts, seconds = [], []
    for _ in range(args.runs):
        start = time.perf_counter()
        plan = plan_ramp(base, request)
        seconds.append(time.perf_counter() - start)
        texts.append(render_recipe(plan, "recipes/planned.toml", args.recipe))
    print(format_plan_table(plan))
    print(f"planning time: {', '.join(f'{s:.0f}s' for s in seconds)} ({len(plan.stages)} stages, "
          f"{base.model.name}, {args.gpus} GPUs)" + (f"; rerun gives the same recipe: "
                                                     f"{'yes' if len(set(texts)) == 1 else 'NO'}" if args.runs > 1
                                                     else ""))
    last = plan.stages[-1]
    if last.chosen.cp > 1:
        ask = StageAsk(base, args.gpus, last.chosen.tp, last.chosen.offload, last.seq_len, last.rope_theta,
                       2 * plan.tokens_per_step)
        half = stage_candidate(ask, last.chosen.cp // 2)
        peak = measure_row(PlanRow("half", half), args.gpus, base.hardware.gpus_per_node).peak_gib
        verdict = "fits" if peak <= plan.usable_gib else "does not fit"
        print(f"last stage ({last.seq_len:,} tokens): cp {last.chosen.cp} peak {last.measured.peak_gib:.1f} GiB; "
              f"cp {last.chosen.cp // 2} (measured) {peak:.1f} GiB: {verdict} in {plan.usable_gib:g} GiB; with this "
              f"batch: {'; '.join(last.rejected) or '-'}")
    if args.compare:
        hand = load_config(args.compare)
        by_length = {row.cfg.training.seq_len: row for row in plan_rows(hand, args.gpus)}
        for stage in plan.stages:
            row = by_length.get(stage.seq_len)
            if row is None:
                continue
            theirs = measure_row(row, args.gpus, hand.hardware.gpus_per_node)
            print(f"{stage.seq_len:>9,} tokens: planned cp {stage.chosen.cp} {stage.step_s:.2f} s/step, "
                  f"{args.compare} cp {theirs.dims.cp} {theirs.times['predicted_s']:.2f} s/step "
                  f"(planned / hand-written = {stage.step_s / theirs.times['predicted_s']:.3f}); peaks "
                  f"{stage.measured.peak_gib:.1f} / {theirs.peak_gib:.1f} GiB")
    return 0 if len(set(texts)) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
