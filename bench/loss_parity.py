"""Loss parity of every mesh against one plain single-process run: per-step loss and grad norm, fp32, same data.

The reference and the trainer launch live in tests/loss_reference.py (the tests compare against the same run); this
script prints the table for every mesh.

    python bench/loss_parity.py [--steps 5] [--seq-len 128] [--only tp2,pp2] [--skip-16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.loss_reference import GLOBAL_BATCH, MESHES, max_relative_error, reference_run, trainer_run, world_size  # noqa: E402

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--only", default="", help="comma-separated mesh names (default: all)")
    parser.add_argument("--skip-16", action="store_true", help="leave out the 16-rank 4-D mesh")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(MESHES)
    if args.skip_16:
        names = [n for n in names if world_size(MESHES[n]) < 16]
    reference = reference_run(args.steps, args.seq_len)
    print(f"debug model, fp32, {args.steps} steps, seq {args.seq_len}, global batch {GLOBAL_BATCH}; "
          f"reference losses {[round(r['loss'], 4) for r in reference]}")
    print(f"{'mesh':<30} {'ranks':>5} {'max rel err loss':>17} {'max rel err gnorm':>18} {'wall s':>7}")
    worst = 0.0
    for name in names:
        start = time.perf_counter()
        records = trainer_run(MESHES[name], args.steps, args.seq_len)
        loss_err = max_relative_error(reference, records, "loss")
        norm_err = max_relative_error(reference, records, "grad_norm")
        worst = max(worst, loss_err, norm_err)
        print(f"{name:<30} {world_size(MESHES[name]):>5} {loss_err:>17.2e} {norm_err:>18.2e} "
              f"{time.perf_counter() - start:>7.1f}", flush=True)
    print(f"worst relative error: {worst:.2e} ({'within' if worst <= 1e-5 else 'ABOVE'} 1e-5)")


if __name__ == "__main__":
    main()
