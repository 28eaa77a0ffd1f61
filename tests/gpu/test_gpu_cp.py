"""Ring, all-gather, Ulysses and hybrid CP against full-sequence float64 attention (tests/gpu/cp_cases.py), run two
ways:

- P ranks as threads of one process under the NCCL-rule double (tests/nccl_rules.py): on one GPU, every rank's
  blocks of a CP 2 / CP 4 layout on that device with the real CUDA kernels, merged across ranks, NCCL's ordering
  rules enforced. The cpu variant (fast tier) runs a thin pass of the same cases on the CPU kernels.
- P real processes, the backend chosen at run time: NCCL with one GPU per rank (needs >= P GPUs), gloo on the CPU
  (slow tier).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from tests.gpu.cp_cases import VARIANTS, cp_cases, failures, run_cp_case
from tests.gpu.devices import FAST_CPU, RANKS_LIMIT_S, SLOW_CPU, require
from tests.nccl_rules import run_ring_ranks


def _every_case(group, device: torch.device, cases):
    """Each case's errors on this rank; rank 0 prints each case's seconds as it ends (the GPU report runs pytest with
    `-s`), so a file ended at its limit still shows how far it got and which case was slow."""
    results = []
    for case in cases:
        start = time.perf_counter()
        results.append((case, run_cp_case(group, device, case)))
        if dist.get_rank(group) == 0:
            print(f"cp case {case} on {device.type}: {time.perf_counter() - start:.2f} s", flush=True)
    return results


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("device", FAST_CPU)
def test_cp_ranks_in_one_process_match_full_sequence_attention(device, size, monkeypatch):
    torch_device = require(device)
    cases = cp_cases(size, thorough=device == "cuda")
    per_rank = run_ring_ranks(lambda group: _every_case(group, torch_device, cases), size, monkeypatch,
                              timeout=RANKS_LIMIT_S if device == "cuda" else 600)
    assert not [line for rank_errors in per_rank for line in failures(rank_errors, device)]
    assert all(len(rank_errors) == len(cases) for rank_errors in per_rank)


def _processes_body(rank, size, device_type, thorough):
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    return _every_case(dist.group.WORLD, device, cp_cases(size, thorough))


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("device", SLOW_CPU)
def test_cp_over_real_processes_matches_full_sequence_attention(device, size):
    """One process per rank: NCCL over GPUs (the backend the trainer picks there), gloo on the CPU."""
    require(device, ranks=size)
    backend = "nccl" if device == "cuda" else "gloo"
    per_rank = run_ranks(_processes_body, size, args=(device, device == "cuda"),
                         timeout=RANKS_LIMIT_S if device == "cuda" else 600, backend=backend)
    assert not [line for rank_errors in per_rank for line in failures(rank_errors, device)]


def test_cp_case_plans_cover_every_variant_and_path():
    """What the cuda variants run, checked on any machine: every variant (hybrid at CP 4), both dtypes, documents,
    GQA and K/V replication; the thin CPU pass keeps one case per distinct path."""
    thorough = cp_cases(4, thorough=True)
    assert {c.variant for c in thorough} == set(VARIANTS)
    assert {c.kv_heads for c in thorough if c.variant == "ulysses"} == {1, 2, 4}
    assert {(c.dtype, c.documents, c.is_causal) for c in thorough} >= {("float32", True, True),
                                                                      ("bfloat16", False, False)}
    assert {c.variant for c in cp_cases(2, thorough=True)} == {"ring", "allgather", "ulysses"}
    assert {(c.variant, c.kernel) for c in thorough if c.dtype == "bfloat16" and not c.documents} == {
        (v, k) for v in VARIANTS for k in ("auto", "flash")}  # cuDNN and FlashAttention-2 on a Hopper GPU
    assert len(cp_cases(4, thorough=False)) == 2 * len(VARIANTS)
