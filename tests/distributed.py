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
import subprocess
import sys
import tempfile
import traceback

from harness import forked_launch


# What every rank and probe process imports first (~6 s of one core each on a 2-core CI box, more than most tests'
# own work): imported once by the forkserver of each test process, which then forks every child from that state.
# torch._dynamo too: every trainer rank imports it when it initialises the model's weights (torch._refs' normal_
# under the meta device goes through torch._compile), about 1 s of one core per rank: 16 s of a 16-rank run.
PRELOADED = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "training.trainer",
             "training.planning.memory_probe", "train", "harness.forked_launch")


def fresh_process_context():
    """A multiprocessing context for processes that must start clean (no process group, no fake mode, no patched
    module of the test's own process): children are forked from a server process that has only imported
    PRELOADED, which spawn's children would each import again. Like spawn's children they get the parent's sys.path
    and working directory; `run_ranks` hands them the parent's environment too (the server's is from when it
    started)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))  # read when the server starts: the first use in this process
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, args, queue, threads, backend, stacks_after, environ):
    os.environ.clear()  # the test's environment at launch, as a spawned process would have it
    os.environ.update(environ)
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
    """`fn(rank, world_size, *args)` on `world_size` fresh ranks of one process group; their results by rank. The
    store's port is picked free but may be taken before rank 0 listens on it (other tests start processes at the same
    time): a run whose rank 0 found it taken (EADDRINUSE) is started once more on a new port."""
    try:
        return _run_ranks_once(fn, world_size, args, timeout, threads, backend)
    except RuntimeError as err:
        if "EADDRINUSE" not in str(err):
            raise
        return _run_ranks_once(fn, world_size, args, timeout, threads, backend)


def _run_ranks_once(fn, world_size: int, args: tuple, timeout: float, threads: int, backend: str) -> list:
    ctx = fresh_process_context()
    queue = ctx.Queue()
    port = free_port()
    stacks_after = max(1.0, timeout - 3.0)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue, threads, backend, stacks_after,
                                                dict(os.environ)),
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


class RunTimedOut(subprocess.TimeoutExpired):
    """subprocess.TimeoutExpired whose message ends with the run's last output, the ranks' stacks included (they
    print them shortly before the limit): a hang in CI fails with where it hung, not only the command line."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n--- the end of its stderr ---\n{(self.stderr or '')[-12000:]}"


def forked_train(nproc: int, train_args: list[str], env: dict, cwd: str,
                 timeout: float, before_rank=None) -> subprocess.CompletedProcess:
    """`python harness/forked_launch.py NPROC train.py *train_args` as subprocess.run(capture_output=True, text=True)
    would run it, but started from the forkserver (fresh_process_context): the launcher does not import torch and the
    trainer again. Imports that read the environment ran in the server, so an `env` that differs from the test
    process' in more than the thread count needs the real subprocess (forked_launch.command). `nproc` 0: `python
    train.py *train_args` itself, one process and no rank (the dry runs: ~4.5 CPU-s of imports each before).
    `before_rank`: a module-level function each rank runs first (forked_launch.launch). Past `timeout` it raises
    RunTimedOut, with every rank's stacks as they were ~15 s before the limit."""
    ctx = fresh_process_context()
    with tempfile.TemporaryDirectory() as folder:
        out_path, err_path = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        proc = ctx.Process(target=forked_launch.run_as_child,
                           args=(nproc, list(train_args), dict(env), cwd, out_path, err_path, before_rank,
                                 max(timeout - 15, 0.8 * timeout)))
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            proc.kill()  # its ranks get SIGKILL with it (forked_launch's parent-death signal)
            proc.join(5)
        with open(out_path) as f_out, open(err_path) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    args = ["forked_launch", str(nproc), "train.py", *train_args] if nproc else ["train.py", *train_args]
    if timed_out:
        raise RunTimedOut(args, timeout, output=stdout, stderr=stderr)
    code = proc.exitcode if proc.exitcode >= 0 else 128 - proc.exitcode
    return subprocess.CompletedProcess(args, code, stdout, stderr)


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
