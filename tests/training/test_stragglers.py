"""Stragglers (training/stragglers.py, issue 58 item 4): each rank's time split into data wait, its own work and
collective wait, compared at every metrics record; a rank slow in `metrics.straggler_intervals` records in a row is
named in the step line.

The sampler is checked against known waits (a sleep is own work; a frame inside torch.distributed and a C-level
`.wait()` are collective waits); the comparison against hand-made tables; and the trainer on 2 ranks (slow tier):
rank 1 sleeping in each micro-step is named within 3 records, and with no hook no rank is named over 50 steps."""
from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch

from config import RecipeError
from config.recipe import load_config
from harness.launch_env import child_env
from tests.trainer_runs import ROOT, read_metrics, run_train
from tests.training.paced_runs import TINY, hook_folder, wrap_on_import
from training.stragglers import Stragglers, TimeSplit, gather_splits, straggler_words


def _in_torch_distributed(seconds: float) -> None:
    """Sleeps in a frame whose file lies inside torch/distributed, as FSDP's and c10d's waits do."""
    source = "import time\n\ndef block(seconds):\n    time.sleep(seconds)\n"
    path = os.path.join(os.path.dirname(torch.distributed.__file__), "_test_straggler_frame.py")
    namespace = {}
    exec(compile(source, path, "exec"), namespace)
    namespace["block"](seconds)


def _blocked_in_a_c_wait(seconds: float) -> None:
    """Blocks in a C++ `wait()` (no Python frame of its own), as a c10d Work's wait called from our exchanges."""
    future = torch.futures.Future()
    threading.Timer(seconds, lambda: future.set_result(None)).start()
    future.wait()


def test_the_sampler_tells_collective_waits_from_own_work():
    split = TimeSplit(sample_s=0.005)
    try:
        time.sleep(0.2)  # outside a step: not counted
        with split.step():
            time.sleep(0.3)
            _in_torch_distributed(0.3)
            _blocked_in_a_c_wait(0.3)
        split.add_data(0.05)
        data, work, collective = split.take()
    finally:
        split.close()
    assert data == 0.05
    assert 0.22 < work < 0.4, (work, collective)
    assert 0.5 < collective < 0.7, (work, collective)
    assert split.take() == (0.0, 0.0, 0.0)  # taken: a fresh count
    assert split.sampler_cpu_s < 0.1


def test_a_frame_between_lines_is_read_not_raised_on():
    """CPython 3.11+ gives a frame's f_lineno as None while it runs an instruction with no line of its own; the
    sampler read its line with it and its thread died with a TypeError (seen once on a 16-rank parity run's rank),
    leaving the rest of the run with no time split and a traceback on stderr."""
    from types import SimpleNamespace

    from training.stragglers import waiting_in_collective

    ours = SimpleNamespace(f_code=SimpleNamespace(co_filename=__file__), f_lineno=None, f_back=None)
    assert waiting_in_collective(ours) is False
    inside = os.path.join(os.path.dirname(torch.distributed.__file__), "distributed_c10d.py")
    assert waiting_in_collective(SimpleNamespace(f_code=SimpleNamespace(co_filename=inside), f_lineno=None,
                                                 f_back=None)) is True
    assert waiting_in_collective(SimpleNamespace(f_code=ours.f_code, f_lineno=None, f_back=SimpleNamespace(
        f_code=SimpleNamespace(co_filename=inside), f_lineno=10, f_back=None))) is True


def test_a_rank_slow_in_records_in_a_row_is_named_and_one_slow_record_is_not():
    stragglers = Stragglers(threshold=0.25, intervals=2)  # any threshold: the logic
    even = [(0.1, 1.0, 0.5), (0.1, 1.05, 0.45), (0.1, 0.95, 0.55), (0.1, 1.0, 0.5)]
    rank_2_slow = [(0.1, 1.0, 1.5), (0.1, 1.0, 1.5), (0.1, 2.0, 0.5), (0.1, 1.0, 1.5)]
    first = stragglers.compare(rank_2_slow)
    assert first.slowest_rank == 2 and first.named == [] and round(first.ratios[2], 2) == round(2.1 / 1.1, 2)
    assert stragglers.compare(even).named == []  # the run of slow records is broken
    stragglers.compare(rank_2_slow)
    second = stragglers.compare(rank_2_slow)
    assert second.named == [2]
    assert straggler_words(second, {2: "node-7"}) == "  straggler rank 2 on node-7 (1.9x the other ranks' own time)"
    record = second.record()["straggler"]
    assert record["slowest_rank"] == 2 and record["named"] == [2] and record["own_s"][2] == 2.1
    assert record["slowest_collective_s"] == 0.5
    data_slow = [(0.9, 1.0, 0.2), (0.1, 1.0, 1.0)]  # a stalled read is the rank's own time too
    two = Stragglers(0.25, 1).compare(data_slow)
    assert two.named == [0] and round(two.ratios[0], 2) == round(1.9 / 1.1, 2)  # against the other rank, not the mean
    assert Stragglers(0.25, 1).compare([(0.0, 1.0, 0.5), (0.0, 1.2, 0.3)]).named == []  # 20% apart: within 25%


def test_every_ranks_split_comes_back_from_one_sum():
    class SummingComm:  # two ranks' vectors, summed as the all-reduce does
        def __init__(self):
            self.vectors = []

        def reduce_values(self, values, op):
            assert op == "sum"
            self.vectors.append(values)
            return [sum(column) for column in zip(*self.vectors)]

    comm = SummingComm()
    gather_splits(comm, (1.0, 2.0, 3.0), 0, 2)
    assert gather_splits(comm, (4.0, 5.0, 6.0), 1, 2) == [(1.0, 2.0, 3.0), (4.0, 5.0, 6.0)]


def test_a_negative_threshold_or_no_intervals_is_refused_in_one_line():
    debug = os.path.join(ROOT, "recipes", "debug.toml")
    with pytest.raises(RecipeError, match=r"metrics\.straggler_threshold must be >= 0 \(0 = off\), got -0\.1"):
        load_config(debug, ["--metrics.straggler_threshold", "-0.1"])
    with pytest.raises(RecipeError, match=r"metrics\.straggler_intervals must be >= 1, got 0"):
        load_config(debug, ["--metrics.straggler_intervals", "0"])


SLOW_FORWARD = wrap_on_import("training.step", "micro_step", """
    def _run_queue_s():
        try:
            with open("/proc/thread-self/schedstat") as f:  # run time, run-queue wait (ns), timeslices
                return int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):  # a kernel without scheduler statistics: no wait is known
            return 0.0


    def wrap(micro_step):
        slow_s = float(os.environ.get("SLOW_FORWARD_S", "0")) if os.environ.get("RANK") == os.environ.get(
            "SLOW_RANK") else 0.0
        queue_log = os.environ.get("RUN_QUEUE_LOG")

        def slow(*args, **kwargs):
            time.sleep(slow_s)
            before = _run_queue_s() if queue_log else 0.0
            try:
                return micro_step(*args, **kwargs)
            finally:
                if queue_log:
                    with open(f"{queue_log}.{os.environ['RANK']}", "a") as f:
                        f.write(f"{_run_queue_s() - before}\\n")
        return slow
""", when='bool(os.environ.get("SLOW_FORWARD_S") or os.environ.get("RUN_QUEUE_LOG"))')
"""Rank SLOW_RANK sleeps SLOW_FORWARD_S in each micro-step, before its forward; with RUN_QUEUE_LOG set, each rank
appends to RUN_QUEUE_LOG.<rank> the seconds its main thread waited on the CPU run queue in each micro-step (from
/proc/thread-self/schedstat): how much another process took its core, measured outside the code under test (0
where the kernel keeps no scheduler statistics: then no naming is excused)."""


def _run(tmp_path, steps: int, log_freq: int, **env):
    helper = hook_folder(tmp_path / "helper", SLOW_FORWARD)
    out = tmp_path / "run"
    result = run_train(os.path.join(ROOT, "recipes", "debug.toml"), "--job.dump_folder", str(out), *TINY,
                       "--training.steps", str(steps), "--metrics.log_freq", str(log_freq),
                       "--metrics.enable_tensorboard", "false", nproc=2, timeout=400,
                       env=child_env(str(helper), **{k: str(v) for k, v in env.items()}))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout, read_metrics(str(out))


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_rank_sleeping_in_its_forward_is_named_and_no_rank_is_named_without_one(tmp_path):
    """Rank 1 sleeps 1 s in each micro-step of the tiny model (whose steps take tens of milliseconds on a quiet
    box): rank 0 waits for it in its collectives, so rank 1's own time is the largest; it is named from the second
    record (`metrics.straggler_intervals` = 2), within the 3 the issue allows. In CI, with other workers sharing the
    two cores, a record's slowest rank can be the one the scheduler starved (the CI of 6b374db saw it once in record
    1, which then held step 1's set-up too; the split now leaves the process's first step out), so only the naming
    and the last record are asserted. Without the hook, 50 steps (5 records of 10 steps) name nobody at the default
    threshold (0.5): two ranks' own times differ, within 1.11x on a quiet box and 1.3x with three busy loops beside
    them, not by 50% twice in a row. (Records of 5 tiny steps, ~0.3 s: the CI of 3abfd93 saw rank 0 1.5x the other
    twice in a row, starved by the other workers on the two cores; a 10-step record averages such a slice out, as a
    real step of seconds does.) A rank that other processes really starve is a straggler (a noisy neighbour), and
    the CI of ab819d2 saw one: rank 1 named at 43.5x in two records of a CI worker's run. So the run-queue wait of
    each rank's main thread in each micro-step is read from the kernel (/proc/thread-self/schedstat, outside the
    code under test), and a rank named without a hook fails the test unless its run-queue wait exceeded the other
    rank's by at least half its own-time excess in that record. The sleep was 0.3 s until the official CI of
    e8e1995, whose busy workers took rank 0's own time to ~0.26 s a step: the last record measured rank 1 at 2.2x,
    but the one before fell under the 1.5x and nobody was named. At 1 s a step, rank 0's own time would have to pass
    ~0.7 s a step for that (a sleep costs wall time, no CPU)."""
    stdout, records = _run(tmp_path / "slow", 6, 2, SLOW_RANK=1, SLOW_FORWARD_S=1.0)
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    splits = [r["straggler"] for r in records]
    assert len(lines) == 3 and splits[-1]["slowest_rank"] == 1, splits
    named = [i for i, line in enumerate(lines) if re.search(r"straggler rank 1 on \S+ \(\d+\.\dx the other", line)]
    assert named and named[0] <= 2 and splits[-1]["named"] == [1], (lines, splits)
    queue_log = tmp_path / "run_queue"
    stdout, records = _run(tmp_path / "even", 50, 10, RUN_QUEUE_LOG=queue_log)
    splits = [r["straggler"] for r in records]
    assert len(records) == 5, splits
    waits = [[float(x) for x in open(f"{queue_log}.{rank}").read().split()] for rank in range(2)]
    for record, split in enumerate(splits):
        for rank in split["named"]:
            other = 1 - rank
            gap = split["own_s"][rank] - split["own_s"][other]
            queued = [sum(waits[r][10 * record:10 * record + 10]) for r in range(2)]
            assert queued[rank] - queued[other] >= 0.5 * gap, (
                f"rank {rank} named in record {record + 1} with no other process taking its core: own "
                f"{split['own_s']} s, run-queue waits {queued} s", splits)
