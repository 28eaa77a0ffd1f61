"""Activation offload per [[ramp]] stage: the stage's `offload` resolves (keep = the previous stage's), a stage that
offloads without a checkpoint mode is a one-line error, the offloader's switch leaves plain checkpointing when off,
and a real ramp whose second stage offloads trains the same losses as the ramp without offload."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from config import RecipeError
from config.recipe import load_config
from models.llama import Llama, LlamaConfig
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from tests.trainer_runs import read_metrics, run_train
from training.launch_checks.preflight import preflight_stages
from training.ramp import model_build_config

RECIPE = """
[model]
name = "debug"
n_layers = 2
[training]
steps = 4
seq_len = 64
local_batch_size = 1
tokens_per_step = 256
dtype = "float32"
[parallelism]
dp_shard = 1
[activation_checkpoint]
mode = "{mode}"
[metrics]
enable_tensorboard = false
[[ramp]]
start_step = 0
seq_len = 64
[[ramp]]
start_step = 2
seq_len = 128
{offload}
"""


def _recipe(tmp_path, mode="full", offload="offload = true", name="ramp.toml") -> str:
    path = tmp_path / name
    path.write_text(RECIPE.format(mode=mode, offload=offload))
    return str(path)


def test_stage_offload_resolves_and_the_model_is_built_with_the_offloader(tmp_path):
    stages = preflight_stages(load_config(_recipe(tmp_path)), world_size=1)
    assert [s.cfg.activation_checkpoint.offload for s in stages] == [False, True]
    assert model_build_config(stages).activation_checkpoint.offload
    plain = preflight_stages(load_config(_recipe(tmp_path, offload="", name="plain.toml")), world_size=1)
    assert not model_build_config(plain).activation_checkpoint.offload


@pytest.mark.parametrize("mode, offload, expect", [
    ("none", "offload = true", "ramp[1] (start_step 2): offload = true needs activation_checkpoint.mode"),
    ("full", "offload = 1", "ramp[1].offload = 1: use true or false"),
])
def test_bad_stage_offload_is_a_one_line_error(tmp_path, mode, offload, expect):
    with pytest.raises(RecipeError) as err:
        preflight_stages(load_config(_recipe(tmp_path, mode, offload)), world_size=1)
    assert expect in str(err.value) and "\n" not in str(err.value)


TINY = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, rope_theta=10000.0)


def _two_steps(offload: bool, enabled: list[bool]):
    """One step per entry of `enabled` (the offloader's switch in that step): losses, final grads, host peaks."""
    model = Llama(LlamaConfig(**TINY))
    apply_activation_checkpointing(model, "full", 1, offload)
    model.init_weights(0)
    offloader = getattr(model, "activation_offloader", None)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(3))
    losses, peaks = [], []
    for on in enabled:
        if offloader is not None:
            offloader.enabled = on
            offloader.reset_peak()
        model.zero_grad()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        peaks.append(offloader.peak_host_bytes if offloader else 0)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return losses, [p.grad for p in model.parameters()], peaks


def test_offloader_switched_off_is_plain_checkpointing():
    ref_losses, ref_grads, _ = _two_steps(False, [False, False])
    losses, grads, peaks = _two_steps(True, [False, True])
    assert losses == ref_losses and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert peaks == [0, TINY["n_layers"] * 2 * 32 * TINY["dim"] * 4]  # off: nothing on host; on: every block input


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ramp_offloading_only_its_second_stage_trains_the_same_losses(tmp_path):
    """The real trainer on 1 rank, 2 stages of 2 steps: offload only in stage 2 vs no offload, fp32: equal losses;
    the offloader held host bytes only in stage 2 (metrics.jsonl's offload_host_peak_bytes, per step)."""
    runs = {}
    for name, offload in (("plain", ""), ("offload", "offload = true")):
        out = str(tmp_path / name)
        done = run_train(_recipe(tmp_path, offload=offload, name=f"{name}.toml"), "--job.dump_folder", out,
                         nproc=1, timeout=180, forked=True)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        runs[name] = read_metrics(out)
    plain, offloaded = runs["plain"], runs["offload"]
    assert [r["loss"] for r in offloaded] == [r["loss"] for r in plain]
    assert "offload_host_peak_bytes" not in plain[0]
    block_input = 128 * 256 * 4  # stage 2: one fp32 row of 128 tokens x the debug width per block
    assert [r["offload_host_peak_bytes"] for r in offloaded] == [0, 0, 2 * block_input, 2 * block_input]
