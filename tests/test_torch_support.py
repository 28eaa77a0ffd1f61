"""The supported torch range and the newer torch APIs (config/torch_support.py): an older torch stops at start-up in
one line, a newer one runs after one warning line, every detected API's fallback does the API's job on CPU with the
API hidden (as on torch 2.11, the GPU images' torch), and no product file calls a detected API directly."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from config import torch_support
from config.torch_support import (NEWER_TORCH_APIS, NEWEST_TESTED_TORCH, OLDEST_TORCH, exit_if_unsupported_torch,
                                  torch_release, unsupported_torch, untested_torch)
from harness.launch_env import child_env
from tests.distributed import run_ranks
from tests.parallelisms.test_host_arena import _offloaded_model, _step

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRODUCT = ("config", "data", "models", "parallelisms", "training")


def test_the_newest_tested_torch_is_the_pin_and_the_floor_is_older():
    pins = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    (pin,) = [line.partition("==")[2] for line in pins if line.startswith("torch==")]
    assert torch_release(pin) == NEWEST_TESTED_TORCH
    assert OLDEST_TORCH == (2, 11) and OLDEST_TORCH <= NEWEST_TESTED_TORCH


@pytest.mark.parametrize("version", ["2.10.0", "2.9.1+cu128", "1.13.1"])
def test_an_older_torch_is_refused_in_one_line(version, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(SystemExit) as stop:
        exit_if_unsupported_torch()  # the installed torch's version, faked
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: torch {version} is older than the oldest supported torch 2.11 ")
    assert "install torch>=2.11" in err
    assert unsupported_torch(version) == err[len("error: "):].rstrip("\n")


def test_the_refusal_is_printed_by_rank_zero_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit):
        exit_if_unsupported_torch("2.10.0")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cpu", "2.12.1", "2.11.0a0+git70d99e9", "local-build"])
def test_supported_torches_start_silently(version, capsys):
    exit_if_unsupported_torch(version)
    assert unsupported_torch(version) is None and untested_torch(version) is None
    assert capsys.readouterr() == ("", "")


def test_a_newer_torch_runs_after_one_warning_line_outside_torchrun(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    exit_if_unsupported_torch("2.15.0+cu130")
    err = capsys.readouterr().err
    assert err == "warning: torch 2.15.0+cu130 is newer than the newest tested torch 2.13; running on it " \
                  "(requirements.txt pins the tested one)\n"
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun's ranks: run_train.sh's --check warned already
    exit_if_unsupported_torch("2.15.0+cu130")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("flag", ["--check", "--dry-run"])
def test_run_train_stops_an_old_torch_before_anything_else(flag, tmp_path):
    """run_train.sh's --check (before torchrun) and --dry-run both go through train.py, whose first step refuses an
    older torch: one line, exit status 2, before any product import (let alone a process group)."""
    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.10.0'\n")
    env = child_env(str(tmp_path), PYTHON=sys.executable)  # the sitecustomize first on the path
    env.pop("NPROC", None)
    done = subprocess.run(["bash", str(ROOT / "run_train.sh"), flag], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout == ""
    assert done.stderr.startswith("error: torch 2.10.0 is older than the oldest supported torch 2.11 ")
    assert done.stderr.count("\n") == 1


# ---- torch.accelerator.empty_host_cache (torch >= 2.12) -> torch._C._host_emptyCache on CUDA

def _arena_released_by_a_stage_switch():
    """An offloading model after two steps (the counting step, then the arena's) and a stage switch."""
    model, offloader = _offloaded_model()
    _step(model, 2, 32)
    _step(model, 2, 32)
    assert offloader.arena is not None and offloader.arena_bytes
    return offloader


def _recorder(calls: list, name: str):
    return lambda: calls.append(name)


def test_the_stage_switch_works_without_the_accelerator_api(monkeypatch):
    """As on torch 2.11: no torch.accelerator.empty_host_cache. On this CPU machine there is no host cache, and the
    release path (parallelisms/activation_offload.py's release_arena) frees the arena without raising."""
    offloader = _arena_released_by_a_stage_switch()
    monkeypatch.delattr(torch.accelerator, "empty_host_cache", raising=False)
    offloader.release_arena()
    assert offloader.arena is None and offloader.arena_bytes == offloader.pinned_bytes == 0
    model, offloader = _offloaded_model()  # the next stage counts its own needs again
    assert _step(model, 1, 96) > 0


def test_without_the_accelerator_api_cuda_empties_its_host_cache_with_the_older_call(monkeypatch):
    """torch 2.11 on a GPU: the stage switch empties the CUDA host allocator's cache through torch._C's
    _host_emptyCache (simulated here: an available CUDA, the call recorded)."""
    offloader = _arena_released_by_a_stage_switch()
    calls: list[str] = []
    monkeypatch.delattr(torch.accelerator, "empty_host_cache", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_host_emptyCache", _recorder(calls, "_host_emptyCache"), raising=False)
    offloader.release_arena()
    assert calls == ["_host_emptyCache"] and offloader.arena is None


def test_with_the_accelerator_api_only_it_is_called(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", _recorder(calls, "accelerator"), raising=False)
    monkeypatch.setattr(torch._C, "_host_emptyCache", _recorder(calls, "_host_emptyCache"), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    torch_support.empty_host_cache()
    assert calls == ["accelerator"]
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # no accelerator: nothing is cached
    torch_support.empty_host_cache()
    assert calls == ["accelerator"]


# ---- dist.all_gather_single / reduce_scatter_single (torch >= 2.13) -> all_gather_into_tensor / reduce_scatter_tensor

def _collectives_with_and_without_the_new_names(rank, world_size):
    from parallelisms.comm import all_gather_single, reduce_scatter_single

    def both():
        gathered = torch.empty(2 * world_size)
        all_gather_single(gathered, torch.full((2,), float(rank + 1)))
        mine = torch.empty(3)
        reduce_scatter_single(mine, torch.arange(3.0 * world_size) * (rank + 1))
        return gathered, mine

    called = []
    hidden = {name: dist.__dict__.pop(name) for name in ("all_gather_single", "reduce_scatter_single")
              if name in dist.__dict__}
    originals = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "reduce_scatter_tensor")}
    for name, original in originals.items():
        setattr(dist, name, lambda *a, _name=name, _f=original, **k: called.append(_name) or _f(*a, **k))
    try:
        older = both()  # as on torch 2.11: only the older names exist
    finally:
        vars(dist).update(originals)
        vars(dist).update(hidden)
    return older, called, both() if hidden else None


def test_the_collectives_fall_back_to_their_older_names_on_real_gloo_ranks():
    world = 2
    for rank, (older, called, newer) in enumerate(run_ranks(_collectives_with_and_without_the_new_names, world,
                                                            timeout=120)):
        gathered, mine = older
        assert called == ["all_gather_into_tensor", "reduce_scatter_tensor"]
        assert gathered.tolist() == [1.0, 1.0, 2.0, 2.0]
        assert mine.tolist() == [3.0 * (3 * rank + i) for i in range(3)]  # (1 + 2) x this rank's slice
        if newer is not None:  # this torch has the new names too: the same values through them
            assert torch.equal(newer[0], gathered) and torch.equal(newer[1], mine)


# ---- no product file calls a detected API directly

def _direct_uses(source: str, where: str) -> list[str]:
    """Every use of a NEWER_TORCH_APIS name in `source`: an attribute chain from an imported torch module (`torch.`,
    `dist.`, ...), a `from torch... import name`, or `getattr`/`hasattr` of it by its string name."""
    apis = {api for api, _ in NEWER_TORCH_APIS}
    tree = ast.parse(source, where)
    alias = {}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    alias[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(node) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return ".".join([alias[node.id], *reversed(parts)]) if isinstance(node, ast.Name) and node.id in alias else None

    for node in ast.walk(tree):
        name = None
        if isinstance(node, (ast.Attribute, ast.Name)):
            name = dotted(node)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            name = next((f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in apis), None)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            base = dotted(node.args[0])
            name = f"{base}.{node.args[1].value}" if base else None
        if name in apis:
            found.append((node.lineno, f"{where}:{node.lineno}: {name}"))
    return [hit for _, hit in sorted(found)]


def test_the_scan_finds_each_kind_of_direct_use():
    planted = ("import torch\nimport torch.distributed as dist\nfrom torch.distributed import reduce_scatter_single\n"
               "torch.accelerator.empty_host_cache()\ngather = getattr(dist, 'all_gather_single', None)\n")
    assert [hit.split(": ")[1] for hit in _direct_uses(planted, "planted.py")] == [
        "torch.distributed.reduce_scatter_single", "torch.accelerator.empty_host_cache",
        "torch.distributed.all_gather_single"]


def test_no_product_file_calls_a_newer_torch_api_directly():
    files = [path for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))] + [ROOT / "train.py"]
    support = ROOT / "config" / "torch_support.py"
    assert support in files
    hits = [hit for path in files if path != support
            for hit in _direct_uses(path.read_text(), str(path.relative_to(ROOT)))]
    assert not hits, "call config/torch_support.py's function instead: " + "; ".join(hits)
    assert _direct_uses(support.read_text(), "config/torch_support.py")  # the one place that may


def test_every_detected_api_has_its_function_and_the_pin_has_the_api():
    for api, function in NEWER_TORCH_APIS:
        assert callable(getattr(torch_support, function)), function
        module, _, name = api.rpartition(".")
        if torch_release(torch.__version__) >= NEWEST_TESTED_TORCH:  # on the pin the new API is what gets called
            assert hasattr(sys.modules[module], name), api
