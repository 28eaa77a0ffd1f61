import json
import os

import pytest

from config import RecipeError
from training.metrics import MetricsLogger


def record(loss):
    return {"loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 10.0, "mfu": 0.1, "memory": 0.5}


def test_resume_replaces_the_replayed_steps(tmp_path):
    first = MetricsLogger(str(tmp_path), 6, enable_tensorboard=False, is_writer=True)
    for step in range(1, 5):
        first.log(step, record(float(step)))
    first.close()  # died after step 4; the newest checkpoint is step 2
    second = MetricsLogger(str(tmp_path), 6, enable_tensorboard=False, is_writer=True, start_step=2)
    for step in range(3, 7):
        second.log(step, record(10.0 + step))
    second.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0), (6, 16.0)]


def test_a_torn_last_line_is_dropped_with_a_warning_and_the_resume_goes_on(tmp_path, capsys):
    """A kill in the middle of a record's write: the resume keeps every whole record and logs on after them."""
    first = MetricsLogger(str(tmp_path), 6, enable_tensorboard=False, is_writer=True)
    for step in range(1, 4):
        first.log(step, record(float(step)))
    first.close()
    path = tmp_path / "metrics.jsonl"
    whole = path.read_text()
    path.write_text(whole + json.dumps({"step": 4, **record(4.0)})[:25])  # step 4 torn mid-string
    second = MetricsLogger(str(tmp_path), 6, enable_tensorboard=False, is_writer=True, start_step=3)
    second.log(4, record(14.0))
    second.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0)]
    assert "dropped its torn last line 4" in capsys.readouterr().err


def test_a_damaged_line_inside_the_file_is_one_line_naming_it(tmp_path):
    lines = [json.dumps({"step": n, **record(float(n))}) for n in (1, 2, 3)]
    lines[1] = lines[1][:10]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RecipeError, match="metrics.jsonl line 2 is not a JSON record; repair or remove"):
        MetricsLogger(str(tmp_path), 6, enable_tensorboard=False, is_writer=True, start_step=3)


def brute_force_pairs(document_ids, queries) -> int:
    """(query, key) pairs allowed by the full causal document mask of one row, for the given query positions."""
    import numpy as np

    same = document_ids[:, None] == document_ids[None, :]
    mask = same & np.tril(np.ones((len(document_ids),) * 2, dtype=bool))
    return int(mask[queries].sum())


def test_visible_pairs_of_any_shard_equal_the_mask_count():
    """sum(position_ids + 1) over any subset of a row's tokens (a CP shard, whatever the layout) counts exactly the
    mask's pairs of those queries, with document masking and without."""
    import numpy as np
    import torch

    from data.packing import row_fields
    from training.metrics import visible_pairs

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 6, size=65)
    tokens[[4, 5, 20, 41]] = 0  # EOS: documents of 5, 1, 15, 21 and 22 tokens
    for masking in (True, False):
        row = row_fields(tokens, eos_id=0, document_masking=masking)
        ids = row["document_ids"] if masking else np.zeros(64, dtype=np.int64)
        for shard in (np.arange(64), rng.choice(64, size=16, replace=False), np.r_[0:8, 56:64]):
            got = visible_pairs(torch.from_numpy(row["position_ids"][shard]))
            assert int(got) == brute_force_pairs(ids, shard)


class TwoRankComm:
    """Collectives of a two-rank world seen from rank 0: rank 1 reports `other` for the same reductions, in turn."""

    def __init__(self, other: list[list[float]]):
        self.other = iter(other)

    def reduce_values(self, values, group=None, op="sum"):
        theirs = next(self.other)
        return [max(a, b) if op == "max" else a + b for a, b in zip(values, theirs)]


def test_record_reports_balance_and_the_mfu_of_the_pairs_computed():
    """Two dp ranks, two micro-steps: rank 0 computes 30 and 10 pairs, rank 1 10 and 10. The step waits for 30 + 10
    = 40 while the mean rank does 30: balance 4/3. MFU counts dense FLOPs per token plus 12 L H d per pair."""
    import pytest
    import torch

    from config.recipe import load_config
    from models.llama import flops_per_token
    from parallelisms.context_parallel import CommStats
    from training.hardware import Device
    from training.metrics import StepMetrics
    from training.ramp import RampStage
    from parallelisms.parallel_dims import ParallelDims

    cfg = load_config("recipes/debug.toml", ["--training.seq_len", "64", "--training.local_batch_size", "1",
                                             "--training.global_batch_size", "4"])
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, world_size=2)
    stage = RampStage(-1, 0, 10, cfg, dims)
    # rank 1's numbers, in the order the record reduces them: the maxima (5 times, its peak resident set of 1,000 GiB,
    # 2 micro-steps), then the pairs sum
    comm = TwoRankComm([[1.0, 0.0, 0.0, 0.0, -1.0, 1000.0, 10.0, 10.0], [20.0]])
    metrics = StepMetrics(comm, CommStats(), Device("cpu", "gloo", torch.device("cpu")), 1e9, "test", 0)
    r = metrics.record(stage, 1, loss=1.0, lr=1e-3, grad_norm=1.0, step_time=2.0, data_time=0.0, tokens_seen=256,
                       visible_pairs=[30, 10])
    assert r["attention_balance"] == pytest.approx(40 / 30)
    assert r["attention_pairs"] == 60
    m = stage.model
    per_pair = 12 * m.n_layers * m.n_heads * m.head_dim
    assert r["mfu"] == pytest.approx((flops_per_token(m, 0) * 256 + per_pair * 60) / 2.0 / 2e9)
    assert r["mfu_causal"] == pytest.approx(flops_per_token(m, 64) * 256 / 2.0 / 2e9)
    assert r["host_memory"] == 1000.0  # the larger rank's peak resident set: rank 1's, not this process's


def test_the_host_peak_counts_the_pages_a_step_touched():
    """`host_memory` (training.hardware.peak_host_gib, the process's peak resident set) is what the GPU report holds
    against the dry run's host peak under training.cpu_offload: 256 MiB written by this process raise it by at least
    that much above the resident set before (/proc's VmRSS; a fresh interpreter, so no earlier test's peak counts)."""
    import subprocess
    import sys

    code = ("from training.hardware import peak_host_gib; import torch; "
            "from training.launch_checks.host_memory import resident_bytes; before = resident_bytes() / 2**30; "
            "t = torch.ones(64 * 2**20); print(before, peak_host_gib())")  # 64 Mi float32 = 256 MiB
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    before, after = map(float, done.stdout.split())
    assert after - before >= 0.25 - 0.01, (before, after)


def test_fsdp_bytes_count_the_float8_all_gather():
    """Issue 50, bug 6: with tensorwise float8 FSDP2 all-gathers each converted weight in float8 (1 byte instead of
    bf16's 2), forward and again for backward; the logged fsdp_comm_bytes say so, as the dry run does. Reference:
    the converted weights counted on the model itself (every block linear whose dims torchao converts)."""
    import pytest
    import torch

    from config.recipe import load_config
    from models.llama import Llama
    from parallelisms.context_parallel import CommStats
    from parallelisms.float8 import converts_linear
    from parallelisms.parallel_dims import ParallelDims
    from training.hardware import Device
    from training.metrics import StepMetrics
    from training.ramp import RampStage

    def fsdp_bytes(float8: str) -> float:
        cfg = load_config("recipes/debug.toml", ["--training.seq_len", "64", "--training.local_batch_size", "1",
                                                 "--training.global_batch_size", "4", "--training.dtype", "bfloat16",
                                                 "--training.float8", float8])
        stage = RampStage(-1, 0, 10, cfg, ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, world_size=2))
        comm = TwoRankComm([[1.0, 0.0, 0.0, 0.0, -1.0, 10.0], [10.0]])
        metrics = StepMetrics(comm, CommStats(), Device("cpu", "gloo", torch.device("cpu")), 1e9, "test", 0)
        return metrics.record(stage, 1, loss=1.0, lr=1e-3, grad_norm=1.0, step_time=2.0, data_time=0.0,
                              tokens_seen=128, visible_pairs=[10])["fsdp_comm_bytes"], stage.model

    plain, m = fsdp_bytes("off")
    fp8, _ = fsdp_bytes("tensorwise")
    with torch.device("meta"):
        model = Llama(m)
    converted = sum(mod.weight.numel() for name, mod in model.layers.named_modules()
                    if isinstance(mod, torch.nn.Linear)
                    and converts_linear(mod.in_features, mod.out_features, "feed_forward" in name, False))
    assert converted > 0
    grad_accum, gathers, shards = 2, 2, 2  # 4 rows / (2 ranks x 1 row); forward + backward; 1/2 sent per gather
    assert plain - fp8 == pytest.approx(converted * 1 * gathers * grad_accum * (shards - 1) / shards, rel=1e-12)
