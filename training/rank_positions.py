"""Where each rank is in the run, readable by every rank without a collective: who did not arrive at a hang.

Why: a rank that stops (a GPU or NIC fault, a stalled read, a deadlocked data worker, a stopped process) leaves every
other rank waiting in its next collective until the timeout, and the timeout's traceback names a collective, not the
rank that never came. Each rank posts its position (step, phase, micro-step) to the launch's key-value store (the
default process group's store: torchrun's rendezvous TCPStore, which every rank already talks to) at phase
boundaries only, and a daemon thread refreshes a heartbeat every HEARTBEAT_S. A rank whose collective timed out
reads every rank's post: a rank at an earlier step or phase never arrived; a rank at the same place whose heartbeat
is stale (a stopped or frozen process runs no thread) never arrived either; the others waited with it.

What a post costs: one store `set` of ~80 bytes, a TCP round trip (tens of microseconds on a node), at ~4 places a
step (data, each micro-step, optimizer, and a checkpoint or evaluation when one runs).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from training import checkpoint_files as files

PHASES = ("set-up", "data", "forward/backward", "optimizer", "checkpoint", "evaluation")
"""In the order a step passes them (set-up before step 1; a stage switch's checkpoint is posted as the step's)."""
HEARTBEAT_S = 2.0
STALE_S = 5 * HEARTBEAT_S
"""A heartbeat older than this: the rank's threads do not run (stopped, frozen), not just busy."""
_KEY = "titan/position/{}"
_BEAT = "titan/heartbeat/{}"


@dataclass(frozen=True)
class Position:
    step: int
    """The step being worked on (1 = the first)."""
    phase: str
    micro: int
    """The micro-step inside forward/backward (0 elsewhere)."""
    host: str
    since: float
    """Wall-clock time of the post."""

    def order(self) -> tuple[int, int, int]:
        return self.step, PHASES.index(self.phase), self.micro

    def describe(self) -> str:
        micro = f", micro-step {self.micro + 1}" if self.phase == "forward/backward" else ""
        return f"step {self.step} ({self.phase}{micro})"


class RankPositions:
    """This rank's posts and heartbeat in `store`; `read()` every rank's. `store` None (one process, no group):
    posts go nowhere."""

    def __init__(self, store, rank: int, world_size: int, heartbeat_s: float = HEARTBEAT_S):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread = None
        if store is not None:
            self.post(0, "set-up")
            self._beat()
            self._thread = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True,
                                            name="rank-heartbeat")
            self._thread.start()

    def post(self, step: int, phase: str, micro: int = 0) -> None:
        if self.store is not None:
            self.store.set(_KEY.format(self.rank), json.dumps([step, phase, micro, self.host, time.time()]))

    def _beat(self) -> None:
        self.store.set(_BEAT.format(self.rank), repr(time.time()))

    def _heartbeat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store went away (the run is ending): nothing to tell
                return

    def read(self) -> dict[int, tuple[Position | None, float | None]]:
        """{rank: (its last post or None, its last heartbeat's wall time or None)}, each rank's keys read without
        waiting for a rank that never posted."""
        out = {}
        for rank in range(self.world_size):
            keys = [_KEY.format(rank), _BEAT.format(rank)]
            post = beat = None
            if self.store.check(keys[:1]):
                step, phase, micro, host, since = json.loads(self.store.get(keys[0]))
                post = Position(step, phase, micro, host, since)
            if self.store.check(keys[1:]):
                beat = float(self.store.get(keys[1]))
            out[rank] = (post, beat)
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


def newest_checkpoint(folder: str) -> str | None:
    """The newest published checkpoint under `folder` whose files are all there at their written sizes (what a
    rank can check alone: checksums are the resume's own collective check)."""
    for step in reversed(files.published_steps(folder)):
        directory = files.step_dir(folder, step)
        manifest, problem = files.read_manifest(directory)
        if problem is None and files.check_files(directory, manifest["files"], []) is None:
            return directory
    return None


def hang_line(rank: int, seen: dict, now: float, timeout_s: float, resume: str | None, details: str,
              recorder: str | None = None) -> str:
    """The one line a rank whose collective timed out leaves: where it waited, who never arrived (behind it, or
    silent: no heartbeat for STALE_S), who waited with it, the timeout, the checkpoint to resume from, the file
    with the tracebacks, and on NCCL the flight recorder's folder with the command that reads it."""
    mine = seen[rank][0]
    missing, waited = [], []
    for r, (post, beat) in sorted(seen.items()):
        silent = beat is None or now - beat > STALE_S
        if post is None or (mine is not None and post.order() < mine.order()) or silent:
            where = post.describe() if post is not None else "before its first post"
            host = f" on {post.host}" if post is not None else ""
            heartbeat = "no heartbeat" if beat is None else f"heartbeat {now - beat:.0f}s old"
            missing.append(f"rank {r}{host} (last at {where}; {heartbeat})")
        else:
            waited.append(r)
    at = mine.describe() if mine is not None else "set-up"
    resume_at = f"resume from {resume}" if resume else "no checkpoint to resume from yet"
    if missing:
        who = f"{', '.join(missing)} never arrived"
    else:
        who = ("every rank is at the same place with a live heartbeat (a collective some ranks did not call, or "
               "a rank stuck inside one)")
    fr = (f"; NCCL flight recorder dumps in {recorder} (python -m torch.distributed.flight_recorder.fr_trace "
          f"{recorder})") if recorder else ""
    return (f"error: hang at {at}: {who}; rank(s) {_ranges(waited)} waited {timeout_s:.0f}s (the collective "
            f"timeout) and stopped the run; {resume_at}; tracebacks in {details}{fr}")


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5': a thousand waiting ranks stay one line."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts) or "none"


def write_details(folder: str, rank: int, text: str) -> str:
    """This rank's tracebacks in `folder`/hang/rank_<rank>.txt; returns the folder."""
    directory = os.path.join(folder, "hang")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"rank_{rank}.txt"), "w") as f:
        f.write(text)
    return directory


HANG_FILE_ENV = "TRAIN_HANG_FILE"
"""A file training/launcher.py makes for each launch: every rank whose collective timed out appends its line there,
and the launcher prints the lowest rank's last, after torchrun's own summary."""
HANG_EXIT_CODE = 76
"""The launcher's exit code when a collective timed out (a hang) and no restart is left: its line printed, the job
may resume from the newest intact checkpoint (slurm/train.sbatch requeues it, up to MAX_REQUEUES times). 76 is
sysexits' EX_PROTOCOL, beside the disk's 74 and the requeue of a saved step's 75."""


def is_collective_timeout(error: BaseException) -> bool:
    """A collective that gave up waiting (gloo: "Timed out waiting ...ms"; c10d's DistBackendError on a timeout), not
    a peer that died (gloo: "Connection closed by peer": the launcher names a dead rank itself)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text) and "closed" not in text


def report_hang(rank: int, line: str) -> None:
    """The line to the launcher's hang file (HANG_FILE_ENV), or to stderr when no launcher made one."""
    path = os.environ.get(HANG_FILE_ENV)
    if not path:
        print(line, file=sys.stderr, flush=True)
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (json.dumps({"rank": rank, "line": line}) + "\n").encode())
    finally:
        os.close(fd)


def reported_hang(path: str) -> str | None:
    """The lowest rank's line in a launch's hang file, or None."""
    try:
        with open(path) as f:
            entries = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return None
    return min(entries, key=lambda e: e["rank"])["line"] if entries else None
