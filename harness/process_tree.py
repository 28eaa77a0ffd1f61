"""Ending a command together with every process it started. torchrun starts each rank in a process group (and
session) of its own, so killing the command's own group leaves the ranks running: holding the GPU during whatever
runs next, and the command's output pipes open. Used by the GPU report's steps (harness/gpu_report.py) and the GPU
benches' runs (bench/bench_gpu.py)."""
from __future__ import annotations

import os
import signal
import time


def group_processes(pgid: int) -> set[int]:
    """The running processes of a process group, and every descendant of those (torchrun starts each rank
    in a process group of its own). Zombies do not count: an orphan's zombie stays where the container's first
    process does not reap it, and it holds no GPU memory. Without /proc: the group's leader, if it runs."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return {pgid}
        except ProcessLookupError:
            return set()
    table = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]  # after the name, which may hold spaces
        except (OSError, ValueError):
            continue
        if state not in ("Z", "X"):
            table[int(pid)] = (int(ppid), int(pgrp))
    found = {pid for pid, (_, pgrp) in table.items() if pgrp == pgid}
    while True:
        more = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
        if not more:
            return found
        found |= more


def end_process_group(pgid: int, grace: float = 5.0) -> None:
    """SIGTERM to every process of the group and its descendants still running (torchrun then ends its ranks
    itself), SIGKILL to those still running after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = group_processes(pgid)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while group_processes(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
