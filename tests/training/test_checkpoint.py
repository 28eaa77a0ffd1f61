"""training.checkpoint: exact resume (sync and async), resharding with the data position kept, atomic publishing,
damaged or foreign checkpoints. A tiny Llama trained by a minimal loop; the reference is always the same loop run
without interruption (and, for the data, a single loader reading the global stream)."""
from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.data.test_loader import DOCUMENTS, NumberedTokenizer
from tests.distributed import run_ranks
from config import RecipeError

TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32)
SEQ_LEN = 12


def _config(**overrides):
    from config.schema import CheckpointConfig

    return CheckpointConfig(**{"enable": True, "interval": 2, "keep_latest_k": 0, **overrides})


class ToyRun:
    """Model (FSDP over all ranks when there are several), AdamW, warmup/decay schedule, the real data loader, and
    a Checkpointer over them: the Trainer's state, small enough for the fast tier."""

    def __init__(self, folder: str, local_batch: int, model_overrides: dict | None = None, **ck):
        import torch.distributed as dist

        from data.loader import build_dataloader
        from models.llama import Llama, LlamaConfig
        from training.checkpoint import Checkpointer
        from training.lr_schedule import build_lr_scheduler

        self.world = dist.get_world_size() if dist.is_initialized() else 1
        with torch.device("meta"):
            model = Llama(LlamaConfig(**{**TINY, **(model_overrides or {})}))
        if self.world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            from parallelisms.data_parallel import apply_fsdp

            apply_fsdp(model, init_device_mesh("cpu", (self.world,)), torch.float32, True)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(0)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
        self.scheduler = build_lr_scheduler(self.optimizer, 2, 6, "linear", 0.1)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.local_batch = local_batch
        self.loader = build_dataloader(NumberedTokenizer(), DOCUMENTS, seq_len=SEQ_LEN, local_batch_size=local_batch,
                                       dp_rank=rank, dp_size=self.world, seed=3)
        self.checkpointer = Checkpointer(_config(**ck), folder, [model], self.optimizer, self.scheduler, self.loader)
        self.step = self.checkpointer.load()
        self.batches = iter(self.loader)

    def train(self, until: int, total: int) -> tuple[list[float], list[list[tuple]]]:
        """Steps up to `until` -> (global losses, this rank's rows per step, as token tuples)."""
        import torch.distributed as dist

        losses, rows = [], []
        global_tokens = self.local_batch * self.world * SEQ_LEN
        while self.step < until:
            batch = next(self.batches)
            rows.append([tuple(r) + (int(l[-1]),) for r, l in zip(batch["input_ids"].tolist(), batch["labels"])])
            logits = self.model(batch["input_ids"] % TINY["vocab_size"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten() % TINY["vocab_size"],
                                   reduction="sum") / global_tokens
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            loss = loss.detach()
            if self.world > 1:
                dist.all_reduce(loss)
            losses.append(loss.item())
            self.step += 1
            self.checkpointer.maybe_save(self.step, last=self.step == total)
        return losses, rows

    def close(self):
        self.checkpointer.close()


def _resume_body(rank, world, folder):
    import torch.distributed as dist

    out = {}
    for mode in ("disabled", "async"):
        path = os.path.join(folder, mode)
        straight = ToyRun(path, 2, async_mode=mode)
        losses, rows = straight.train(4, 4)
        straight.close()
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        resumed = ToyRun(path, 2, async_mode=mode, load_step=2)
        assert resumed.step == 2
        out[mode] = (losses, resumed.train(4, 4)[0], gathered)
        resumed.close()
    return out


def test_resume_is_bit_identical_sync_and_async_and_reshards_to_one_process(tmp_path):
    results = run_ranks(_resume_body, 2, args=(str(tmp_path),), timeout=120)
    for mode in ("disabled", "async"):
        straight, resumed, _ = results[0][mode]
        assert resumed == straight[2:], (mode, straight, resumed)  # exact float equality
        assert sorted(os.listdir(tmp_path / mode / "checkpoints")) == ["step-2", "step-4"]
    # The 2-rank FSDP checkpoint of step 2 in one process without FSDP (DTensor shards -> plain tensors), reading
    # the global batch of 4 rows at once: the same losses, and the rows the two ranks read together, in order.
    straight, _, gathered = results[0]["disabled"]
    one = ToyRun(str(tmp_path / "disabled"), 4, load_step=2)
    losses, rows = one.train(4, 4)
    assert [list(r) for r in rows] == _global_rows(gathered, 4)[2:]
    for got, want in zip(losses, straight[2:]):
        assert abs(got - want) <= 1e-5 * abs(want)


def _train_and_save_body(rank, world, folder, local_batch):
    import torch.distributed as dist

    run = ToyRun(folder, local_batch)
    losses, rows = run.train(4, 4)
    run.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    return losses, gathered


def _resume_body_rows(rank, world, folder, local_batch):
    import torch.distributed as dist

    run = ToyRun(folder, local_batch, load_step=2)
    losses, rows = run.train(4, 4)
    run.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    return losses, gathered


def _global_rows(gathered, steps):
    """Rows of each global batch in stream order: dp rank 0's local rows, then rank 1's, ..."""
    return [[row for rank_rows in gathered for row in rank_rows[s]] for s in range(steps)]


@pytest.mark.slow
def test_reshard_dp4_to_dp2_and_one_process_keeps_losses_and_every_row_once(tmp_path):
    from tests.data.test_loader import _loader, _rows, _take

    folder = str(tmp_path)
    saved = run_ranks(_train_and_save_body, 4, args=(folder, 1), timeout=120)[0]
    straight_losses, straight_rows = saved[0], _global_rows(saved[1], 4)
    # The reference stream: one loader reading the global stream (dp 1, the whole global batch of 4 rows).
    single = _rows(_take(_loader(seq_len=SEQ_LEN, seed=3, local_batch_size=4), 4))
    assert [row for step in straight_rows for row in step] == single

    resumed = run_ranks(_resume_body_rows, 2, args=(folder, 2), timeout=120)[0]
    resumed_rows = _global_rows(resumed[1], 2)
    assert resumed_rows == straight_rows[2:]  # neither repeated nor skipped
    for got, want in zip(resumed[0], straight_losses[2:]):
        assert abs(got - want) <= 1e-5 * abs(want)

    one = ToyRun(folder, 4, load_step=2)  # DTensor shards -> plain tensors, no process group at all
    losses, rows = one.train(4, 4)
    assert [list(r) for r in rows] == resumed_rows
    for got, want in zip(losses, straight_losses[2:]):
        assert abs(got - want) <= 1e-5 * abs(want)


# ---------------------------------------------------------------- one process: files on disk
def _saved_run(tmp_path, steps=(1, 2, 3)):
    run = ToyRun(str(tmp_path), 2, interval=1)
    run.train(max(steps), max(steps))
    run.close()
    return os.path.join(str(tmp_path), "checkpoints")


def _distcp(folder, step):
    directory = os.path.join(folder, f"step-{step}")
    return os.path.join(directory, next(n for n in os.listdir(directory) if n.endswith(".distcp")))


def test_partial_and_unpublished_folders_are_ignored(tmp_path, capsys):
    folder = _saved_run(tmp_path)
    shutil.copytree(os.path.join(folder, "step-3"), os.path.join(folder, "step-9.partial"))
    shutil.copytree(os.path.join(folder, "step-3"), os.path.join(folder, "step-7"))
    os.remove(os.path.join(folder, "step-7", "checkpoint.json"))  # a folder this trainer never published
    run = ToyRun(str(tmp_path), 2)
    assert run.step == 3
    err = capsys.readouterr().err
    assert "step-7/checkpoint.json' is missing" in err and "falling back" in err


def test_truncated_file_falls_back_with_a_warning_or_fails_naming_it(tmp_path, capsys):
    folder = _saved_run(tmp_path)
    bad = _distcp(folder, 3)
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) // 2)
    run = ToyRun(str(tmp_path), 2)
    assert run.step == 2
    assert f"'{bad}' is corrupt" in capsys.readouterr().err
    with pytest.raises(RecipeError, match=f"'{bad}' is corrupt"):
        ToyRun(str(tmp_path), 2, load_step=3)


def test_flipped_bytes_are_caught_by_the_checksum(tmp_path, capsys):
    folder = _saved_run(tmp_path)
    bad = _distcp(folder, 3)
    with open(bad, "r+b") as f:
        f.seek(os.path.getsize(bad) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(RecipeError, match=f"'{bad}' is corrupt \\(CRC32"):
        ToyRun(str(tmp_path), 2, load_step=3)
    os.remove(os.path.join(folder, "step-2", ".metadata"))
    with pytest.raises(RecipeError, match="step-2/.metadata' is missing"):
        ToyRun(str(tmp_path), 2, load_step=2)
    assert ToyRun(str(tmp_path), 2).step == 1  # newest usable, after two warnings
    assert capsys.readouterr().err.count("falling back") == 2


@pytest.mark.parametrize("overrides, expect", [
    (dict(dim=48), r"parameter tok_embeddings.weight is \[64, 32\] there and \[64, 48\] here"),
    (dict(n_layers=3), "has no parameter layers.2.attention_norm.weight"),
    (dict(n_layers=1), "has parameter layers.1.attention.wk.weight that this model lacks"),
    (dict(n_kv_heads=4), r"parameter layers.0.attention.wk.weight is \[16, 32\] there and \[32, 32\] here"),
])
def test_another_model_shape_is_refused_naming_the_parameter(tmp_path, overrides, expect):
    _saved_run(tmp_path, steps=(1,))
    with pytest.raises(RecipeError, match=expect):
        ToyRun(str(tmp_path), 2, model_overrides=overrides)


def test_keep_latest_k_and_resaving_a_step(tmp_path):
    run = ToyRun(str(tmp_path), 2, interval=1, keep_latest_k=2)
    run.train(4, 4)
    folder = os.path.join(str(tmp_path), "checkpoints")
    assert sorted(os.listdir(folder)) == ["step-3", "step-4"]
    again = ToyRun(str(tmp_path), 2, interval=1, keep_latest_k=2, load_step=3)
    again.train(4, 4)  # step 4 saved again over the old one
    assert sorted(os.listdir(folder)) == ["step-3", "step-4"]
    fresh = ToyRun(str(tmp_path), 2, load_step=0)
    assert fresh.step == 0


def test_pipeline_parts_save_under_the_full_model_names(tmp_path):
    """Two 'stages' of one model (blocks split, ends on either side) checkpoint as the whole model does."""
    from models.llama import Llama, LlamaConfig
    from training.checkpoint import ModelParts
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = Llama(LlamaConfig(**TINY))
    full.init_weights(1)
    first, second = copy.deepcopy(full), copy.deepcopy(full)
    del first.layers["1"]
    first.norm = first.output = None
    del second.layers["0"]
    second.tok_embeddings = None
    merged = get_model_state_dict(ModelParts([first, second]))
    reference = full.state_dict()
    assert list(merged) == list(reference)
    assert all(torch.equal(merged[k], reference[k]) for k in reference)


@pytest.mark.slow
def test_launcher_refuses_a_foreign_checkpoint_or_hf_folder_in_one_line(tmp_path):
    """train.py --check (run by run_train.sh before torchrun) checks what would be loaded against the recipe. Slow tier
    since issue 56 (the fast tier runs in minutes; CI runs both): three train.py --check launches after a save, 36 s."""
    from tests.models.test_hf import hf_model
    from tests.trainer_runs import run_train

    _saved_run(tmp_path / "run", steps=(1,))  # the tiny model's checkpoint where the debug model would resume
    hf_model().save_pretrained(tmp_path / "hf")
    cases = [(["--checkpoint.enable", "true", "--job.dump_folder", str(tmp_path / "run")],
              r"parameter tok_embeddings.weight is [64, 32] there and [2048, 256] here"),
             (["--checkpoint.hf_load_path", str(tmp_path / "hf"), "--job.dump_folder", str(tmp_path / "other")],
              "has dim 64 but the recipe's model has 256"),
             (["--checkpoint.enable", "true", "--checkpoint.load_step", "7", "--job.dump_folder",
               str(tmp_path / "run")], "checkpoints/step-7' does not exist or was never completed. Complete "
                                       "checkpoints: [1]")]
    for args, expect in cases:
        result = run_train(*args, timeout=120)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0].startswith("error: ") and expect in lines[0], lines[0]
