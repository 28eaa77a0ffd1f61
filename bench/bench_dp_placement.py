"""Data-parallel placement on work counts (issue 20, acceptance 5): loader order, whole-row moves and segment
placement side by side on the same steps.

Documents of three length mixes are packed the way data/packing.py packs them (one EOS per document, rows of
seq_len + 1 tokens, `row_fields` with document masking), `dp x micro_steps` rows per optimizer step. Each step's rows
are laid out three ways:
- loader: the loader's order (micro-step m, rank r takes the loader's rows in turn),
- whole rows: `plan_whole_rows` (rows moved between slots, never split),
- segments: `place_step`, what `[data] placement = "work"` trains on (whole rows when no exact fill is found).
A rank's attention work in a micro-step is its visible causal pairs, sum(position_ids + 1) over its tokens. Printed per
mix: step attention time / ideal = sum over the steps and micro-steps of the busiest rank's pairs / (the pairs spread
evenly over the dp ranks), the mean per-step ratio, its worst step, and how many steps fell back to whole rows; plus
"floor": the same ratio if every micro-step only waited for its heaviest single segment where that exceeds the even
share (atomic long segments cannot be split).

    python bench/bench_dp_placement.py [--seq-len 65536] [--dp 8] [--micro-steps 2] [--steps 50] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.packing import FIELDS, row_fields  # noqa: E402
from data.placement import StepSlots, place_step, plan_whole_rows, segment_work, segments  # noqa: E402

EOS = 0
MIXES = ("web-like lognormal(6.5, 1.0)", "heavy tail 256 x (1 + Pareto(1.1))", "long-doc mix 95% web + 5% 64K-512K")


def document_length(rng: np.random.Generator, mix: int) -> int:
    if mix == 0 or (mix == 2 and rng.random() < 0.95):
        return max(1, int(rng.lognormal(6.5, 1.0)))
    if mix == 1:
        return int(256 * (1 + rng.pareto(1.1)))
    return int(rng.integers(65536, 524288 + 1))


def packed_steps(mix: int, slots: StepSlots, steps: int, seed: int):
    """Yields each step's rows as data/packing.py builds them: documents (+ EOS) concatenated, rows of seq_len + 1."""
    rng = np.random.default_rng([seed, mix])
    row_tokens = slots.seq_len + 1
    carry = np.empty(0, dtype=np.int64)
    for _ in range(steps):
        need = slots.count * row_tokens
        parts, have = [carry], len(carry)
        while have < need:
            doc = np.ones(document_length(rng, mix), dtype=np.int64)
            doc[-1] = EOS
            parts.append(doc)
            have += len(doc)
        stream = np.concatenate(parts)
        carry = stream[need:]
        rows = [row_fields(r, EOS, document_masking=True) for r in stream[:need].reshape(slots.count, row_tokens)]
        yield {name: np.stack([r[name] for r in rows]) for name in FIELDS}


def busiest_per_micro(positions: np.ndarray, slots: StepSlots) -> tuple[int, int]:
    """(sum over micro-steps of the busiest rank's pairs, the step's pairs) for rows in slot order."""
    pairs = (positions + 1).sum(axis=1).reshape(slots.micro_steps, slots.dp_size, slots.local_rows).sum(axis=2)
    return int(pairs.max(axis=1).sum()), int(pairs.sum())


def floor_of(fields: dict, slots: StepSlots) -> int:
    """A lower bound of the summed busiest work (pairs), the best of two:
    - segments longer than half a row never share a row: dealt dp x local rows to a micro-step, each micro-step
      waits at least for its heaviest;
    - the micro-step holding the heaviest segment (h) waits >= h and >= its work / dp; the others together wait >= the
      rest of the work / dp, and one micro-step's dp x local x seq_len tokens hold at most W_max pairs (its longest
      segments, the last one fractionally). So sum >= min over its work W <= W_max of max(h, W / dp) + (T - W) / dp.
    """
    _, _, length = segments(fields["document_ids"])
    work = segment_work(length)
    total = int(work.sum())
    per_micro = slots.dp_size * slots.local_rows
    long_work = np.sort(work[length > slots.seq_len // 2])[::-1]
    dealt = int(long_work[::per_micro][:slots.micro_steps].sum())
    order = np.argsort(-length, kind="stable")
    tokens = np.cumsum(length[order])
    whole = int(np.searchsorted(tokens, per_micro * slots.seq_len, side="right"))
    w_max = int(work[order[:whole]].sum())
    if whole < len(order):  # the next segment, fractionally, at its pairs per token
        left = per_micro * slots.seq_len - (int(tokens[whole - 1]) if whole else 0)
        w_max += int(work[order[whole]] * left / length[order[whole]])
    heaviest = int(work.max())
    w = min(w_max, slots.dp_size * heaviest)
    absorbed = heaviest + (total - w) / slots.dp_size
    return int(max(total / slots.dp_size, absorbed, dealt))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--micro-steps", type=int, default=2)
    ap.add_argument("--local-rows", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    slots = StepSlots(args.micro_steps, args.dp, args.local_rows, args.seq_len)
    print(f"seq {args.seq_len}, dp {args.dp}, {args.micro_steps} micro-steps x {args.local_rows} row(s), "
          f"{args.steps} steps; step attention time / ideal (ideal = the step's pairs spread evenly over dp ranks)")
    print(f"{'':<38} {'summed over the steps':^40} {'median step':^26}")
    print(f"{'mix':<38} {'loader':>7} {'rows':>7} {'segments':>9} {'floor':>7} {'loader':>8} {'segments':>9} "
          f"{'floor':>7} {'worst':>7} {'fallback':>9} {'plan ms':>8}")
    for mix, name in enumerate(MIXES):
        per_step = {key: [] for key in ("loader", "rows", "segments", "floor")}
        totals, fallbacks, plan_time = [], 0, 0.0
        for fields in packed_steps(mix, slots, args.steps, args.seed):
            loader_busiest, step_total = busiest_per_micro(fields["position_ids"], slots)
            row_work = (fields["position_ids"] + 1).sum(axis=1)
            in_slots = np.empty_like(fields["position_ids"])
            in_slots[plan_whole_rows(row_work, slots)] = fields["position_ids"]
            start = time.perf_counter()
            placement = place_step(fields, slots)
            plan_time += time.perf_counter() - start
            placed_busiest, placed_total = busiest_per_micro(placement.fields["position_ids"], slots)
            assert placed_total == step_total, "placement changed the step's pairs"
            fallbacks += placement.whole_rows
            per_step["loader"].append(loader_busiest)
            per_step["rows"].append(busiest_per_micro(in_slots, slots)[0])
            per_step["segments"].append(placed_busiest)
            per_step["floor"].append(floor_of(fields, slots))
            totals.append(step_total / args.dp)
        ideal = np.array(totals)
        summed = {key: sum(values) / ideal.sum() for key, values in per_step.items()}
        median = {key: float(np.median(np.array(values) / ideal)) for key, values in per_step.items()}
        worst = float(np.max(np.array(per_step["segments"]) / ideal))
        print(f"{name:<38} {summed['loader']:>7.3f} {summed['rows']:>7.3f} {summed['segments']:>9.3f} "
              f"{summed['floor']:>7.3f} {median['loader']:>8.3f} {median['segments']:>9.3f} {median['floor']:>7.3f} "
              f"{worst:>7.3f} {fallbacks:>5}/{args.steps:<3} {1e3 * plan_time / args.steps:>8.1f}")


if __name__ == "__main__":
    main()
