"""Each test's CPU seconds, beside its wall time: what a test costs the CI box, whatever ran beside it.

On CI's 2 cores with three xdist workers a test's wall time says more about its neighbours than about itself: the
1M-token dry run took 44 s alone and 236 s beside a 16-rank run. CPU seconds add up to the run's length instead (the
box is busy throughout), so they are what a cut must shrink. Counted per test, from Linux's /proc/<pid>/stat: the
worker's own user and system time and its waited-for children's (run_train.sh, torchrun and every rank below it),
plus the same four of the multiprocessing forkserver that forks the tests' ranks and dry runs (tests/distributed.py),
whose children it waits for itself. A process still running when the test ends (none should) is not counted.

Each test's figure goes into the junit XML as the property `cpu_s`, and the terminal summary lists the slowest by it.
Beside it, `started` (Unix time at the test's setup) and `worker` (the xdist worker that ran it): with them a CI's
timeline can be rebuilt and laid against what the whole box did meanwhile (/proc/stat, process accounting), which
is how the CPU time that no test's own processes account for is found.
"""
from __future__ import annotations

import os
import time

import pytest

TICKS = os.sysconf("SC_CLK_TCK")
SHOWN = 40


def _process_cpu_s(pid: int | str) -> float:
    """User + system time of the process and of its waited-for children, in seconds (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / TICKS  # utime, stime, cutime, cstime (fields 14-17)


def _forkserver_pid() -> int | None:
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def _cpu_now() -> tuple[float, int | None, float]:
    server = _forkserver_pid()
    return _process_cpu_s("self"), server, _process_cpu_s(server) if server else 0.0


class CpuAccounting:
    """Measures each test in the process that runs it; the controller (or the only process) prints the summary."""

    def __init__(self):
        self.cpu_s: dict[str, float] = {}  # nodeid -> CPU seconds (setup, call and teardown)
        self.wall_s: dict[str, float] = {}  # nodeid -> the call's wall seconds

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        item.stash[_START] = _cpu_now()
        item.stash[_STARTED] = time.time()
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if call.when == "teardown" and _START in item.stash:
            own0, server0, served0 = item.stash[_START]
            own1, server1, served1 = _cpu_now()
            served = served1 - (served0 if server1 == server0 else 0.0)  # a server started in this test: all of it
            report.user_properties.append(("cpu_s", round(own1 - own0 + served, 2)))
            report.user_properties.append(("started", round(item.stash.get(_STARTED, 0.0), 1)))
            report.user_properties.append(("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")))
        return report

    def pytest_runtest_logreport(self, report):
        if report.when == "teardown":
            cpu = dict(report.user_properties).get("cpu_s")
            if cpu is not None:
                self.cpu_s[report.nodeid] = float(cpu)
        elif report.when == "call":
            self.wall_s[report.nodeid] = report.duration

    def pytest_terminal_summary(self, terminalreporter):
        if not self.cpu_s or hasattr(terminalreporter.config, "workerinput"):
            return
        shown = [kv for kv in sorted(self.cpu_s.items(), key=lambda kv: -kv[1])[:SHOWN] if kv[1] >= 0.5]
        if not shown:
            return
        terminalreporter.section(f"CPU seconds: {sum(self.cpu_s.values()):,.0f} in all over {len(self.cpu_s)} "
                                 f"tests; the {len(shown)} that used most")
        for nodeid, cpu in shown:
            terminalreporter.write_line(f"{cpu:8.1f} CPU-s {self.wall_s.get(nodeid, 0.0):7.1f} s wall  {nodeid}")


_START = pytest.StashKey[tuple]()
_STARTED = pytest.StashKey[float]()
