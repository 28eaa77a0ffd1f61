"""torchrun's ranks forked from the launcher's imports (training/warm_ranks.py, training/warm_rank_client.py): each
rank runs the script's main() with the arguments, environment, working directory, streams and session torchrun
gives a rank it starts, without importing anything again; its exit (a code, or death by a signal) reaches torchrun
as the rank's own; a rank whose stand-in dies goes with it; and RANK_START=exec, or a starter that finds the CUDA
driver loaded before its fork, starts every rank as a fresh interpreter. The launcher runs a tiny script here, not
the trainer: the subject is how ranks start and end (the trainer's own launches are the preemption, timeout and
restart tests', all through this path)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.launch_env import child_env
from harness.process_tree import finish, group_processes, trainer_ranks

SCRIPT = '''
import json, os, resource, sys, time


def main(argv):
    if "--check" in argv:  # the launcher's check: 2 ranks
        print(2)
        return 0
    folder, mode = argv[0], argv[1]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {"pid": os.getpid(), "leads_session": os.getsid(0) == os.getpid(), "torch": "torch" in sys.modules,
              "cpu_s": usage.ru_utime + usage.ru_stime, "argv": sys.argv, "cwd": os.getcwd(),
              "probe": os.environ.get("PROBE"), "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"]}
    print(f"rank {record['rank']} says hello", flush=True)
    path = os.path.join(folder, f"rank{record['rank']}.json")
    with open(path + ".part", "w") as f:
        json.dump(record, f)
    os.replace(path + ".part", path)  # whole or absent: a peer's failure may stop this rank any time after
    if mode == "fail" and record["rank"] == "1":
        # fail only once rank 0 has written its record: on a busy box rank 0 was once stopped by torchrun (this
        # failure's consequence) before it wrote it, and the test read a correct run as a lost record
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(folder, "rank0.json")) and time.monotonic() < deadline:
            time.sleep(0.02)
        return 3
    if mode in ("fail", "sleep"):
        time.sleep(120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''


def _launch(tmp_path, mode: str, *first: str, restarts: int = 0, **env) -> subprocess.Popen:
    script = tmp_path / "probe_script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "training.launcher", "--standalone", "--nproc-per-node", "auto",
               "--max-restarts", str(restarts), str(script), str(out), mode, "--some.override", "1"]
    return subprocess.Popen(command, cwd=str(tmp_path), env=child_env(*first, PROBE="seen", **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _records(tmp_path, launcher: subprocess.Popen, timeout: float = 60) -> list[dict]:
    files = [tmp_path / "out" / f"rank{rank}.json" for rank in range(2)]
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    return [json.loads(f.read_text()) for f in files]  # each written whole (os.replace)


def _finish(launcher: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    return finish(launcher, timeout)


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["fork", "exec"])
def test_ranks_start_as_torchrun_starts_them_and_forked_ones_import_nothing(tmp_path, start):
    """Both ways run main() on every rank with torchrun's arguments, environment, working directory, streams and a
    session of its own. Forked (the default): torch is imported before main() runs and the rank has used almost no
    CPU; a fresh interpreter (RANK_START=exec) runs the script with nothing imported."""
    launcher = _launch(tmp_path, "ok", RANK_START=start)
    code, out, err = _finish(launcher)
    assert code == 0, err[-3000:]
    records = [json.loads((tmp_path / "out" / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, record in enumerate(records):
        assert record["rank"] == str(rank) and record["world"] == "2", record
        assert record["argv"] == [str(tmp_path / "probe_script.py"), str(tmp_path / "out"), "ok", "--some.override",
                                  "1"], record
        assert record["cwd"] == str(tmp_path) and record["probe"] == "seen" and record["leads_session"], record
        assert f"rank {rank} says hello" in out, out
    assert records[0]["pid"] != records[1]["pid"]
    if start == "fork":
        assert all(r["torch"] and r["cpu_s"] < 0.5 for r in records), records
    else:
        assert not any(r["torch"] for r in records), records


@pytest.mark.timeout(120)
def test_a_ranks_exit_code_reaches_torchrun_and_its_peers_are_stopped(tmp_path):
    """Rank 1 returns 3: the launcher's last line names rank 1 and exit code 3 (the stand-in exits as its rank did)
    and rank 0, asleep, as stopped by torchrun's SIGTERM (forwarded to it: it died of it); no rank outlives the
    launcher."""
    launcher = _launch(tmp_path, "fail")
    records = _records(tmp_path, launcher)
    code, _, err = _finish(launcher)
    assert code != 0
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("error: rank 1 failed first (exit code 3;") and "rank 0 (SIGTERM)" in last, last
    assert all(_gone(r["pid"]) for r in records), records


@pytest.mark.timeout(120)
def test_a_sigkilled_rank_reads_as_one_from_outside_the_run(tmp_path):
    """SIGKILL from outside to rank 1 (the OOM killer's way) ends the run with the launcher's line naming rank 1 and
    signal 9 from outside the run: its stand-in died of the same signal."""
    launcher = _launch(tmp_path, "sleep")
    records = _records(tmp_path, launcher)
    assert trainer_ranks(launcher.pid) == sorted(r["pid"] for r in records), records
    os.kill(records[1]["pid"], signal.SIGKILL)
    code, _, err = _finish(launcher)
    assert code != 0
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("error: rank 1 was killed by signal 9 (SIGKILL) from outside the run"), last
    assert all(_gone(r["pid"]) for r in records), records


@pytest.mark.timeout(120)
def test_a_killed_stand_in_takes_its_rank_at_once(tmp_path):
    """SIGKILL to rank 1's stand-in (torchrun's last resort for a rank that ignores SIGTERM) kills the rank it stands
    for then, not when the launcher ends: with a restart allowed, the old rank is gone while the next attempt's
    ranks run."""
    launcher = _launch(tmp_path, "sleep", restarts=1)
    try:
        first = _records(tmp_path, launcher)
        ranks = trainer_ranks(launcher.pid)
        stand_ins = [pid for pid in group_processes(launcher.pid) if pid not in ranks and
                     b"warm_rank_client.py" in open(f"/proc/{pid}/cmdline", "rb").read() and
                     b"RANK=1\0" in open(f"/proc/{pid}/environ", "rb").read()]
        assert len(stand_ins) == 1, stand_ins
        for record in tmp_path.joinpath("out").iterdir():
            record.unlink()
        os.kill(stand_ins[0], signal.SIGKILL)
        second = _records(tmp_path, launcher)  # the restart's ranks
        assert {r["pid"] for r in second}.isdisjoint(r["pid"] for r in first)
        assert launcher.poll() is None and all(_gone(r["pid"]) for r in first), first
    finally:
        os.kill(launcher.pid, signal.SIGTERM)  # torchrun stops the restart's ranks
        _finish(launcher)


@pytest.mark.timeout(120)
def test_a_starter_that_finds_the_cuda_driver_loaded_lets_every_rank_start_fresh(tmp_path):
    """A rank forked after the CUDA driver was loaded could not use the GPU: such a starter answers `exec` and each
    stand-in becomes its rank as torchrun would start it (nothing imported at main()). The driver's presence is
    faked here (a sitecustomize.py making training.warm_ranks.cuda_driver_loaded say yes); what it reads is
    checked on /proc/self/maps text below."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import importlib.util, sys\n"
        "class _Loaded:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name != 'training.warm_ranks':\n"
        "            return None\n"
        "        sys.meta_path.remove(self)\n"
        "        spec = importlib.util.find_spec(name)\n"
        "        run = spec.loader.exec_module\n"
        "        def exec_module(module):\n"
        "            run(module)\n"
        "            module.cuda_driver_loaded = lambda maps=None: True\n"
        "        spec.loader.exec_module = exec_module\n"
        "        return spec\n"
        "sys.meta_path.insert(0, _Loaded())\n")
    launcher = _launch(tmp_path, "ok", str(hook))
    code, _, err = _finish(launcher)
    assert code == 0, err[-3000:]
    records = [json.loads((tmp_path / "out" / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert not any(r["torch"] for r in records) and all(r["leads_session"] for r in records), records


def test_what_counts_as_the_cuda_driver_loaded():
    from training.warm_ranks import cuda_driver_loaded

    line = "7f00-7f10 r-xp 00000000 00:00 0    {}"
    assert cuda_driver_loaded(line.format("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"))
    assert not cuda_driver_loaded("\n".join(line.format(path) for path in (
        "/venv/lib/python3.12/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12", "/usr/lib/libc.so.6", "[heap]")))


def test_an_unknown_rank_start_is_refused_in_one_line(tmp_path):
    launcher = _launch(tmp_path, "ok", RANK_START="spawn")
    code, _, err = _finish(launcher)
    assert code != 0 and err.strip().splitlines()[-1].startswith("error: RANK_START='spawn' is not one of fork, exec")
    assert not (tmp_path / "out" / "rank0.json").exists()
