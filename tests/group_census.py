"""Counts process-group creations in real trainer ranks: during setup (Trainer.__init__) and during the run (every
step, stage switch and evaluation). Launched like harness/forked_launch.py:

    python tests/group_census.py NPROC train.py [RECIPE] [--section.key value ...]

Every `new_group` (torch's own entry, also DeviceMesh's) and `split_group` call is counted where torch defines it,
so a group made by any module is seen; each rank writes {"setup": n, "run": n, "destroyed": n} to
<dump_folder>/group_census_rank<R>.json when its run ends.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def install(counts: dict) -> None:
    """Wraps torch's group constructors (before any rank forks) so each call adds to counts["made"]."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed import distributed_c10d as c10d

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    new_group, split_group = c10d._new_group_with_tag, c10d.split_group  # new_group goes through the former
    c10d._new_group_with_tag = counted(new_group, "made")
    wrapped_split = counted(split_group, "made")
    for module in (c10d, dist, device_mesh):
        if hasattr(module, "split_group"):
            setattr(module, "split_group", wrapped_split)
    destroy = c10d.destroy_process_group
    dist.destroy_process_group = c10d.destroy_process_group = counted(destroy, "destroyed")


def main() -> int:
    sys.path.insert(0, ROOT)
    from harness import forked_launch
    from training.trainer import Trainer

    counts = {"made": 0, "destroyed": 0}
    install(counts)
    init, run = Trainer.__init__, Trainer.run

    def counted_init(self, cfg):
        init(self, cfg)
        self._census_setup = counts["made"]

    def counted_run(self):
        destroyed = counts["destroyed"]
        run(self)
        path = os.path.join(self.cfg.job.dump_folder, f"group_census_rank{self.rank}.json")
        with open(path, "w") as f:
            json.dump({"setup": self._census_setup, "run": counts["made"] - self._census_setup,
                       "destroyed": counts["destroyed"] - destroyed}, f)

    Trainer.__init__, Trainer.run = counted_init, counted_run
    return forked_launch.launch(int(sys.argv[1]), sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
