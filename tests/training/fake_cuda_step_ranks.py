"""Counts the host syncs of the trainer's micro-steps on fake CUDA tensors (training/planning/step_sync_probe.py) for every
rank of a cp 2 x dp 2 debug run with documents and placement by work, one rank after another in this process; prints
one JSON object {rank: {"micro_steps", "counts", "places"}}. Run with the fake CUDA runtime preloaded
(training/planning/fake/cuda.fake_cuda_env); used by tests/training/test_fake_cuda_step_syncs.py.

    python tests/training/fake_cuda_step_ranks.py [--section.key value ...]
"""
import dataclasses
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from config.recipe import load_config  # noqa: E402
from data.loader import build_dataloader  # noqa: E402
from training.planning.step_sync_probe import count_micro_step_syncs  # noqa: E402

WORLD = 4
RUN = ["--training.seq_len", "128", "--training.local_batch_size", "1", "--training.global_batch_size", "4",
       "--parallelism.dp_shard", "2", "--parallelism.cp", "2", "--data.document_masking", "true",
       "--data.placement", "work", "--parallelism.cp_load_balancer", "documents", "--model.n_layers", "2"]
"""The debug model at 2 blocks, not 6: a host sync is made (or not) by each block alike, and 2 blocks still hand
activations and document plans from one block to the next. The five probes of test_fake_cuda_step_syncs took 69.6
CPU-s at 6 blocks, 31.8 at 2 (2026-12-05)."""


class DocumentTokenizer:
    """Document "i n" becomes n tokens: rows of many short documents, so the documents layout has pieces to plan."""
    eos_id = 0

    def encode(self, text):
        doc, length = map(int, text.split())
        return [1 + (7 * doc + j) % 200 for j in range(length)]


DOCUMENTS = [f"{i} {n}" for i, n in enumerate(np.random.default_rng(7).integers(5, 60, size=60))]


def main(overrides: list[str]) -> dict:
    cfg = load_config(os.path.join(ROOT, "recipes", "debug.toml"), RUN + overrides)
    t = cfg.training

    def micro_loader_for(mesh):  # training/build.build_stage_data's loader, placed by work: the whole micro-batch
        return build_dataloader(DocumentTokenizer(), DOCUMENTS, seq_len=t.seq_len,
                                local_batch_size=t.local_batch_size * mesh.dims.dp, dp_rank=0, dp_size=1,
                                seed=cfg.job.seed, document_masking=True)

    out = {}
    for rank in range(WORLD):
        syncs = count_micro_step_syncs(cfg, WORLD, rank, micro_loader_for, steps=1)
        out[rank] = dataclasses.asdict(syncs)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
