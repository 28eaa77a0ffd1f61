"""Host milliseconds per micro-step before and after the plan travels with the batch (issue 27, acceptance 3).

Documents layout, one row of `--seq-len` tokens (default 1M) from each of three length mixes (harness/cp_balance_counts:
web-like, heavy tail, long-doc mix) at CP 8, 16, 64, for CP rank 0, with `--layers` (default 32, Llama 3 8B)
attention calls forward and backward per micro-step:
- before, training thread (today's path when no plan is handed in, timed the same way): DocumentLayout.plan of the
  ids, DocumentShards.from_layout, the five sequence buffers sharded, then the sparse ring's plan at the first layer
  (every (rank, source) pair's visible rows, this rank's pieces against every source, the exchange rows on the
  device) and, at each of the other 2 x layers - 1 calls, the P^2 look-ups the old ShiftPlan redid per call;
- after, worker: BatchPlan.build from the numpy ids (positions, pieces, exchange rows) and pickling it for the
  queue to the training process;
- after, receive: unpickling it from the workers' queue (on CUDA the DataLoader's pin-memory thread does this and
  the pinning; on CPU the training thread);
- after, training thread: BatchPlan.to(device) (non_blocking), DocumentShards.from_plan, and per call the ShiftPlan
  cache look-up (built once from the plan's (P, P) row counts) plus this rank's pieces turned into kernel calls once.
Not in either column: sharding the buffers (a gather at the rank's positions, device work on a GPU, the same before
and after).
Data-parallel placement: `--steps` optimizer steps of `--dp` (64) ranks x `--micro-steps` rows of `--placement-seq`
tokens (bench/bench_dp_placement.packed_steps); before it ran on the training thread (StepPlacement.take), now in the
worker (the training thread does nothing for it; receiving the placed micro-batches is the "receive" column). Per micro-step figures divide a step's time by
its micro-steps. Everything runs on one thread of this CPU; "device" is the CPU (no copies are timed as transfers).

    python bench/bench_host_plan.py [--seq-len 1048576] [--cps 8,16,64] [--layers 32] [--dp 64] [--steps 3]
"""
from __future__ import annotations

import argparse
import gc
import os
import pickle
import sys
import time
import types

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401 (registers the tensor reductions the DataLoader queue uses)
from multiprocessing.reduction import ForkingPickler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_dp_placement import packed_steps  # noqa: E402
from harness.cp_balance_counts import MIXES, packed_row  # noqa: E402
from data.placement import StepPlacement, StepSlots  # noqa: E402
from parallelisms.cp.plan_layout import DocumentLayout  # noqa: E402
from parallelisms.cp.plan_host import BatchPlan  # noqa: E402
from parallelisms.cp.plan_pieces import DocumentShards  # noqa: E402
from parallelisms.cp.exchange_ring_sparse import ShiftPlan  # noqa: E402
from training.batch_plans import StepPlanner  # noqa: E402

def _ms(fn) -> tuple[float, object]:
    """Milliseconds of fn(), after a full garbage collection (so one path's garbage is not collected in another's
    timing; Python's collector still runs inside fn when fn allocates many objects, as it would in training)."""
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1e3, result


def _links(rank: int, size: int):
    return types.SimpleNamespace(rank=rank, size=size)


def _spec(docs: DocumentShards):
    return types.SimpleNamespace(docs=docs, is_causal=True)


def before_training_thread(ids: torch.Tensor, cp: int, calls: int) -> float:
    """Today's path: planned in the step, the first layer cutting pieces and rows, the old ShiftPlan per call."""
    rank, device = 0, torch.device("cpu")

    def run():
        layout = DocumentLayout.plan(ids, cp)
        docs = DocumentShards.from_layout(ids, layout)
        for call in range(calls):
            shifts = [s for s in range(1, cp)  # the old ShiftPlan's P^2 look-ups, every call
                      if any(docs.visible_rows((r + s) % cp, r, True).numel() for r in range(cp))]
            for s in shifts:
                docs.visible_rows_on(device, (rank + s) % cp, rank, True)
                docs.visible_rows_on(device, rank, (rank - s) % cp, True)
            for src in range(cp):
                docs.layout_pieces(rank, src, True)
    return _ms(run)[0]


def after(ids: torch.Tensor, cp: int, calls: int) -> tuple[float, float, float]:
    """(worker ms, receive ms, training-thread ms) with the plan made in the worker and handed in."""
    rank, device = 0, torch.device("cpu")
    numpy_ids = ids.numpy()
    worker_ms, payload = _ms(lambda: bytes(ForkingPickler.dumps(BatchPlan.build(numpy_ids, cp, rank, "ring"))))
    receive_ms, received = _ms(lambda: pickle.loads(payload))

    def run():
        plan = received.to(device, non_blocking=True)
        docs = DocumentShards.from_plan(plan)
        for call in range(calls):
            ShiftPlan.of(_spec(docs), _links(rank, cp), device)
            for src in range(cp):
                docs.layout_pieces(rank, src, True)
    return worker_ms, receive_ms, _ms(run)[0]


def placement(args) -> None:
    slots = StepSlots(args.micro_steps, args.dp, 1, args.placement_seq)
    print(f"\ndata-parallel placement, dp {args.dp} x {args.micro_steps} micro-steps, rows of {args.placement_seq} "
          f"tokens, mean over {args.steps} steps (ms per micro-step)")
    print(f"{'mix':<14} {'before: training thread':>24} {'after: receive':>15} {'after: worker':>14}")
    for mix, name in enumerate(MIXES):
        before, train, worker = [], [], []
        for fields in packed_steps(mix, slots, args.steps, args.seed):
            micro = [{n: torch.from_numpy(v[m * args.dp:(m + 1) * args.dp]) for n, v in fields.items()}
                     for m in range(args.micro_steps)]
            before.append(_ms(lambda: StepPlacement(slots, 0).take(iter(micro)))[0])
            rows = [{n: torch.from_numpy(v[i]) for n, v in fields.items()} for i in range(slots.count)]
            ms, payload = _ms(lambda: bytes(ForkingPickler.dumps(StepPlanner(args.micro_steps, slots, 0, None)(rows))))
            worker.append(ms)
            train.append(_ms(lambda: pickle.loads(payload)["micro_batches"])[0])
        per = args.micro_steps
        print(f"{name:<14} {np.mean(before) / per:>24.1f} {np.mean(train) / per:>15.2f} {np.mean(worker) / per:>14.1f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=1 << 20)
    ap.add_argument("--cps", default="8,16,64")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dp", type=int, default=64)
    ap.add_argument("--micro-steps", type=int, default=2)
    ap.add_argument("--placement-seq", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    calls = 2 * args.layers
    print(f"documents layout, one row of {args.seq_len} tokens, CP rank 0, {calls} attention calls (fwd + bwd of "
          f"{args.layers} layers) per micro-step: host ms per micro-step")
    print(f"{'mix':<14} {'CP':>3} {'before: training thread':>24} {'after: training thread':>23} "
          f"{'after: receive':>15} {'after: worker':>14}")
    for name, mix in MIXES.items():
        ids = packed_row(mix, args.seq_len, rng)[None]
        for cp in [int(c) for c in args.cps.split(",")]:
            worker_ms, receive_ms, train_ms = after(ids, cp, calls)
            before_ms = before_training_thread(ids, cp, calls)
            print(f"{name:<14} {cp:>3} {before_ms:>24.1f} {train_ms:>23.2f} {receive_ms:>15.1f} {worker_ms:>14.1f}",
                  flush=True)
    placement(args)


if __name__ == "__main__":
    main()
