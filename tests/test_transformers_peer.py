"""bench/bench_gpu.py's peers without a GPU: the transformers peer (bench/transformers_peer.py) on the CPU with a
tiny shape, so the loop a GPU bench runs on the bench shape cannot rot between GPU runs; and the one line that says
why TorchTitan is not compared and which release this torch needs."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from bench.transformers_peer import hf_llama, train_loop
from harness.launch_env import ROOT, child_env

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2)


def test_the_peer_loop_trains_two_steps_on_the_cpu():
    model = hf_llama(**TINY, seq=64)
    result = train_loop(model, seq=64, batch=2, steps=2, warmup=1, device=torch.device("cpu"))
    assert result["tokens_per_sec"] > 0 and math.isfinite(result["loss"]), result
    assert result["attention"] == "sdpa"
    assert next(model.parameters()).dtype == torch.float32  # fp32 master weights; bf16 comes from autocast


def test_the_peer_has_our_models_shape():
    """Same parameters as our model of the shape (models/hf_config.py writes our LlamaConfig as Hugging Face's)."""
    from models.llama import Llama, model_config

    ours = Llama(model_config("debug", **TINY))
    assert sum(p.numel() for p in hf_llama(**TINY, seq=64).parameters()) == sum(p.numel() for p in ours.parameters())


@pytest.mark.slow
def test_the_peer_script_prints_one_json_line():
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): the peer script in its own process, 18
    s."""
    done = subprocess.run([sys.executable, "bench/transformers_peer.py", "--dim", "64", "--n-layers", "2", "--n-heads",
                           "4", "--n-kv-heads", "2", "--seq", "32", "--steps", "2", "--warmup", "1"], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens_per_sec"] > 0 and result["device"] == "cpu" and result["attention"] == "sdpa", result


def _fake_torchtitan(folder, version: str, init: str) -> None:
    """An installed TorchTitan as importlib.metadata and `import` see one, in `folder`."""
    (folder / f"torchtitan-{version}.dist-info").mkdir(parents=True)
    (folder / f"torchtitan-{version}.dist-info" / "METADATA").write_text(f"Name: torchtitan\nVersion: {version}\n")
    (folder / "torchtitan").mkdir()
    (folder / "torchtitan" / "__init__.py").write_text(init)


def test_without_a_torchtitan_it_drives_one_line_says_why_and_which_release_this_torch_needs(tmp_path, monkeypatch):
    """TorchTitan 0.3.0 on torch 2.11, as on the first GPU image: its import error, and 0.2.2 named as the release
    for this torch (which the bench does not drive). The fake package is found through the caller's PYTHONPATH."""
    import bench.bench_gpu as bench_gpu

    monkeypatch.setattr(bench_gpu.torch, "__version__", "2.11.0+cu128")
    missing = bench_gpu.torchtitan_unavailable()
    assert "torch 2.11.0+cu128 needs TorchTitan 0.2.2 (0.3.0 needs torch >= 2.12)" in missing, missing
    _fake_torchtitan(tmp_path, "0.3.0", "raise ImportError(\"cannot import name 'DataParallelMeshDims' from "
                                        "'torch.distributed.fsdp'\")\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    line = bench_gpu.torchtitan_unavailable()
    assert line.startswith("TorchTitan 0.3.0 does not import here (ImportError: cannot import name "
                           "'DataParallelMeshDims'") and "needs TorchTitan 0.2.2" in line and "\n" not in line, line
