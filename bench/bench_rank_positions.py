"""What the hang watch and the straggler split cost a training step: each rank's position posts and heartbeat
(training/rank_positions.py), or the sampling thread that splits each rank's time (training/stragglers.py; issue 58
asks <= 1% of a debug step for each).

The debug recipe on 2 ranks forked from this process (harness/forked_launch.py, torchrun's environment contract), run
alternately with the feature on (as shipped) and off (positions: RankPositions given no store, no post, no heartbeat
thread, as in a one-process run; stragglers: `metrics.straggler_threshold = 0`, no sampling thread and no
all-reduce), `--repeats` times each, so both see the same box in the same minutes. Per run: the median step time of
steps 3 on (metrics.jsonl `step_time`; steps 1-2 build and warm up) and, with the feature on, what it spent itself:
the seconds inside `post` per step on each rank (timed around every call), or the sampling thread's CPU seconds per
step. The ratio of the medians says what a user sees; the feature's own seconds say what it costs, far below the
step-to-step noise of a 2-core box.

    python bench/bench_rank_positions.py [--feature positions|stragglers] [--steps 30] [--repeats 3]
        [--out bench/measurements]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from harness import forked_launch  # noqa: E402


def _run(feature: str, watch: bool, steps: int, folder: str) -> int:
    """One 2-rank debug run in a child process; the feature off, or what it spends recorded. Returns the exit code."""
    pid = os.fork()
    if pid:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    import time as clock

    import training.rank_positions as positions
    import training.stragglers as stragglers
    import training.trainer as trainer

    extra = []
    if feature == "stragglers":
        if watch:
            close = stragglers.TimeSplit.close

            def close_and_write(self):
                close(self)
                with open(os.path.join(folder, f"spent_rank{os.environ['RANK']}.json"), "w") as f:
                    json.dump({"seconds": self.sampler_cpu_s, "posts": 0}, f)

            stragglers.TimeSplit.close = close_and_write
        else:
            extra = ["--metrics.straggler_threshold", "0"]
    elif watch:
        post, close, spent = positions.RankPositions.post, positions.RankPositions.close, [0.0, 0]

        def timed_post(self, *args, **kwargs):
            start = clock.perf_counter()
            post(self, *args, **kwargs)
            spent[0] += clock.perf_counter() - start
            spent[1] += 1

        def close_and_write(self):
            close(self)
            with open(os.path.join(folder, f"spent_rank{self.rank}.json"), "w") as f:
                json.dump({"seconds": spent[0], "posts": spent[1]}, f)

        positions.RankPositions.post, positions.RankPositions.close = timed_post, close_and_write
    else:
        class Unwatched(positions.RankPositions):
            def __init__(self, store, rank, world_size, **kwargs):
                super().__init__(None, rank, world_size, **kwargs)

        trainer.RankPositions = Unwatched
    code = forked_launch.launch(2, [os.path.join(ROOT, "recipes", "debug.toml"), "--job.dump_folder", folder,
                                    "--training.steps", str(steps), "--metrics.enable_tensorboard", "false",
                                    *extra])
    os._exit(code)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _step_times(folder: str) -> list[float]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [r["step_time"] for r in map(json.loads, f) if r["step"] >= 3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--feature", choices=("positions", "stragglers"), default="positions")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "measurements"))
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-positions-") as tmp:
        for i in range(args.repeats):
            for watch in (True, False) if i % 2 == 0 else (False, True):
                folder = os.path.join(tmp, f"run{len(runs)}")
                start = time.perf_counter()
                code = _run(args.feature, watch, args.steps, folder)
                if code != 0:
                    sys.exit(f"bench_rank_positions: a {'watched' if watch else 'unwatched'} run exited {code}")
                times = _step_times(folder)
                run = {"watch": watch, "median_step_s": statistics.median(times), "steps": len(times),
                       "wall_s": round(time.perf_counter() - start, 1)}
                if watch:
                    spent = [json.load(open(os.path.join(folder, f"spent_rank{r}.json"))) for r in range(2)]
                    run["spent_s_per_step"] = max(p["seconds"] for p in spent) / args.steps
                    if args.feature == "positions":
                        run["posts_per_step"] = max(p["posts"] for p in spent) / args.steps
                runs.append(run)
                print(f"{args.feature} {'on ' if watch else 'off'}: median step {run['median_step_s'] * 1e3:.1f} ms "
                      f"({run['steps']} steps)" + (f", spent {run['spent_s_per_step'] * 1e6:.0f} us per step"
                                                   if watch else ""), flush=True)
    on = statistics.median(r["median_step_s"] for r in runs if r["watch"])
    off = statistics.median(r["median_step_s"] for r in runs if not r["watch"])
    spent = statistics.median(r["spent_s_per_step"] for r in runs if r["watch"])
    summary = {"on_median_step_s": on, "off_median_step_s": off, "ratio_on_off": on / off,
               "spent_s_per_step": spent, "spent_share_of_step": spent / on}
    what = "posts" if args.feature == "positions" else "the sampling thread's CPU"
    print(f"median step: {args.feature} on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms (ratio {on / off:.4f}); {what} "
          f"{spent * 1e6:.0f} us per step = {100 * spent / on:.3f}% of a step")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    record = {"bench": "bench/bench_rank_positions.py", "feature": args.feature, "commit": commit, "cpu": _cpu_model(), "cores": os.cpu_count(),
              "date": datetime.date.today().isoformat(), "steps": args.steps, "runs": runs, **summary}
    os.makedirs(args.out, exist_ok=True)
    name = "rank_positions" if args.feature == "positions" else "stragglers"
    path = os.path.join(args.out, f"{name}_cpu_{record['date']}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"written: {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
