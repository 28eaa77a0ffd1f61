"""Runs train.py on forked ranks (harness/forked_launch.py) with every micro-step, and the move of its batch to the
device, under training/planning/fake/counter.DispatchCounter(strict=True); each rank writes its counts to
$HOST_SYNC_OUT/rank<N>.json. Used by tests/training/test_host_syncs.py.

    python tests/training/host_sync_ranks.py NPROC [RECIPE] [--section.key value ...]
"""
import collections
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from harness import forked_launch  # noqa: E402
from training import step  # noqa: E402
from training.planning.fake.counter import DispatchCounter  # noqa: E402


def counted(fn, counts: collections.Counter, calls: collections.Counter, places: collections.Counter):
    def wrapper(*args, **kwargs):
        with DispatchCounter(strict=True, where=True) as syncs:
            result = fn(*args, **kwargs)
        counts.update(syncs.counts)
        places.update(syncs.places)
        calls[fn.__name__] += 1
        out = os.path.join(os.environ["HOST_SYNC_OUT"], f"rank{os.environ.get('RANK', '0')}.json")
        with open(out, "w") as f:
            json.dump({"syncs": dict(counts), "calls": dict(calls), "where": dict(places)}, f)
        return result
    return wrapper


if __name__ == "__main__":
    counts, calls, places = collections.Counter(), collections.Counter(), collections.Counter()
    step.micro_step = counted(step.micro_step, counts, calls, places)
    step.move_batch = counted(step.move_batch, counts, calls, places)
    sys.exit(forked_launch.launch(int(sys.argv[1]), sys.argv[2:]))
