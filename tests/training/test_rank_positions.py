"""Who never arrived (training/rank_positions.py): ranks' positions through a real c10d store, and the one line a
rank whose collective timed out leaves, for each way a rank can fail to arrive (behind, frozen, never posted) and
for none. The end-to-end run (a rank frozen with SIGSTOP mid-step, the launcher's last line) is in
tests/training/test_timeouts.py (slow tier)."""
import time

import pytest
import torch.distributed as dist

from training.launcher import HANG_GRACE_S, RankStops
from training.rank_positions import (STALE_S, Position, RankPositions, hang_line, is_collective_timeout,
                                     report_hang, reported_hang)


def _at(step, phase, micro=0, host="node7"):
    return Position(step, phase, micro, host, 0.0)


NOW = 1000.0


def test_a_rank_behind_the_waiters_never_arrived():
    seen = {0: (_at(8, "forward/backward"), NOW - 1), 1: (_at(8, "data", host="node9"), NOW - 1),
            2: (_at(8, "forward/backward"), NOW - 1), 3: (_at(8, "forward/backward"), NOW - 1)}
    line = hang_line(0, seen, NOW, 20, "out/checkpoints/step-5", "out/hang")
    assert line == ("error: hang at step 8 (forward/backward, micro-step 1): rank 1 on node9 (last at step 8 (data); "
                    "heartbeat 1s old) never arrived; rank(s) 0, 2-3 waited 20s (the collective timeout) and stopped "
                    "the run; resume from out/checkpoints/step-5; tracebacks in out/hang")
    assert "OOM" not in line and "\n" not in line


def test_a_frozen_rank_at_the_same_place_never_arrived_and_no_checkpoint_is_said():
    seen = {0: (_at(8, "forward/backward", 1), NOW - 1), 1: (_at(8, "forward/backward", 1), NOW - STALE_S - 5)}
    line = hang_line(0, seen, NOW, 60, None, "out/hang")
    assert "rank 1 on node7 (last at step 8 (forward/backward, micro-step 2); heartbeat 15s old) never arrived" in line
    assert "rank(s) 0 waited 60s" in line and "no checkpoint to resume from yet" in line


def test_a_rank_that_never_posted_and_the_case_of_no_one_behind():
    seen = {0: (_at(1, "forward/backward"), NOW), 1: (None, None)}
    assert "rank 1 (last at before its first post; no heartbeat) never arrived" in hang_line(0, seen, NOW, 600, None,
                                                                                           "h")
    same = {0: (_at(3, "optimizer"), NOW), 1: (_at(3, "optimizer"), NOW)}
    line = hang_line(1, same, NOW, 60, None, "h")
    assert "every rank is at the same place with a live heartbeat" in line and "rank(s) 0-1 waited" in line


def test_positions_and_heartbeats_go_through_the_store():
    store = dist.HashStore()
    ranks = [RankPositions(store, r, 2, heartbeat_s=0.05) for r in range(2)]
    try:
        ranks[1].post(4, "data")
        ranks[0].post(4, "forward/backward", 1)
        seen = ranks[0].read()
        assert seen[0][0].describe() == "step 4 (forward/backward, micro-step 2)"
        assert seen[1][0].describe() == "step 4 (data)" and seen[1][0].order() < seen[0][0].order()
        first_beat = seen[1][1]
        time.sleep(0.3)
        assert ranks[0].read()[1][1] > first_beat  # the heartbeat thread keeps it fresh
    finally:
        for r in ranks:
            r.close()
    lone = RankPositions(dist.HashStore(), 0, 2)  # rank 1 never started
    try:
        assert lone.read()[1] == (None, None)
    finally:
        lone.close()


def test_timeouts_are_told_from_dead_peers():
    assert is_collective_timeout(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms "
                                              "for recv operation to complete"))
    assert is_collective_timeout(dist.DistBackendError("Watchdog caught collective operation timeout"))
    assert not is_collective_timeout(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert not is_collective_timeout(ValueError("timed out"))


def test_the_launcher_prints_the_lowest_rank_s_line_and_shortens_the_grace(tmp_path, monkeypatch):
    path = tmp_path / "hang"
    path.write_text("")
    monkeypatch.setenv("TRAIN_HANG_FILE", str(path))
    report_hang(2, "error: from rank 2")
    report_hang(0, "error: from rank 0")
    assert reported_hang(str(path)) == "error: from rank 0"

    closes = []

    class FakeContext:
        subprocess_handlers = {}

        def close(self, death_sig=None, timeout=30):
            closes.append(timeout)

    import training.launcher as launcher
    monkeypatch.setattr(launcher, "PContext", FakeContext)
    monkeypatch.setattr(launcher, "_TORCH_CLOSE", FakeContext.close)
    stops = RankStops(str(path))
    stops.install()
    attempt = FakeContext()
    attempt.close(None, 600)  # a hang was reported: the save-on-signal grace is not waited
    assert closes == [HANG_GRACE_S] and stops.hang == "error: from rank 0" and path.read_text() == ""
    attempt.close(None, 600)  # torchrun closes an attempt again in its finally: the line stays
    assert closes == [HANG_GRACE_S, HANG_GRACE_S] and stops.hang == "error: from rank 0"
    FakeContext().close(None, 600)  # the next attempt's close (after a restart), nothing reported: as asked
    assert closes == [HANG_GRACE_S, HANG_GRACE_S, 600] and stops.hang is None


def test_with_restarts_left_an_attempts_hang_line_is_printed_when_torchrun_closes_it(tmp_path, monkeypatch, capsys):
    """MAX_RESTARTS=1: the first attempt's hang is said at its close (torchrun restarts next); the second attempt's
    is left for the launcher's last line, once."""
    path = tmp_path / "hang"

    class FakeContext:
        subprocess_handlers = {}

        def close(self, death_sig=None, timeout=30):
            pass

    import training.launcher as launcher
    monkeypatch.setattr(launcher, "PContext", FakeContext)
    monkeypatch.setattr(launcher, "_TORCH_CLOSE", FakeContext.close)
    stops = RankStops(str(path), max_restarts=1)
    stops.install()
    for attempt in (FakeContext(), FakeContext()):
        path.write_text('{"rank": 1, "line": "error: hang at step 8"}\n')
        attempt.close(None, 600)
        attempt.close(None, 600)
    printed = capsys.readouterr().err.splitlines()
    assert printed == ["error: hang at step 8; torchrun restarts the job (restart 1 of 1: MAX_RESTARTS)"]
    assert stops.hang == "error: hang at step 8"
    assert [launcher.max_restarts(a) for a in (["--max-restarts", "2", "train.py"], ["--max_restarts=3", "x/train.py"],
                                               ["train.py", "--max-restarts", "5"], [])] == [2, 3, 0, 0]


@pytest.mark.parametrize("phase", ["set-up", "evaluation"])
def test_phases_order_within_a_step(phase):
    assert _at(5, phase).order() < _at(6, "set-up" if phase == "evaluation" else "data").order()


def test_on_nccl_the_line_names_the_flight_recorder_and_the_command_that_reads_it(tmp_path):
    """Issue 58 item 2: NCCL's flight recorder on (job.flight_recorder_entries), its dumps under the run's outputs,
    and the hang line naming them with torch's analyzer; gloo has no recorder and its line says nothing of one."""
    import importlib.util
    import os

    from config.recipe import load_config
    from tests.trainer_runs import ROOT
    from training.build import flight_recorder_env, flight_recorder_folder
    cfg = load_config(os.path.join(ROOT, "recipes", "debug.toml"), ["--job.dump_folder", str(tmp_path / "run")])
    folder = str(tmp_path / "run" / "flight_recorder")
    env = flight_recorder_env(cfg, "nccl")
    assert env == {"TORCH_FR_BUFFER_SIZE": "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": folder + "/rank_", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": folder + "/rank_"}
    assert flight_recorder_env(cfg, "gloo") == {} and flight_recorder_folder(cfg, "gloo") is None
    off = load_config(os.path.join(ROOT, "recipes", "debug.toml"), ["--job.flight_recorder_entries", "0"])
    assert flight_recorder_env(off, "nccl") == {}
    seen = {0: (_at(8, "forward/backward"), NOW - 1), 1: (_at(8, "data"), NOW - 1)}
    line = hang_line(0, seen, NOW, 60, None, "out/hang", flight_recorder_folder(cfg, "nccl"))
    assert line.endswith(f"; NCCL flight recorder dumps in {folder} (python -m "
                         f"torch.distributed.flight_recorder.fr_trace {folder})") and "\n" not in line, line
    assert "flight recorder" not in hang_line(0, seen, NOW, 60, None, "out/hang", None)
    assert importlib.util.find_spec("torch.distributed.flight_recorder.fr_trace") is not None  # the command exists


def test_a_flight_recorder_prefix_already_set_wins_and_the_line_names_its_folder(tmp_path, monkeypatch):
    import os

    from config.recipe import load_config
    from tests.trainer_runs import ROOT
    from training.build import flight_recorder_folder
    cfg = load_config(os.path.join(ROOT, "recipes", "debug.toml"), ["--job.dump_folder", str(tmp_path / "run")])
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "site_dumps" / "fr_"))
    assert flight_recorder_folder(cfg, "nccl") == str(tmp_path / "site_dumps")


def test_a_negative_flight_recorder_size_is_refused_in_one_line():
    import os

    from config import RecipeError
    from config.recipe import load_config
    from tests.trainer_runs import ROOT
    recipe = os.path.join(ROOT, "recipes", "debug.toml")
    with pytest.raises(RecipeError) as err:
        load_config(recipe, ["--job.flight_recorder_entries", "-1"])
    message = str(err.value)
    assert "job.flight_recorder_entries must be >= 0" in message and recipe in message and "\n" not in message
