"""slurm/train.sbatch on a real Slurm: a controller and two slurmd "nodes" on loopback, all state in a temp folder.

Debian's slurm-wlm and munge are installed with apt-get when missing (CI does it up front in .ci/run); the test is
skipped, with the reason, only where they cannot be installed. Every daemon is started in the foreground by this
test and stopped by its PID at the end.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

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
        "InactiveLimit=0", "KillWait=5", "MinJobAge=300",
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


def _logged_steps(folder: str) -> list[int]:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def _uninterrupted_losses(args: list[str], folder: str) -> dict[int, float]:
    """{step: loss} of the same run on 2 ranks without Slurm or a signal (the reference)."""
    from tests.trainer_runs import run_train

    result = run_train(*args, "--job.dump_folder", folder, nproc=2, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.mark.slow
@pytest.mark.timeout(1680)  # installing Slurm if this test runs first (600 s) + the runs and waits below (1020 s)
def test_usr1_requeues_the_job_and_it_resumes_with_identical_losses(slurm, tmp_path):
    """The time-limit path of slurm/train.sbatch for real: USR1 to the batch shell (what --signal=B:USR1 sends) ->
    its trap passes it to the ranks, which save the step they are in and exit 75 -> the script runs `scontrol
    requeue` -> Slurm starts the job again (restart count 1), which resumes from that very step: with a checkpoint
    interval longer than the run, no step is lost. Every loss either run logged equals an uninterrupted run's, bit
    for bit."""
    args = ["--parallelism.dp_shard", "-1", "--training.steps", "14", "--training.seq_len", "128",
            "--training.local_batch_size", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "1000",
            "--metrics.enable_tensorboard", "false"]
    reference = _uninterrupted_losses(args, str(tmp_path / "reference"))

    out, log = str(tmp_path / "run"), str(tmp_path / "job.out")
    env = dict(slurm.env, PYTHON=sys.executable, GPUS_PER_NODE="2", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               RDZV_PORT=str(_free_ports(1)[0]), REPO=ROOT)
    env.pop("NPROC", None)
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--exclusive=user", f"--output={log}",
           "--time=10", os.path.join(ROOT, "slurm", "train.sbatch"), "--job.dump_folder", out, *args]
    submitted = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    _wait_for(lambda: len(_logged_steps(out)) >= 4, 240, "step 4 of the first run", [log])
    signalled = time.monotonic()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, env=env, timeout=30)
    # Slurm holds a requeued job for cred_expire + 1 s (6 s with this cluster's conf) and then starts it on its own;
    # releasing it earlier by hand (scontrol update StartTime=now) can land in the second its credentials were revoked,
    # and the node then kills it ("Job credential revoked"). Running again and logging again are waited for separately
    # so a failure says which of them did not happen.
    _wait_for(lambda: "Restarts=1" in _show_job(env, job), 60, "the job back in the queue after its requeue", [log])

    ctld_log = os.path.join(slurm.folder, "slurmctld.log")

    def running_again() -> bool:
        shown = _show_job(env, job)
        if any(f"JobState={s} " in shown for s in ("FAILED", "CANCELLED", "TIMEOUT", "COMPLETED")):
            raise AssertionError(f"the requeued job ended instead of running again: {shown}\n--- {ctld_log}:\n"
                                 f"{open(ctld_log).read()[-1500:]}")
        return "JobState=RUNNING" in shown

    _wait_for(running_again, 180, "the requeued job to run again", [log, ctld_log], lambda: _show_job(env, job))
    _wait_for(lambda: "restart count 1" in open(log).read(), 120, "the requeued job's batch script to start",
              [log, ctld_log], lambda: _show_job(env, job))
    requeue_seconds = time.monotonic() - signalled
    _wait_for(lambda: _job_state(env, job) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 300,
              "the requeued job to finish", [log])
    text = open(log).read()
    assert _job_state(env, job) == "COMPLETED", text[-4000:]
    assert "caught USR1: the ranks save the step they are in" in text, text[-4000:]
    assert f"step saved: requeueing job {job}" in text, text[-4000:]
    first_run = text.split("caught USR1")[0]
    signalled_at = max(int(m) for m in re.findall(r"step +(\d+)/14", first_run))
    saved = re.search(r"checkpoint: saved step (\d+) on SIGUSR1; resume with the same command", text)
    resumed = re.search(r"resumed from .*\(step (\d+)\)", text)
    assert saved and resumed, text[-4000:]
    resumed_step = int(resumed.group(1))
    assert resumed_step == int(saved.group(1)) and 4 <= signalled_at <= resumed_step < 14, (resumed_step,
                                                                                             signalled_at)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, 15)), records
    assert all(r["loss"] == reference[r["step"]] for r in records), (records, reference)
    print(f"requeue: USR1 after step {signalled_at}, running again {requeue_seconds:.1f}s after the signal (Slurm's "
          f"requeue delay included), resumed from step {resumed_step}; 14 losses equal the uninterrupted run's")
