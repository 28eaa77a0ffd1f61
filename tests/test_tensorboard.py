"""TensorBoard serving a finished run, as a person would look at it: the scalars API and a headless screenshot.

The screenshot is kept as test-artifacts/tensorboard.png (gitignored). Chromium is installed with apt-get when missing
(CI does it up front); the screenshot part is skipped, with the reason, only where it cannot be installed.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "test-artifacts")
OBSERVED = ("loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "memory", "seq_len", "cp", "cp_comm_bytes",
            "fsdp_comm_bytes", "data_time", "step_time", "step_time_fastest_rank", "attention_balance", "mfu_causal")
STEPS = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def _chromium() -> tuple[str, str]:
    """(path, '') or ('', why it cannot be had)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name), ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "", "chromium is not installed and cannot be (needs root and apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        if subprocess.run(cmd, capture_output=True, env=env, timeout=450).returncode:
            return "", f"'{' '.join(cmd)}' failed"
    return shutil.which("chromium") or "", ""


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A short 2-rank CP run (so the ring's byte counter moves) with TensorBoard enabled."""
    out = str(tmp_path_factory.mktemp("tb") / "run")
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env.pop("NPROC", None)
    cmd = [os.path.join(ROOT, "run_train.sh"), "--training.steps", str(STEPS), "--training.seq_len", "128",
           "--training.local_batch_size", "2", "--parallelism.cp", "2", "--parallelism.dp_shard", "1",
           "--job.dump_folder", out]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return out, records


@pytest.fixture(scope="module")
def tensorboard(finished_run):
    out, _ = finished_run
    port = _free_port()
    # Served from the run folder with a relative --logdir: the page shows the logdir as given ("tb"), and the
    # screenshot that goes into docs/ must not show this machine's temporary path.
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", "tb",
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=out)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get_json(base + "/data/plugin/scalars/tags"):
                    break
            except OSError:
                pass
            assert proc.poll() is None, f"tensorboard exited: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "tensorboard did not serve scalars within 60 s"
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.slow
def test_scalars_api_serves_the_run(finished_run, tensorboard):
    _, records = finished_run
    tags = _get_json(tensorboard + "/data/plugin/scalars/tags")
    assert len(tags) == 1, tags
    run, run_tags = next(iter(tags.items()))
    missing = [t for t in OBSERVED if t not in run_tags]
    assert not missing, f"scalars not in TensorBoard: {missing}"
    for tag in ("loss", "cp_comm_bytes", "step_time"):
        query = urllib.parse.urlencode({"run": run, "tag": tag})
        points = _get_json(f"{tensorboard}/data/plugin/scalars/scalars?{query}")  # [[wall_time, step, value], ...]
        assert [p[1] for p in points] == list(range(1, STEPS + 1))
        expected = [r[tag] for r in records]  # metrics.jsonl, written independently of the event files
        assert [p[2] for p in points] == pytest.approx(expected, rel=1e-6)
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0]
    # The ring's counter: every rank sends its K/V (cp - 1) times forward and again backward with float32 dK/dV.
    assert all(r["cp_comm_bytes"] > 0 and r["fsdp_comm_bytes"] > 0 for r in records)


@pytest.mark.slow
@pytest.mark.timeout(1320)  # installing chromium (2 x 450 s) + the module's run (300 s) + the screenshot (120 s)
def test_headless_screenshot(tensorboard):
    chromium, reason = _chromium()
    if not chromium:
        print(f"SKIP screenshot: {reason}", file=sys.stderr)
        pytest.skip(reason)
    os.makedirs(ARTIFACTS, exist_ok=True)
    shot = os.path.join(ARTIFACTS, "tensorboard.png")
    if os.path.exists(shot):
        os.remove(shot)
    profile = tempfile.mkdtemp(prefix="longctx-chromium-")
    # The scalars dashboard, filtered to the quantities a person watches, unsmoothed.
    tags = urllib.parse.quote("loss|mfu|tokens_per_sec$|cp_comm_bytes|step_time$|data_time", safe="")
    url = f"{tensorboard}/?forceSVG=true#scalars&tagFilter={tags}&_smoothingWeight=0"
    try:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1400,900",
                        "--virtual-time-budget=15000", url],
                       capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert os.path.exists(shot), "chromium wrote no screenshot"
    from PIL import Image  # a dependency of tensorboard

    with Image.open(shot) as image:
        assert image.size == (1400, 900)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    # A blank or error page has a handful of colours; drawn charts and text have hundreds (anti-aliasing).
    assert colours is not None and len(colours) > 200, f"screenshot looks empty: {len(colours or [])} colours"
