"""The dry run's measurement of evaluation: each ramp stage's evaluations run on the probe's fake tensors, after its
training step, through the trainer's own code (training/evaluation/rows.py `score_tokens`).

A stage's evaluations are those the trainer runs while the stage is current: long-document loss and NIAH at every
`*_interval` step inside the stage, and all enabled evaluations at the last step (passkey only there). Each is one
forward of `rows x length` tokens: long-document loss 1 row at the stage's seq_len, passkey and NIAH
training.local_batch_size rows at their longest length. Answer evaluations are scored as every token labelled (fake
tensors hold no labels to select from): an upper bound by one chunk of logits over the few answer tokens.

`tracked_bytes`, the one reader of a memory tracker's snapshot, lives here, the lowest module that reads one: the
memory probe (which calls `measure_eval_peak`) and the CUDA-path probe import it from here, with the trackers they
make (`PeakMemTracker`, `PeakFSDPMemTracker`).
"""
from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

from config.schema import Config
from training.evaluation.rows import eval_chunk_tokens, score_tokens
from training.evaluation.niah import niah_eval_lengths
from training.planning.fake.world import fake_batch
from training.step import cp_context


@dataclass(frozen=True)
class EvalShape:
    key: str
    """The recipe key that sets this evaluation's size (what a refusal names)."""
    rows: int
    length: int


def eval_shapes(cfg: Config) -> list[EvalShape]:
    """The forwards of the stage's evaluations, one per evaluation (its largest)."""
    e, t = cfg.eval, cfg.training
    shapes = []
    if e.long_doc_loss:
        shapes.append(EvalShape("eval.long_doc_loss", 1, t.seq_len))
    if e.niah:
        shapes.append(EvalShape("eval.niah_lengths", t.local_batch_size, max(niah_eval_lengths(cfg))))
    if e.passkey:
        shapes.append(EvalShape("eval.passkey_lengths", t.local_batch_size, max(e.passkey_lengths or [t.seq_len])))
    return shapes


def _kind(category: str) -> str:
    name = category.lower()
    if "opt" in name:
        return "optimizer"
    if "grad" in name or "reduce scatter" in name:
        return "grads"
    if "param" in name or "all gather" in name or "buffer" in name:
        return "params"
    return "activations"


class _PeakOnly:
    """A memory tracker that keeps the whole-rank peak only. torch's trackers also keep every tracked module's own
    peak, updated after every op by a walk over all the modules (11% of a 1M-token 8B dry run's time, 12% of its
    samples in `_update_peak_stats`); the probes read nothing but the rank's "current" and "peak" snapshots
    (`tracked_bytes`), whose updates below are torch's own lines, so every figure is the same."""

    def _update_peak_stats(self, peak_state) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(dev_snap)


class PeakMemTracker(_PeakOnly, MemTracker):
    """torch's MemTracker, whole-rank peak only (`_PeakOnly`)."""


class PeakFSDPMemTracker(_PeakOnly, FSDPMemTracker):
    """torch's FSDPMemTracker, whole-rank peak only (`_PeakOnly`)."""


def tracked_bytes(snapshot: dict) -> dict[str, float]:
    """A memory tracker's snapshot {device: {category: bytes}} summed into params / grads / optimizer / activations /
    Total (every probe reads its trackers through this)."""
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0, "Total": 0.0}
    for per_device in snapshot.values():
        for category, nbytes in per_device.items():
            name = getattr(category, "value", category)
            out["Total" if name == "Total" else _kind(name)] += nbytes
    return out


@torch.no_grad()
def measure_eval_peak(cfg: Config, setup, tracker) -> float:
    """The most bytes any of the stage's evaluations holds at once (persistent state included), each measured by a
    fresh `tracker()` context (the probe's memory tracker) around the trainer's own evaluation forward; 0 without
    evaluations. Runs inside the probe's FakeTensorMode, after its training step."""
    model, p, peak = setup.model, setup.parallelism, 0.0
    was_training = model.training
    model.eval()
    for shape in sorted(set(eval_shapes(cfg)), key=lambda s: (s.rows * s.length, s.key)):
        with tracker() as memory:
            score_tokens(model, fake_batch(cfg, shape=(shape.rows, shape.length)),
                         eval_chunk_tokens(setup.loss_chunk_tokens), sparse_labels=False,
                         cp_context=(lambda batch: cp_context(setup, batch)) if setup.shards_sequence else None,
                         cp_mesh=setup.mesh.cp_mesh, cp_size=p.cp, load_balancer=p.cp_load_balancer)
            peak = max(peak, tracked_bytes(memory.get_tracker_snapshot("peak"))["Total"])
    model.train(was_training)
    return peak


def eval_refusal(cfg: Config, eval_peak_gib: float, usable_gib: float) -> str | None:
    """One line naming the evaluation setting to change when the stage's evaluation does not fit, else None."""
    if eval_peak_gib <= usable_gib:
        return None
    shapes = eval_shapes(cfg)
    largest = max(shapes, key=lambda s: s.rows * s.length)
    what = (f"{largest.key} (longest {largest.length:,} tokens x {largest.rows} row(s) per forward)"
            if largest.key != "eval.long_doc_loss" else "eval.long_doc_loss (1 row of training.seq_len per forward)")
    return (f"the evaluation peaks {eval_peak_gib:.1f} GiB > {usable_gib:g} GiB usable: change {what} "
            f"(shorter lengths, or training.local_batch_size for passkey/NIAH rows), or evaluate a checkpoint on "
            f"another mesh")
