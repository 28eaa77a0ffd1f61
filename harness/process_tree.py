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


def finish(process, timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a launched run (a subprocess.Popen with text pipes, in a session of its own);
    past `timeout` every process of its group is SIGKILLed and the run fails with the tails of its output."""
    import subprocess

    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in group_processes(process.pid):
            os.kill(pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"the run did not end in {timeout} s:\n{out[-2000:]}\n{err[-3000:]}")
    return process.returncode, out, err


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def trainer_ranks(launcher: int) -> list[int]:
    """The processes that run train.main under run_train.sh's launcher (training/launcher.py, pid `launcher`): the
    children of its rank starter (training/warm_ranks.py; a child of the launcher with the launcher's own command
    line), or with RANK_START=exec torchrun's children. Never the clients that stand in for forked ranks towards
    torchrun, nor the ranks' data-loader workers."""
    children = _children(launcher)
    starters = [pid for pid in children if _cmdline(pid) == _cmdline(launcher)]
    if starters:
        return sorted(rank for starter in starters for rank in _children(starter))
    return sorted(children)


def rank_processes(launcher: int) -> dict[int, int]:
    """{global rank: pid} of trainer_ranks(launcher): a forked rank is named `train r<RANK>` (its /proc comm: its
    environment file is the launcher's), a fresh one carries RANK in its environment."""
    ranks = {}
    for pid in trainer_ranks(launcher):
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            if name.startswith("train r") and name[7:].isdigit():
                ranks[int(name[7:])] = pid
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0") if item)
            ranks[int(env[b"RANK"])] = pid
        except (OSError, KeyError, ValueError):
            continue
    return ranks
