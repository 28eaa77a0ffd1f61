"""Which rank the others wait for: each rank's time split into data wait, its own work and collective wait, compared
at every metrics record, and a rank slower than the others for several records named in the step line.

Why: in synchronous training every rank finishes a step when the slowest does, so every rank logs the slowest one's
step time and a slow rank (a throttled device, a noisy neighbour, a stalled read) is invisible. What differs is where
the time goes: the rank the others wait for waits least itself. So each rank measures its own split:
- data wait: timed around the batch fetch (the trainer's `data_time`);
- within the step, a daemon thread samples the main thread's stack every SAMPLE_S (50 ms) and counts the time since
  the last sample as collective wait when the main thread is inside torch.distributed (FSDP's all-gathers and
  reduce-scatters, DTensor's and c10d's collectives) or blocked on a `.wait()` of our own exchanges (the CP ring's
  sends and receives), and as the rank's own work otherwise. A sample costs ~10 us of CPU (0.27% of a debug step in
  all: docs/launch_at_scale.md).
At each record one all-reduce (`Comm.reduce_values`, a vector of world size x 3) gives every rank the whole table;
a rank whose own time (data wait + own work) is more than `metrics.straggler_threshold` above the median of the
other ranks' is slow in that record, and a rank slow in `metrics.straggler_intervals` records in a row is named (rank
and host). (Against the other ranks, not all of them: with 2 ranks the median of all is the mean of the slow one and
the fast one, which halves the gap; at scale the two are the same.)

What this does not see: on CUDA the host's time is what is split. A rank whose host is slow (data loading, CPU
contention, a Python stall) shows; a GPU that computes slowly while its host waits for it in the same call as every
other host's (the loss's `.item()`) does not: that needs NCCL's own per-collective timings, which are not read here.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass

SAMPLE_S = 0.05
"""50 ms: 20 samples a second, each ~10 us of CPU plus the thread's wake-up; at 10 ms the thread took 1.1-1.4% of a
debug step's time on the 2-core AMD box (bench/bench_rank_positions.py --feature stragglers). A record averages
log_freq steps, so even 0.1-s steps get a few samples per step."""
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_FRAMES_LOOKED_AT = 40
"""Frames walked out from the innermost: a collective's frames sit near the top of the stack."""


def waiting_in_collective(frame) -> bool:
    """Whether the main thread's stack (its innermost frame) is in a collective: any of its frames inside
    torch.distributed, or the innermost blocked on a `.wait()` (a Work's, called from our own exchanges)."""
    if frame is None:
        return False
    import linecache

    lineno = frame.f_lineno  # None while the frame runs an instruction without a line (CPython 3.11+)
    line = linecache.getline(frame.f_code.co_filename, lineno) if lineno is not None else ""
    if ".wait(" in line:
        return True
    for _ in range(_FRAMES_LOOKED_AT):
        if frame is None:
            return False
        if _DISTRIBUTED in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class TimeSplit:
    """This rank's seconds of data wait, own work and collective wait since the last `take()`."""

    def __init__(self, sample_s: float = SAMPLE_S):
        self.sample_s = sample_s
        self._main = threading.get_ident()
        self._lock = threading.Lock()
        self._stepping = False
        self._stopped = False
        self.data_s = self.work_s = self.collective_s = 0.0
        self.sampler_cpu_s = 0.0
        """CPU seconds the sampling thread has used (what the split costs: bench/bench_stragglers.py)."""
        self._thread = threading.Thread(target=self._sample, name="time-split", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def step(self):
        """Samples are counted while the step's forward, backward and optimizer run."""
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False

    def add_data(self, seconds: float) -> None:
        with self._lock:
            self.data_s += seconds

    def take(self) -> tuple[float, float, float]:
        """(data, work, collective) seconds since the last call, and a fresh count."""
        with self._lock:
            split = (self.data_s, self.work_s, self.collective_s)
            self.data_s = self.work_s = self.collective_s = 0.0
        return split

    def close(self) -> None:
        self._stopped = True
        self._thread.join(timeout=2 * self.sample_s)

    def _sample(self) -> None:
        last = time.perf_counter()
        while not self._stopped:
            time.sleep(self.sample_s)  # not Event.wait: a Condition and a lock made per call, ~25 us of CPU each
            self.sampler_cpu_s = time.thread_time()
            now = time.perf_counter()
            elapsed, last = now - last, now
            if not self._stepping:
                continue
            waiting = waiting_in_collective(sys._current_frames().get(self._main))
            with self._lock:
                if waiting:
                    self.collective_s += elapsed
                else:
                    self.work_s += elapsed


def others_median(own: list[float], rank: int) -> float:
    """The median of every other rank's own time (the rank's own when it is alone)."""
    others = own[:rank] + own[rank + 1:]
    return statistics.median(others) if others else own[rank]


@dataclass
class StragglerReport:
    """One record's comparison of the ranks."""
    slowest_rank: int
    own_s: list[float]
    """Each rank's data wait + own work in the record's steps."""
    collective_s: list[float]
    data_s: list[float]
    ratios: list[float]
    """Each rank's own time over the median of the other ranks'."""
    named: list[int]
    """Ranks slow in `intervals` records in a row, this one included."""

    def record(self) -> dict:
        """The metrics.jsonl fields: the slowest rank against the others, and every rank's split."""
        slowest = self.slowest_rank
        return {"straggler": {"slowest_rank": slowest, "own_s_over_others": self.ratios[slowest],
                              "slowest_own_s": self.own_s[slowest],
                              "others_median_own_s": others_median(self.own_s, slowest),
                              "slowest_collective_s": self.collective_s[slowest],
                              "named": self.named, "own_s": self.own_s, "collective_s": self.collective_s,
                              "data_s": self.data_s}}


class Stragglers:
    """Compares the ranks' splits at each record; counts, per rank, the records in a row it was slow in."""

    def __init__(self, threshold: float, intervals: int):
        self.threshold, self.intervals = threshold, intervals
        self.slow_in_a_row: dict[int, int] = {}

    def compare(self, table: list[tuple[float, float, float]]) -> StragglerReport:
        """`table`: every rank's (data, work, collective) seconds of the record's steps."""
        own = [data + work for data, work, _ in table]
        ratios = []
        for rank, seconds in enumerate(own):
            median = others_median(own, rank)
            ratios.append(seconds / median if median > 0 else 1.0)
            slow = median > 0 and seconds > (1 + self.threshold) * median
            self.slow_in_a_row[rank] = self.slow_in_a_row.get(rank, 0) + 1 if slow else 0
        named = sorted(r for r, n in self.slow_in_a_row.items() if n >= self.intervals)
        slowest = max(range(len(own)), key=lambda r: own[r])
        return StragglerReport(slowest, own, [c for _, _, c in table], [d for d, _, _ in table], ratios, named)


def gather_splits(comm, split: tuple[float, float, float], rank: int, world_size: int) -> list[tuple]:
    """Every rank's split through one all-reduce of a (world size x 3) vector (each rank fills its own row)."""
    values = [0.0] * (3 * world_size)
    values[3 * rank:3 * rank + 3] = split
    flat = comm.reduce_values(values, op="sum")
    return [tuple(flat[3 * r:3 * r + 3]) for r in range(world_size)]


def straggler_words(report: StragglerReport, hosts: dict[int, str]) -> str:
    """The step line's addition when a rank is named: `straggler rank 1 on node-3 (2.4x the other ranks' own time)`."""
    if not report.named:
        return ""
    parts = [f"rank {r}" + (f" on {hosts[r]}" if r in hosts else "")
             + f" ({report.ratios[r]:.1f}x the other ranks' own time)" for r in report.named]
    return "  straggler " + ", ".join(parts)


class StragglerWatch:
    """What the trainer holds: this rank's TimeSplit, the comparison across records, and the one all-reduce per
    record; `None` from `start` when off (`metrics.straggler_threshold = 0`, or one rank: nothing to compare)."""

    def __init__(self, threshold: float, intervals: int, comm, rank: int, world_size: int):
        self.split = TimeSplit()
        self.stragglers = Stragglers(threshold, intervals)
        self.comm, self.rank, self.world_size = comm, rank, world_size

    @classmethod
    def start(cls, metrics_cfg, comm, rank: int, world_size: int) -> "StragglerWatch | None":
        if metrics_cfg.straggler_threshold <= 0 or world_size < 2:
            return None
        return cls(metrics_cfg.straggler_threshold, metrics_cfg.straggler_intervals, comm, rank, world_size)

    def compare(self, record: dict, hosts) -> str:
        """Every rank's split of the record's steps into `record`; on rank 0 the step line's note when a rank has
        been slow for `intervals` records in a row. `hosts()` gives {rank: host}, read only then."""
        report = self.stragglers.compare(gather_splits(self.comm, self.split.take(), self.rank, self.world_size))
        record.update(report.record())
        return straggler_words(report, hosts()) if report.named and self.rank == 0 else ""

    def close(self) -> None:
        self.split.close()
