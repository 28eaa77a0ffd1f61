"""slurm/train.sbatch on a real Slurm: a controller and two slurmd "nodes" on loopback, all state in a temp folder.

Debian's slurm-wlm and munge are installed with apt-get when missing (CI does it up front in .ci/run); the test is
skipped, with the reason, only where they cannot be installed. Every daemon is started in the foreground by this
test and stopped by its PID at the end.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from harness.launch_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "sinfo")
NODES = ("node1", "node2")


def _install_slurm() -> str:
    """'' when the Slurm and munge programs are there (installing them if possible), else why not."""
    if all(shutil.which(p) or os.path.exists(f"/usr/sbin/{p}") for p in DAEMONS):
        return ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and cannot be (needs root and apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if done.returncode:
            return f"'{' '.join(cmd)}' failed: {done.stderr.strip().splitlines()[-1:]}"
    return ""


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_for(predicate, timeout: float, what: str, logs=(), describe=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    tails = f"\n--- state: {describe()}" + "".join(f"\n--- {p}:\n{open(p).read()[-1500:]}" for p in logs if os.path.exists(p))
    folder = os.path.dirname(logs[0]) if logs else ""
    tails += "".join(f"\n--- {n}:\n{open(os.path.join(folder, n)).read()[-800:]}"
                     for n in (os.listdir(folder) if folder else []) if n.endswith(".stdout"))
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{tails}")


def _slurm_conf(folder: str, ctld_port: int, node_ports: list[int], munge_socket: str) -> str:
    cpus = os.cpu_count() or 2
    lines = [
        "ClusterName=longctx-test", "SlurmctldHost=localhost", f"SlurmctldPort={ctld_port}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        # A requeued job waits cred_expire + 1 s before it may start again (so that the credentials revoked when its
        # first run was killed have expired on the nodes); Slurm's 120 s default would dominate the requeue test.
        f"AuthInfo=socket={munge_socket},cred_expire=5",
        f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool/%n",
        f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log", f"SlurmdLogFile={folder}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/builtin",
        "ReturnToService=2", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none", "MailProg=/bin/true", "SlurmctldTimeout=30", "SlurmdTimeout=30",
        "InactiveLimit=0", "KillWait=5", "OverTimeLimit=0", "MinJobAge=300",
        # Logs the time-limit warning signal ("warning signal N to JobId=J"), which the time-limit test reads.
        "SlurmctldDebug=debug",
        # The main scheduling pass every 2 s instead of 60: a requeued job starts when its begin time passes.
        "SchedulerParameters=sched_interval=2",
    ]
    for name, port in zip(NODES, node_ports):
        lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
                     f"State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES")
    path = os.path.join(folder, "slurm.conf")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


class LocalSlurm:
    """munged + slurmctld + one slurmd per fake node, each a child process of this test."""

    def __init__(self, folder: str):
        self.folder = folder
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ)

    def start(self) -> None:
        f = self.folder
        for sub in ["state", "munge", *(f"spool/{n}" for n in NODES)]:
            os.makedirs(os.path.join(f, sub), exist_ok=True)
        munge_dir = os.path.join(f, "munge")
        shutil.copy("/etc/munge/munge.key", os.path.join(munge_dir, "munge.key"))
        shutil.chown(munge_dir, "munge", "munge")
        shutil.chown(os.path.join(munge_dir, "munge.key"), "munge", "munge")
        os.chmod(munge_dir, 0o755)  # clients need to reach the socket
        os.chmod(os.path.join(munge_dir, "munge.key"), 0o600)
        munge_socket = os.path.join(munge_dir, "munge.socket")
        self._spawn(["runuser", "-u", "munge", "--", _sbin("munged"), "--foreground", f"--socket={munge_socket}",
                     f"--key-file={munge_dir}/munge.key", f"--pid-file={munge_dir}/munged.pid",
                     f"--log-file={munge_dir}/munged.log", f"--seed-file={munge_dir}/munged.seed"], "munged")
        _wait_for(lambda: os.path.exists(munge_socket), 20, "munged's socket", [f"{munge_dir}/munged.log"])
        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        conf = _slurm_conf(f, ctld_port, node_ports, munge_socket)
        self.env["SLURM_CONF"] = conf
        self._spawn([_sbin("slurmctld"), "-D", "-i", "-f", conf], "slurmctld")
        for name in NODES:
            self._spawn([_sbin("slurmd"), "-D", "-N", name, "-f", conf], f"slurmd-{name}")
        logs = [f"{f}/slurmctld.log", *(f"{f}/slurmd-{n}.log" for n in NODES)]
        _wait_for(self._nodes_idle, 60, "both nodes idle", logs)

    def _spawn(self, cmd: list[str], name: str) -> None:
        out = open(os.path.join(self.folder, f"{name}.stdout"), "w")
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))

    def _nodes_idle(self) -> bool:
        for proc in self.procs:
            if proc.poll() is not None:
                raise AssertionError(f"a Slurm daemon exited early: {proc.args} -> {proc.returncode}")
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=self.env)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return all(states.get(n, "").startswith("idle") for n in NODES)

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the daemons started here, by PID; slurmd's job steps die with them
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@pytest.fixture(scope="module")
def slurm():
    reason = _install_slurm()
    if reason:
        print(f"SKIP test_slurm: {reason}", file=sys.stderr)
        pytest.skip(reason)
    # Not under pytest's tmp folder: that is private to root, and munged runs as user munge.
    folder = tempfile.mkdtemp(prefix="longctx-slurm-")
    os.chmod(folder, 0o755)
    cluster = LocalSlurm(folder)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(1320)  # installing Slurm (2 x 300 s, first test only) + the job (600 s)
def test_sbatch_trains_debug_recipe_on_two_nodes(slurm, tmp_path):
    """2 nodes x 2 ranks (CPU: 'GPUs per node' are ranks per node), one c10d rendezvous, falling loss, exit 0."""
    out = str(tmp_path / "run")
    log = str(tmp_path / "job-%j.out")
    env = dict(slurm.env, PYTHON=sys.executable, GPUS_PER_NODE="2", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               RDZV_PORT=str(_free_ports(1)[0]), REPO=ROOT)
    env.pop("NPROC", None)
    cmd = ["sbatch", "--wait", "--nodes=2", "--gpus-per-node=0", "--exclusive=user", f"--output={log}",
           "--time=10", os.path.join(ROOT, "slurm", "train.sbatch"),
           "--job.dump_folder", out, "--parallelism.dp_shard", "-1", "--training.steps", "8",
           "--training.seq_len", "256", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    logs = [os.path.join(tmp_path, name) for name in os.listdir(tmp_path) if name.startswith("job-")]
    text = "".join(open(p).read() for p in logs)
    assert done.returncode == 0, f"sbatch exit {done.returncode}\n{done.stderr[-2000:]}\n{text[-4000:]}"
    assert "2 node(s) x 2 rank(s)" in text, text[-3000:]
    assert "on 4 rank(s)" in text, text[-3000:]  # one world across both fake nodes
    with open(os.path.join(out, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f]
    assert len(losses) == 8
    assert losses[-1] < losses[0] - 0.5, losses
    print(f"slurm job log (tail):\n{text[-1200:]}\nlosses: {losses}")


def _show_job(env: dict, job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, env=env).stdout


def _job_state(env: dict, job: str) -> str:
    fields = dict(part.split("=", 1) for part in _show_job(env, job).split() if "=" in part)
    return fields.get("JobState", "")


def _ended_for_good(env: dict, job: str, log: str) -> bool:
    """The job has ended and will not run again: not the first allocation's end when it requeued."""
    text = open(log).read() if os.path.exists(log) else ""
    return (_job_state(env, job) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
            and ("Restarts=0 " not in _show_job(env, job) or "requeueing" not in text))


def _logged_steps(folder: str) -> list[int]:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


# The job's first allocation is slowed by tests/training/paced_runs.py's hook, loaded by every Python process of the
# job through PYTHONPATH: while SLURM_RESTART_COUNT is unset (Slurm sets it only from the first requeue on) each step
# takes STEP_SLEEP_S more, as a large model's does, so the time limit falls mid-run; the requeued allocation runs at
# full speed, so it finishes before its own warning signal. The sleep comes before the ranks' agreement on a signal
# (training/preemption.py), which a signal during it only notes.

# slurmctld looks at time limits every PERIODIC_TIMEOUT = 30 s (fixed when Slurm is built, no slurm.conf key) and sends
# --signal's warning at the first look when `now + N + 30 >= end`, so with a limit of T minutes USR1@1 comes between
# 60 T - 31 and 60 T - 1 s after the start (the sbatch man page: "up to 60 seconds earlier than specified"), and the
# limit itself (OverTimeLimit 0, then KillWait 5 s) no sooner than 30 s after the warning: time for one step and one
# save. Both allocations get the same limit and warning window. With Slurm's least limit (1 minute) the second
# allocation's own warning could come as early as 29 s after its start, which a loaded CI box (three test workers on
# two cores) can outlast and requeue the job twice; a 2-minute limit gives the requeued allocation (start-up, then the
# steps left at full speed: 23 s measured) at least 89 s. The first allocation must still run at its latest warning
# (119 s): 30 steps of >= 4.5 s outlast it.
TIME_LIMIT_MIN, WARN_S, STEP_SLEEP_S, LIMIT_STEPS = 2, 1, 4.5, 30


@pytest.mark.slow
@pytest.mark.timeout(1500)  # installing Slurm if this test runs first (600 s) + the runs and waits below (900 s)
def test_the_time_limit_saves_requeues_and_the_second_allocation_finishes_with_identical_losses(slurm, tmp_path):
    """The time-limit path of slurm/train.sbatch for real: `sbatch --time=2 --signal=B:USR1@1` -> Slurm's time-limit
    check sends USR1 to the batch shell ahead of the limit -> its trap passes it to the ranks, which save the step
    they are in and exit 75 -> the script runs `scontrol requeue` -> Slurm starts the job again (restart count 1),
    which resumes from that very step and finishes: two allocations, each step logged once (with a checkpoint interval
    longer than the run, no step is lost), every loss the uninterrupted run's, bit for bit. A tiny model
    (tests/training/paced_runs.TINY: the property shows at any size; the first allocation's pace is the sleep), and
    the reference's ranks forked from one interpreter (its subject is the numbers, not the launch)."""
    from tests.training.paced_runs import TINY, paced_hook, uninterrupted_losses

    args = ["--parallelism.dp_shard", "-1", "--training.steps", str(LIMIT_STEPS), "--training.seq_len", "128",
            "--training.local_batch_size", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "1000",
            "--metrics.enable_tensorboard", "false", *TINY]
    reference = uninterrupted_losses(tuple(args))
    hook = paced_hook(tmp_path / "hook")

    out, log = str(tmp_path / "run"), str(tmp_path / "job.out")
    env = child_env(hook, base=dict(slurm.env, PYTHON=sys.executable, GPUS_PER_NODE="2", OMP_NUM_THREADS="1",
                                    GLOO_SOCKET_IFNAME="lo", RDZV_PORT=str(_free_ports(1)[0]), REPO=ROOT,
                                    PACED_STEP_S=str(STEP_SLEEP_S), PACED_WHILE="SLURM_RESTART_COUNT=0"))
    env.pop("NPROC", None)
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--exclusive=user", f"--output={log}",
           f"--time={TIME_LIMIT_MIN}", f"--signal=B:USR1@{WARN_S}", os.path.join(ROOT, "slurm", "train.sbatch"),
           "--job.dump_folder", out, *args]
    submitted = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    ctld_log = os.path.join(slurm.folder, "slurmctld.log")
    began = time.monotonic()
    _wait_for(lambda: os.path.exists(log) and "restart count 0" in open(log).read(), 120,
              "the first allocation's batch script to start", [log, ctld_log], lambda: _show_job(env, job))
    started = time.monotonic()
    _wait_for(lambda: "caught USR1" in open(log).read(), TIME_LIMIT_MIN * 60 + 30, "the time limit's USR1",
              [log, ctld_log], lambda: _show_job(env, job))
    warned = time.monotonic() - started

    _wait_for(lambda: _ended_for_good(env, job, log), 300, "the requeued job to finish", [log, ctld_log],
              lambda: _show_job(env, job))
    total = time.monotonic() - began
    text, shown = open(log).read(), _show_job(env, job)
    second = re.search(r"RunTime=(\S+)", shown).group(1)  # the last allocation's
    assert _job_state(env, job) == "COMPLETED" and "Restarts=1 " in shown, f"{shown}\n{text[-4000:]}"
    assert "restart count 1" in text and "restart count 2" not in text, text[-4000:]
    # The USR1 came from Slurm's time-limit warning (nothing else here signals the job): slurmctld logs it at debug.
    assert re.search(rf"warning signal {int(signal.SIGUSR1)} to JobId={job}\b", open(ctld_log).read()), \
        open(ctld_log).read()[-3000:]
    assert text.count("caught USR1") == 1 and f"step saved: requeueing job {job}" in text, text[-4000:]
    saved = re.search(r"checkpoint: saved step (\d+) on SIGUSR1; resume with the same command", text)
    resumed = re.search(r"resumed from .*\(step (\d+)\)", text)
    assert saved and resumed and resumed.group(1) == saved.group(1), text[-4000:]
    assert 1 <= int(saved.group(1)) < LIMIT_STEPS
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, LIMIT_STEPS + 1)), records  # no step lost, none repeated
    assert all(r["loss"] == reference[r["step"]] for r in records), (records, reference)
    print(f"time limit {TIME_LIMIT_MIN} min, --signal=B:USR1@{WARN_S}: USR1 {warned:.0f} s into the first "
          f"allocation, saved and resumed at step {saved.group(1)}, the second allocation ran {second}, the job "
          f"COMPLETED after one requeue {total:.0f} s after submission; {LIMIT_STEPS} losses equal the uninterrupted "
          f"run's")


HANG_STEPS, HANG_AT_STEP, HANG_STEP_TIMEOUT_S = 12, 9, 20


@pytest.mark.slow
@pytest.mark.timeout(1500)  # installing Slurm if this test runs first (600 s) + the runs and waits below (900 s)
def test_a_hang_requeues_the_job_and_the_second_allocation_finishes_with_identical_losses(slurm, tmp_path):
    """Issue 58's hang path on a real Slurm: rank 1 stops itself (SIGSTOP; tests/training/paced_runs.FREEZE_ITSELF)
    before step 9's forward in the job's first allocation only -> rank 0's collective times out after the 20 s step
    timeout and the run ends with the hang line and exit 76 -> slurm/train.sbatch requeues the job (hang requeue 1
    of 2) -> the second allocation resumes from the step-8 checkpoint and finishes: each step logged once, every
    loss the uninterrupted run's, bit for bit, and the job's hang count gone once it COMPLETED. The tiny model
    (paced_runs.TINY): where a rank stopped, and what the job does then, show at any size."""
    from tests.training.paced_runs import FREEZE_ITSELF, TINY, hook_folder, uninterrupted_losses

    args = ["--parallelism.dp_shard", "-1", "--training.steps", str(HANG_STEPS), "--training.seq_len", "128",
            "--training.local_batch_size", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "4",
            "--job.init_timeout_s", "120", "--job.step_timeout_s", str(HANG_STEP_TIMEOUT_S),
            "--metrics.enable_tensorboard", "false", *TINY]
    reference = uninterrupted_losses(tuple(args))
    hook = hook_folder(tmp_path / "hook", FREEZE_ITSELF)
    out, log = str(tmp_path / "run"), str(tmp_path / "job.out")
    env = child_env(hook, base=dict(slurm.env, PYTHON=sys.executable, GPUS_PER_NODE="2", OMP_NUM_THREADS="1",
                                    GLOO_SOCKET_IFNAME="lo", RDZV_PORT=str(_free_ports(1)[0]), REPO=ROOT,
                                    FREEZE_RANK="1", FREEZE_AT=f"micro_step:{HANG_AT_STEP}",
                                    FREEZE_WHILE="SLURM_RESTART_COUNT=0"))
    env.pop("NPROC", None)
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--exclusive=user", f"--output={log}",
           "--time=10", os.path.join(ROOT, "slurm", "train.sbatch"), "--job.dump_folder", out, *args]
    submitted = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    counter = os.path.join(ROOT, "slurm", "logs", f".hang-requeues-{job}")
    if os.path.exists(counter) and "restart count" not in (open(log).read() if os.path.exists(log) else ""):
        os.remove(counter)  # left by an ended job of an earlier test cluster whose ids began at 1 too
    ctld_log = os.path.join(slurm.folder, "slurmctld.log")
    began = time.monotonic()
    _wait_for(lambda: _ended_for_good(env, job, log), 600, "the job to end after its hang requeue", [log, ctld_log],
              lambda: _show_job(env, job))
    total = time.monotonic() - began
    text, shown = open(log).read(), _show_job(env, job)
    assert _job_state(env, job) == "COMPLETED" and "Restarts=1 " in shown, f"{shown}\n{text[-4000:]}"
    assert "restart count 1" in text and "restart count 2" not in text, text[-4000:]
    hang = re.search(rf"error: hang at step {HANG_AT_STEP} \(forward/backward.*\): rank 1 on \S+ .* never arrived; "
                     rf"rank\(s\) 0 waited {HANG_STEP_TIMEOUT_S}s .* resume from \S+step-8; tracebacks in .+", text)
    assert hang and "OOM" not in text, text[-4000:]
    assert f"requeueing job {job} (hang requeue 1 of 2)" in text, text[-4000:]
    resumed = re.search(r"resumed from .*\(step (\d+)\)", text)
    assert resumed and resumed.group(1) == "8", text[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, HANG_STEPS + 1)), records  # none lost, none repeated
    assert all(r["loss"] == reference[r["step"]] for r in records), (records, reference)
    assert not os.path.exists(counter)
    print(f"hang at step {HANG_AT_STEP}: named after the {HANG_STEP_TIMEOUT_S} s step timeout, the job requeued and "
          f"COMPLETED from step 8 {total:.0f} s after submission; {HANG_STEPS} losses equal the uninterrupted run's")
