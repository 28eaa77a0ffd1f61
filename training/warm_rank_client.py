"""What torchrun starts for each rank when the launcher forks its ranks from a warm interpreter (training/warm_ranks.py).

    python -u training/warm_rank_client.py train.py [RECIPE] [--section.key value ...]

torchrun starts every rank as a fresh interpreter, and each one imports torch and the trainer before its first line
of work: 4-5 CPU seconds on a 2-core box, 8x that for a node's 8 ranks, again at every restart. Here torchrun starts
this small program instead (no torch, ~30 ms). It hands its arguments, environment, working directory and standard
streams to the launcher's rank starter, which forks the rank from an interpreter that has already imported
everything, and then stands in for the rank towards torchrun: every signal torchrun or a user sends it goes on to the
rank's process group (as torchrun's own signals reach a rank's group), and it exits as the rank did, with the same
code or by the same signal, so torchrun's failure records and the launcher's last line (a SIGKILL from outside the
run, a rank torchrun stopped) read exactly as for a rank torchrun started itself. When this process dies (torchrun's
SIGKILL after the grace period) the starter kills the rank's group. Where the starter cannot fork a usable rank (the
CUDA driver was loaded before its fork), or is gone, this process becomes the rank itself: it execs
`python -u train.py ...` as torchrun would have, under its own pid.

Nothing here imports torch or the training package: it must start in milliseconds.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "TRAIN_WARM_RANKS_SOCKET"
"""The rank starter's socket, set by the launcher for torchrun's children; absent: this process execs the rank."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
"""torchrun's --signals-to-handle (run_train.sh's five) and SIGUSR2: what a rank may be told; SIGKILL and SIGSTOP
cannot be caught, and a SIGKILL of this process makes the starter kill the rank."""
HEADER = struct.Struct("!Q")
"""The request's length, sent with the three standard streams' descriptors; the request (JSON) follows."""


def request_bytes(argv: list[str]) -> bytes:
    env = {key: value for key, value in os.environ.items() if key != SOCKET_ENV}
    return json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()


def exec_rank(argv: list[str]) -> None:
    """Become the rank the way torchrun starts one: a fresh `python -u train.py ...` in this process."""
    os.environ.pop(SOCKET_ENV, None)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-u", *argv])


def exit_as(status: int) -> None:
    """Exit with the rank's wait status: its code, or death by its signal (SIGKILL stays SIGKILL for the launcher's
    OOM-killer line)."""
    sys.stdout.flush()
    sys.stderr.flush()
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # their disposition cannot be set: it is the default
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a stop signal does not end a process: say which one it was
    os._exit(code)


def main(argv: list[str]) -> int:
    path = os.environ.get(SOCKET_ENV)
    if not path or not argv:
        exec_rank(argv)
    rank: list[int] = []
    pending: list[int] = []

    def forward(sig, frame):
        if not rank:
            pending.append(sig)  # the rank is being forked: it gets the signal as soon as its pid is known
            return
        try:
            os.killpg(rank[0], sig)
        except ProcessLookupError:  # forked a moment ago, not yet leading its group; or exited (status on the way)
            try:
                os.kill(rank[0], sig)
            except ProcessLookupError:
                pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    starter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        starter.connect(path)
        request = request_bytes(argv)
        socket.send_fds(starter, [HEADER.pack(len(request))], [0, 1, 2])
        starter.sendall(request)
    except OSError:
        starter.close()
        exec_rank(argv)  # the starter is gone (its launcher is ending): start the rank as torchrun would
    replies = starter.makefile("r")
    for line in replies:
        kind, _, value = line.strip().partition(" ")
        if kind == "exec":
            replies.close()
            starter.close()
            exec_rank(argv)
        elif kind == "pid":
            rank.append(int(value))
            for sig in pending:
                forward(sig, None)
        elif kind == "exit":
            exit_as(int(value))
    print(f"error: the launcher's rank starter ended before rank {os.environ.get('RANK', '?')} did "
          f"(training/warm_ranks.py); the rank was killed with it.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
