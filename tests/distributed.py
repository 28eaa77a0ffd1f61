"""Run a function on N real gloo ranks in separate processes, with a hard timeout so a hang fails fast.

Usage in a test:  results = run_ranks(_body, world_size=4, args=(x,), timeout=120)
`_body(rank, world_size, *args)` must be a module-level function; it runs after the default process group is
initialised (gloo, CPU; or `backend="nccl"`: one GPU per rank, cuda:<rank> made current and bound to the group)
and its return value (picklable) comes back in rank order. An exception on any rank fails the test with that rank's
traceback.
"""
from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import sys
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, args, queue, threads, backend, stacks_after):
    # A rank still running when the parent's limit is near writes every thread's stack to stderr (the test's
    # captured output): a hang fails with where it hangs.
    faulthandler.dump_traceback_later(stacks_after, exit=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device_id = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60),
                                device_id=device_id)
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        # Plain pickle copies tensor data; the queue's own pickler would share memory that dies with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including KeyboardInterrupt in the child
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 180.0, threads: int = 1,
              backend: str = "gloo") -> list:
    """`fn(rank, world_size, *args)` on `world_size` spawned ranks of one process group; their results by rank. The
    store's port is picked free but may be taken before rank 0 listens on it (other tests start processes at the same
    time): a run whose rank 0 found it taken (EADDRINUSE) is started once more on a new port."""
    try:
        return _run_ranks_once(fn, world_size, args, timeout, threads, backend)
    except RuntimeError as err:
        if "EADDRINUSE" not in str(err):
            raise
        return _run_ranks_once(fn, world_size, args, timeout, threads, backend)


def _run_ranks_once(fn, world_size: int, args: tuple, timeout: float, threads: int, backend: str) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    stacks_after = max(1.0, timeout - 3.0)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue, threads, backend, stacks_after),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) + len(errors) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                raise TimeoutError(f"{world_size}-rank run did not finish within {timeout:.0f}s "
                                   f"(finished ranks: {sorted(results)})")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                if errors and all(not p.is_alive() or p.exitcode is not None for p in procs):
                    break
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead and not errors:
                    raise RuntimeError(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
                if errors:  # the others are probably blocked in a collective with the failed rank
                    break
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("rank failure:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def thread_stacks(threads) -> str:
    """The current stack of every thread in `threads` still alive: where ranks run as threads of one process
    (tests/nccl_rules.py), what a hang is waiting on."""
    frames = sys._current_frames()
    return "\n".join(f"--- {t.name} ---\n" + "".join(traceback.format_stack(frames[t.ident]))
                     for t in threads if t.is_alive() and t.ident in frames)


class WireBytes:
    """Counts the bytes this rank hands to torch.distributed to send, measured at the collective calls themselves, as
    an independent check of the counters the CP code keeps (CommStats). Patches the `torch.distributed` functions
    while active (inside one rank's process): isend ops of batch_isend_irecv, all-gather ((P-1) x the input),
    reduce-scatter ((P-1) x the output) and all-to-all (equal splits: (P-1)/P x the input; variable splits: every
    input split but the one this rank keeps)."""

    NAMES = ("batch_isend_irecv", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
             "reduce_scatter_tensor", "all_to_all_single")

    def __init__(self):
        self.sent = 0
        self._saved = {}
        self._inside = False  # one collective implemented through another is counted once

    def _count(self, name, fn):
        import torch.distributed as dist

        def counted(*args, **kwargs):
            if self._inside:
                return fn(*args, **kwargs)
            group = kwargs.get("group")
            if name == "batch_isend_irecv":
                self.sent += sum(op.tensor.nbytes for op in args[0] if op.op.__name__ == "isend")
            else:
                size = dist.get_world_size(group)
                output, inp = args[0], args[1]
                if name.startswith("all_gather"):
                    self.sent += (size - 1) * inp.nbytes
                elif name.startswith("reduce_scatter"):
                    self.sent += (size - 1) * output.nbytes
                elif kwargs.get("input_split_sizes") is not None:  # uneven: every split but this rank's own
                    splits, me = kwargs["input_split_sizes"], dist.get_rank(group)
                    row_bytes = inp.nbytes // inp.size(0) if inp.numel() else 0
                    self.sent += row_bytes * (sum(splits) - splits[me])
                else:
                    self.sent += inp.nbytes * (size - 1) // size
            self._inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = False
        return counted

    def __enter__(self):
        import torch.distributed as dist

        for name in self.NAMES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._count(name, self._saved[name]))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
