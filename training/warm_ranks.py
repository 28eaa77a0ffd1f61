"""The launcher's rank starter: torchrun's ranks forked from an interpreter that has imported the trainer once.

torchrun starts each rank as a fresh interpreter, which imports torch and the trainer before its first line of work
(4-5 CPU seconds each on a 2-core box: a node's 8 ranks pay it 8 times, and again at every restart). The launcher
(training/launcher.py) has those modules imported already, for the launch check. Right after importing them, before
the check or torchrun runs anything, it forks this starter: a process that holds that state untouched and forks one
rank per request. torchrun still starts, watches, signals and restarts every rank as before, through the small
program it now runs for each (training/warm_rank_client.py), which asks for the rank here and stands in for it.

Each rank is a child of the starter in a session and process group of its own (torchrun's start_new_session), with
the client's standard streams, environment, working directory and argv, so it runs the same train.main() as
`python -u train.py ...` would, from the same state but the imports. What a fork would carry over wrongly is reset:
signal dispositions, the CUDA driver (it is never loaded here: a starter that finds it loaded, or torch's CUDA state
initialised, answers `exec` and every client starts its rank as torchrun would), and the death of the starter's
parent (PR_SET_PDEATHSIG: the starter dies with the launcher, a rank with the starter). A client that dies (torchrun's
SIGKILL after the grace period) has its rank's group killed.

`RANK_START=exec` (run_train.sh) turns the starter off: torchrun starts each rank itself, as before.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import traceback

from training.warm_rank_client import FORWARDED, HEADER, SOCKET_ENV

RANK_START_ENV = "RANK_START"
RANK_START_CHOICES = ("fork", "exec")
CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_rank_client.py")
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def rank_start_mode() -> str:
    """RANK_START from the environment: `fork` (the default) or `exec`; anything else is refused in one line."""
    mode = os.environ.get(RANK_START_ENV, "fork") or "fork"
    if mode not in RANK_START_CHOICES:
        raise SystemExit(f"error: RANK_START={mode!r} is not one of {', '.join(RANK_START_CHOICES)}: `fork` starts the "
                         f"ranks from the launcher's imported trainer, `exec` as fresh interpreters (torchrun's way).")
    return mode


def cuda_driver_loaded(maps: str | None = None) -> bool:
    """Whether this process has loaded the CUDA driver (libcuda) or initialised torch's CUDA state: a process forked
    after that cannot use the GPU. `maps`: /proc/self/maps' text (read when None)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return True  # cannot tell: do not fork
    if any(os.path.basename(line.split()[-1]).startswith("libcuda.so") for line in maps.splitlines() if line.split()):
        return True
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _prctl(option: int, value) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


class WarmRanks:
    """A running starter: `route(argv)` makes torchrun's arguments run the client, `stop()` ends the starter (and any
    rank still running: torchrun has returned by then)."""

    def __init__(self, pid: int, folder: str, control_fd: int):
        self.pid, self.folder, self.control_fd = pid, folder, control_fd
        self.socket_path = os.path.join(folder, "socket")

    @classmethod
    def start(cls, entry, script: str) -> "WarmRanks | None":
        """Forks the starter for `entry`, the loaded train.py module at path `script`; None where ranks are not to be
        forked (RANK_START=exec, or no Unix descriptor passing)."""
        if rank_start_mode() == "exec" or not hasattr(socket, "send_fds") or not sys.platform.startswith("linux"):
            return None
        folder = tempfile.mkdtemp(prefix="train-ranks-")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(folder, "socket"))
        listener.listen(64)
        control_read, control_write = os.pipe()
        launcher = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(control_write)
                Starter(entry, os.path.abspath(script), listener, control_read, launcher).serve()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        listener.close()
        os.close(control_read)
        return cls(pid, folder, control_write)

    def route(self, argv: list[str], script_at: int) -> list[str]:
        """torchrun's arguments with the client as its script, train.py its first argument; the client finds the
        starter through the environment torchrun hands down."""
        os.environ[SOCKET_ENV] = self.socket_path
        return [*argv[:script_at], CLIENT, *argv[script_at:]]

    def stop(self) -> None:
        os.environ.pop(SOCKET_ENV, None)
        os.close(self.control_fd)  # the starter's signal to end
        os.waitpid(self.pid, 0)
        shutil.rmtree(self.folder, ignore_errors=True)


class Starter:
    """The starter process' loop: a rank per client request, each one's exit status back to its client."""

    def __init__(self, entry, script: str, listener: socket.socket, control_fd: int, launcher: int):
        self.entry, self.script, self.listener, self.control_fd = entry, script, listener, control_fd
        self.launcher = launcher
        self.ranks: dict[socket.socket, int] = {}  # client connection -> rank pid (until the rank is reaped)
        self.clients: dict[int, socket.socket] = {}  # rank pid -> client connection

    def serve(self) -> None:
        os.setsid()  # the launcher's terminal and process group are torchrun's to handle
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != self.launcher:
            return  # the launcher ended before the line above
        for sig in FORWARDED:  # a signal to "every process" of a run is for the ranks, which get theirs
            signal.signal(sig, signal.SIG_IGN)
        self.wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a rank's exit wakes the select below
        # Every rank imports torch._dynamo at its first weight initialisation (torch._refs' normal_ on the meta device
        # goes through torch._compile), ~0.6 CPU-s each: imported once here instead, while the launcher checks the
        # launch. Before the CUDA check below: were the import ever to load the driver, the ranks would start cold.
        import torch._dynamo  # noqa: F401
        self.cold = cuda_driver_loaded()
        try:
            while True:
                waiting = [self.listener, self.control_fd, self.wake_read, *self.ranks]
                ready, _, _ = select.select(waiting, [], [], 5.0)
                if self.wake_read in ready:
                    os.read(self.wake_read, 512)
                self._reap()
                if self.control_fd in ready:
                    return  # the launcher is done (torchrun has returned)
                if self.listener in ready:
                    self._start_rank()
                for client in [c for c in ready if isinstance(c, socket.socket) and c in self.ranks]:
                    if not client.recv(1):  # the client died (torchrun's SIGKILL): so does its rank
                        _kill_group(self.ranks[client])
        finally:
            for pid in list(self.clients):
                _kill_group(pid)
            self._reap(block=True)

    def _start_rank(self) -> None:
        client, _ = self.listener.accept()
        try:
            header, fds, _, _ = socket.recv_fds(client, HEADER.size, 3)
            header += _read_exactly(client, HEADER.size - len(header))
            request = json.loads(_read_exactly(client, HEADER.unpack(header)[0]))
        except (OSError, ValueError):
            client.close()
            return
        if self.cold or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            _send(client, "exec")
            client.close()
            return
        pid = os.fork()
        if pid == 0:
            self._become_rank(request, fds, client)
        for fd in fds:
            os.close(fd)
        self.ranks[client], self.clients[pid] = pid, client
        _send(client, f"pid {pid}")

    def _become_rank(self, request: dict, fds: list[int], client: socket.socket) -> None:
        """In the forked child: the rank, as `python -u train.py ...` with the client's streams and environment."""
        code = 1
        try:
            os.setsid()  # a session and process group of its own, as torchrun starts each rank
            signal.set_wakeup_fd(-1)
            for sig in (*FORWARDED, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # no rank outlives its starter
            for held in (self.listener, client, *self.ranks):
                held.close()
            for fd in (self.control_fd, self.wake_read):
                os.close(fd)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            sys.argv = [self.script, *request["argv"][1:]]
            for stream in (sys.stdout, sys.stderr):  # `python -u`, as torchrun runs a rank
                stream.reconfigure(line_buffering=True, write_through=True)
            _prctl(PR_SET_NAME, f"train r{os.environ.get('RANK', '')}".encode()[:15])
            code = int(self.entry.main(request["argv"][1:]) or 0)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # printed as Python would, but the exit below is taken in any case (train.py's own)
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _reap(self, block: bool = False) -> None:
        while self.clients:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            client = self.clients.pop(pid, None)
            if client is not None:
                self.ranks.pop(client, None)
                _send(client, f"exit {status}")
                client.close()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("the client closed its request early")
        data += chunk
    return data


def _send(client: socket.socket, line: str) -> None:
    try:
        client.sendall(line.encode() + b"\n")
    except OSError:
        pass  # the client died: nobody is waiting for the line


def _kill_group(pid: int) -> None:
    """SIGKILL to a rank's process group, and to the rank itself (a rank forked a moment ago may not lead its group
    yet)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
