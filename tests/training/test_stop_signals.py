"""The stop-signal bookkeeping (training/preemption.py) without a trainer: a signal is only noted; the ranks agree
on it at the step boundary, a stop over a requeue; a bad signal name in a recipe is one line. The end-to-end runs
are tests/training/test_preemption.py (slow tier)."""
import os
import signal

import pytest
import torch

from config import RecipeError
from config.recipe import load_config
from parallelisms.comm import Collectives
from tests.distributed import run_ranks
from training.preemption import StopSignals


def test_a_signal_is_noted_not_acted_on_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopSignals(["SIGUSR1"])
    try:
        assert stop.agreed(Collectives(torch.device("cpu")), torch.device("cpu")) is None
        os.kill(os.getpid(), signal.SIGUSR1)  # the process goes on: the handler only notes it
        assert stop.received == "SIGUSR1"
        assert stop.agreed(Collectives(torch.device("cpu")), torch.device("cpu")) == "SIGUSR1"
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGUSR1) is before


CASES = [
    ([None, None, None], None),
    ([None, None, "SIGUSR1"], "SIGUSR1"),  # one rank's signal stops all of them
    (["SIGUSR1", "SIGTERM", None], "SIGTERM"),  # a stop wins over a requeue
]


def _agree(rank, world_size):
    out = []
    for seen, _ in CASES:
        stop = StopSignals([])  # no handlers in the test ranks: what each rank "saw" is set directly
        stop.names, stop.received = ["SIGTERM", "SIGUSR1"], seen[rank]
        out.append(stop.agreed(Collectives(torch.device("cpu")), torch.device("cpu")))
    return out


def test_the_ranks_agree_on_the_signal_any_of_them_saw():
    assert run_ranks(_agree, world_size=3, timeout=60) == [[agreed for _, agreed in CASES]] * 3


def test_a_signal_the_trainer_does_not_handle_is_one_line():
    with pytest.raises(RecipeError, match="checkpoint.save_on_signal names 'SIGKILL', which the trainer does not "
                                          r"handle; use any of \['SIGTERM', 'SIGUSR1'\]"):
        load_config("recipes/debug.toml", ["--checkpoint.save_on_signal", "SIGTERM,SIGKILL"])
    assert load_config("recipes/debug.toml", ["--checkpoint.save_on_signal", ""]).checkpoint.save_on_signal == []
