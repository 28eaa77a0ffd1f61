"""training/launcher.py on a torch whose torchrun has no `--shutdown-timeout` (torch 2.11: its run.py has
`--signals-to-handle` but not that flag, and its agent's signal path calls `self._pcontext.close(death_sig)`, the
30 s default, read from the 2.11.0 wheel): the flag must not reach torchrun's parser, and the grace it asks for must
become the timeout of that close. On the installed torch (2.13, which has the flag) nothing changes."""
import argparse
import signal

from torch.distributed.elastic.multiprocessing.api import PContext, SignalException

from training import launcher

ARGV = ["--signals-to-handle", "SIGTERM,SIGUSR1", "--shutdown-timeout", "600", "--nproc-per-node", "2",
        "/repo/train.py", "--training.steps", "5"]


def torch_2_11_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--signals-to-handle")
    parser.add_argument("--nproc-per-node")
    return parser


def test_on_torch_2_11_the_grace_leaves_torchruns_arguments_and_becomes_its_close_timeout(monkeypatch):
    closed = []
    monkeypatch.setattr(PContext, "close", lambda self, death_sig=None, timeout=30: closed.append((death_sig, timeout)))
    argv = launcher.grace_on_any_torch(list(ARGV), torch_2_11_parser())
    assert argv == ["--signals-to-handle", "SIGTERM,SIGUSR1", "--nproc-per-node", "2", "/repo/train.py",
                    "--training.steps", "5"]
    torch_2_11_parser().parse_known_args(argv)  # torchrun's parser takes what is left
    try:  # 2.11's signal path: inside the agent's `except SignalException`, the timeout left to its default
        raise SignalException("got signal", sigval=signal.SIGUSR1)
    except SignalException as e:
        PContext.close(object(), e.sigval)
    assert closed == [(signal.SIGUSR1, 600)]


def test_on_torch_2_11_a_restart_or_the_end_keeps_its_own_close_timeout(monkeypatch):
    """Issue 57 item 7: the agent's `_stop_workers` (a restart after a rank failed) and the close at the end call
    the same PContext.close outside any SignalException; raised to the grace, each dead rank would wait that long
    for survivors stuck in a collective before the restart."""
    closed = []
    monkeypatch.setattr(PContext, "close", lambda self, death_sig=None, timeout=30: closed.append((death_sig, timeout)))
    launcher.grace_on_any_torch(list(ARGV), torch_2_11_parser())
    PContext.close(object())  # _stop_workers -> _shutdown() -> close(SIGTERM by default, 30)
    try:
        raise RuntimeError("a rank failed")
    except RuntimeError:
        PContext.close(object(), signal.SIGTERM)  # any other exception in flight is no signal either
    assert closed == [(None, 30), (signal.SIGTERM, 30)]


def test_a_torchrun_that_knows_the_flag_gets_it_unchanged(monkeypatch):
    before = PContext.close
    assert launcher.grace_on_any_torch(list(ARGV)) == ARGV  # the installed torch's own parser
    assert PContext.close is before
