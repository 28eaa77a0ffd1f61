"""The frontier's memory changes, predicted by the dry run (fake tensors) and measured on a real CPU step
(tests/training/real_step_memory.py: live storages of gloo rank 0): the peak drops by the same bytes.
- tiled RMSNorms (model.norm_chunk_tokens), one rank;
- CP attention in K/V head groups (parallelism.attention_head_groups), cp 2 with the norms, SwiGLU and loss tiled
  so that the attention's backward is the step's peak, as at 512K tokens per GPU (docs/frontier.md);
- the whole attention sublayer in K/V head groups (parallelism.attention_sublayer_groups, parallelisms/
  sublayer_groups.py) on the same step, the CP attention's own head groups on in both runs.
Debug model (dim 256, 16 heads), 2 blocks, full checkpointing, fp32. A few thousand tokens keep each real step at
seconds on two CPU cores; the savings are per token. Two blocks are enough: with full checkpointing the step's peak is
one block's recompute and backward on top of the kept block inputs, so each change's drop is that one block's and the
same at any depth (tiled norms 8.00 MiB, sublayer groups 6.00 MiB, dry run and real step, at 4 blocks and at 2); the
depth only adds the kept inputs under it (4 -> 2 blocks: the three cases 94 -> 49 CPU-s alone). The head groups at
4,096 tokens (2,048 per rank): the peak drops 5.37 of 90.86 MiB at 4 blocks, 5.37 of 74.23 at 2, dry run and real step
alike (at 8,192 and 4 blocks: 23.49 of 138.32, for 31 CPU-s against 14). bench/bench_memory_changes_64k.py runs the
same measurement at 4 blocks and 65,536 tokens (documents masked, so that the CPU's attention takes minutes, not
hours)."""
from __future__ import annotations

import concurrent.futures
import os
import sys

import pytest

from tests.distributed import fresh_process_context

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["--model.n_layers", "2", "--training.local_batch_size", "1", "--parallelism.dp_shard", "1",
          "--activation_checkpoint.mode", "full"]
# name: (ranks, overrides of both runs, (overrides without the change, overrides with it))
CHANGES = {
    "tiled norms": (1, ["--training.seq_len", "4096"],
                    (["--model.norm_chunk_tokens", "0"], ["--model.norm_chunk_tokens", "512"])),
    "attention head groups": (2, ["--training.seq_len", "4096", "--parallelism.cp", "2",
                                  "--model.norm_chunk_tokens", "512", "--model.mlp_chunk_tokens", "512",
                                  "--training.loss_chunk_tokens", "512"],
                              (["--parallelism.attention_head_groups", "1"],
                               ["--parallelism.attention_head_groups", "16"])),
    "attention sublayer groups": (2, ["--training.seq_len", "4096", "--parallelism.cp", "2",
                                      "--model.norm_chunk_tokens", "512", "--model.mlp_chunk_tokens", "512",
                                      "--training.loss_chunk_tokens", "512", "--parallelism.attention_head_groups", "16"],
                                  (["--parallelism.attention_sublayer_groups", "0"],
                                   ["--parallelism.attention_sublayer_groups", "16"])),
}
AT_64K = {f"{name} at 64K": (ranks, [*both, "--training.seq_len", "65536", "--data.document_masking", "true",
                                     "--model.n_layers", "4"], variants)
          for name, (ranks, both, variants) in CHANGES.items()}
"""The same changes at 65,536 tokens (the later --training.seq_len wins), for the benchmark, at its 4 blocks."""


def _change(name):
    return CHANGES[name] if name in CHANGES else AT_64K[name]


def _cfgs(change):
    from config.recipe import load_config

    _, both, variants = _change(change)
    return [load_config(os.path.join(ROOT, "recipes", "debug.toml"), COMMON + both + v) for v in variants]


def _fake_peaks(change):
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    from training.planning.memory_probe import measure_rank

    return [measure_rank(cfg, _change(change)[0]).peak for cfg in _cfgs(change)]


def _real_peaks(rank, world, change):
    from tests.training.real_step_memory import real_step_peaks

    return [real_step_peaks(cfg, world)["peak"] for cfg in _cfgs(change)]


def peaks_without_and_with(change: str, timeout: float = 300) -> tuple[list, list]:
    """([dry-run peak without, with], [real peak without, with]) in bytes, rank 0."""
    from tests.distributed import run_ranks

    ranks = _change(change)[0]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=fresh_process_context()) as pool:
        fake = pool.submit(_fake_peaks, change)
        real = run_ranks(_real_peaks, ranks, args=(change,), timeout=timeout)[0]
        return fake.result(timeout=timeout), real


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("change", list(CHANGES))
def test_real_peak_drops_as_the_dry_run_says(change):
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): a real step and a dry run per change,
    34-56 s each."""
    fake, real = peaks_without_and_with(change)
    predicted, measured = fake[0] - fake[1], real[0] - real[1]
    print(f"{change}: peaks MiB without/with: dry run {fake[0] / 2**20:.2f}/{fake[1] / 2**20:.2f}, real "
          f"{real[0] / 2**20:.2f}/{real[1] / 2**20:.2f}; drop predicted {predicted / 2**20:.2f}, "
          f"real {measured / 2**20:.2f}")
    assert predicted > 0.02 * fake[0]  # a change that moves the peak, not noise
    assert abs(measured - predicted) <= 0.1 * predicted
