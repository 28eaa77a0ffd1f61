"""The planning probes' one fake world (training/planning/fake/world.py) leaves the process as it found it: every
probe builds its rank there, one after another in one process (the ramp planner runs dozens), so a process group,
exception hook, patched DTensor function or fake mode left behind would change the next probe's world."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch.distributed.tensor import _sharding_prop

from config.recipe import load_config
from tests.trainer_runs import ROOT
from training.planning.fake.world import fake_world

pytestmark = pytest.mark.timeout(120)


def test_the_fake_world_builds_the_rank_and_restores_the_process_on_exit_and_on_error():
    cfg = load_config(os.path.join(ROOT, "recipes", "debug.toml"),
                      ["--model.n_layers", "1", "--training.seq_len", "64", "--parallelism.dp_shard", "2"])
    before = (sys.excepthook, _sharding_prop.detect_fake_mode)
    with pytest.raises(KeyError, match="inside"):
        with fake_world(cfg, world_size=2, rank=1, optimizer=True) as world:
            assert dist.get_world_size() == 2 and dist.get_rank() == 1
            assert active_fake_mode() is not None and _sharding_prop.detect_fake_mode is not before[1]
            assert world.mesh.dims.dp == 2 and world.accum_steps == cfg.training.grad_accum_steps(2)
            assert world.optimizer is not None and world.optimizer.state  # warmed up: AdamW's moments exist
            # dp_shard 2: FSDP2 shards every parameter's first dimension over the two ranks
            even = [p for p in world.params if p.shape[0] % 2 == 0]
            assert even and all(p.to_local().shape[0] == p.shape[0] // 2 for p in even)
            raise KeyError("inside")
    assert not dist.is_initialized()
    assert (sys.excepthook, _sharding_prop.detect_fake_mode) == before
    assert active_fake_mode() is None and not isinstance(torch.empty(1), torch._subclasses.FakeTensor)
