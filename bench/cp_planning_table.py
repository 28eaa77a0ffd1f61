"""Planning table: for Llama 3 8B and 70B on 8, 16, 32 and 64 H100-80GB, the smallest context-parallel degree per
sequence length and the longest sequence that fits, with and without activation offload.

    .venv/bin/python bench/cp_planning_table.py [RECIPE] [--models llama3_8b,llama3_70b]

Method (measured, then interpolated: a full search would take ~100 dry-run probes of ~15-60 s each): one rank's
peak is measured by the dry run's own probe (training/planning/memory_probe.py: real model and composer on fake tensors, one
optimizer step under FSDPMemTracker, 3 and 4 blocks extrapolated to the full depth) at four points per model, all
with cp 8: (16K tokens per rank, 8 and 64 GPUs) and (64K tokens per rank, 64 GPUs) without offload, (64K, 64 GPUs)
with offload. Two facts of the step turn these into every cell:
- the forward/backward peak is linear in the tokens per rank T (logits, saved block inputs, recompute buffers, ring
  blocks are all T x width) with a slope that does not depend on the number of GPUs G;
- its T-independent part and the optimizer-step peak are persistent state (FSDP shards over all G GPUs, so ~1/G)
  plus G-independent buffers (gathered blocks): a + b/G, fitted from 8 and 64 GPUs.
Offload changes the slope only (it moves T-proportional bytes). The line proposes, a probe decides: for every GPU
count, with and without offload, the largest power-of-two tokens per rank the line allows is measured directly at
cp = GPUs and halved until it fits; that verified limit sets every cell of the column (cells at the limit show the
measured peak, marked *, the others the line's, at least a factor 2 in tokens below the limit).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config.recipe import load_config  # noqa: E402
from models.llama import recipe_model_config  # noqa: E402
from training.planning.dry_run import RUNTIME_RESERVE_GIB, PlanRow  # noqa: E402
from training.planning.memory_probe import GIB, measure_rank, with_section  # noqa: E402

SEQ_LENS = tuple(2**k for k in range(13, 24))  # 8K .. 8M
GPUS = (8, 16, 32, 64)
PROBE_CP, T_SMALL, T_LARGE = 8, 16384, 65536


def row_for(cfg, seq_len: int, cp: int, gpus: int, offload: bool = False):
    par = dataclasses.replace(cfg.parallelism, cp=cp, dp_shard=gpus // cp, dp_replicate=1, tp=1, pp=1)
    training = dataclasses.replace(cfg.training, seq_len=seq_len, local_batch_size=1, global_batch_size=-1)
    ac = dataclasses.replace(cfg.activation_checkpoint, mode="full", offload=offload)
    return PlanRow(f"{seq_len}", dataclasses.replace(cfg, parallelism=par, training=training,
                                                     activation_checkpoint=ac))


def probe(cfg, tokens_per_rank: int, gpus: int, offload: bool, cp: int = PROBE_CP):
    """Rank 0's memory for one step, blocks 3 and 4 measured and extrapolated (the dry run also checks block 5)."""
    c = row_for(cfg, tokens_per_rank * cp, cp, gpus, offload).cfg
    m3, m4 = (measure_rank(with_section(c, "model", n_layers=d), gpus) for d in (3, 4))
    return m3.extrapolate(m4, recipe_model_config(c).n_layers - 3)


@dataclass
class MemoryModel:
    """GiB per rank: forward/backward peak a + b/G + slope*T, optimizer-step peak c + d/G, host bytes h*T."""
    a: float
    b: float
    slope: dict
    c: float
    d: float
    host_per_token: float

    def peak(self, tokens: float, gpus: int, offload: bool) -> float:
        return max(self.a + self.b / gpus + self.slope[offload] * tokens, self.c + self.d / gpus)

    def host(self, tokens: float, offload: bool) -> float:
        return self.host_per_token * tokens if offload else 0.0

    def max_tokens_per_rank(self, gpus: int, offload: bool, usable: float) -> float:
        if self.c + self.d / gpus > usable:
            return 0.0
        return max(0.0, (usable - self.a - self.b / gpus) / self.slope[offload])


def fit(cfg, log) -> MemoryModel:
    """Four probes (module docstring) -> the model's coefficients."""
    points = {}
    for tokens, gpus, offload in ((T_SMALL, 8, False), (T_SMALL, 64, False), (T_LARGE, 64, False),
                                  (T_LARGE, 64, True)):
        start = time.perf_counter()
        m = points[tokens, gpus, offload] = probe(cfg, tokens, gpus, offload)
        log(f"  probe {cfg.model.name}: {tokens // 1024}K tokens/rank, cp {PROBE_CP}, {gpus} GPUs, offload "
            f"{'on ' if offload else 'off'}: device peak {m.peak / GIB:6.2f} GiB ({m.peak_phase}), host "
            f"{m.host / GIB:5.2f} GiB  [{time.perf_counter() - start:.0f}s]")
    fb = {k: m.peak_forward_backward / GIB for k, m in points.items()}
    opt = {k: m.peak_optimizer_step / GIB for k, m in points.items()}
    slope_off = (fb[T_LARGE, 64, False] - fb[T_SMALL, 64, False]) / (T_LARGE - T_SMALL)
    fixed = {g: fb[T_SMALL, g, False] - slope_off * T_SMALL for g in (8, 64)}
    b = (fixed[8] - fixed[64]) / (1 / 8 - 1 / 64)
    d = (opt[T_SMALL, 8, False] - opt[T_SMALL, 64, False]) / (1 / 8 - 1 / 64)
    slope_on = (fb[T_LARGE, 64, True] - fixed[64]) / T_LARGE
    return MemoryModel(fixed[64] - b / 64, b, {False: slope_off, True: slope_on},
                       opt[T_SMALL, 64, False] - d / 64, d, points[T_LARGE, 64, True].host / GIB / T_LARGE)


def verify(cfg, model: MemoryModel, gpus: int, offload: bool, usable: float, log) -> tuple[int, float]:
    """The largest power-of-two tokens per rank that fits, MEASURED: the line's candidate is probed directly at
    cp = gpus (the longest sequence) and halved until the probe fits. Returns (tokens, measured GiB), (0, 0) if none.
    The line alone is not enough near the limit: with a chunked loss the peak moves between phases and it was off
    by up to 2.3 GiB."""
    line_limit = int(model.max_tokens_per_rank(gpus, offload, usable))
    tokens = 1 << (line_limit.bit_length() - 1) if line_limit >= 1024 else 0
    while tokens >= 1024:
        m = probe(cfg, tokens, gpus, offload, cp=gpus)
        log(f"  verify {cfg.model.name} {gpus} GPUs, offload {'on ' if offload else 'off'}: {_k(tokens)} tokens/rank "
            f"(cp {gpus}): line {model.peak(tokens, gpus, offload):.2f} GiB, measured {m.peak / GIB:.2f} GiB")
        if m.peak / GIB <= usable:
            return tokens, m.peak / GIB
        tokens //= 2
    return 0, 0.0


def smallest_cp(model: MemoryModel, limit: tuple[int, float], seq_len: int, gpus: int, offload: bool):
    """(cp, device GiB, host GiB, measured?) of the smallest power-of-two CP (seq_len splitting into 2*cp zigzag
    chunks) whose tokens per rank are within the verified limit, or None."""
    cp = 1
    while cp <= gpus:
        tokens = seq_len // cp
        if seq_len % (2 * cp) == 0 and tokens <= limit[0]:
            measured = tokens == limit[0]
            peak = limit[1] if measured else model.peak(tokens, gpus, offload)
            return cp, peak, model.host(tokens, offload), measured
        cp *= 2
    return None


def _k(tokens: float) -> str:
    if tokens >= 2**20:
        return f"{tokens / 2**20:.2f}".rstrip("0").rstrip(".") + "M"
    return f"{tokens / 1024:.0f}K"


def print_table(name: str, model: MemoryModel, limits: dict, usable: float) -> None:
    """One markdown table per model."""
    columns = [(g, off) for g in GPUS for off in (False, True)]
    print(f"\n{name}: smallest CP (device GiB per rank / host GiB per rank; * = measured at cp = GPUs, else the "
          f"line), bf16, full AC, one sequence per data-parallel rank, {usable:g} GiB usable per GPU")
    print("| seq len | " + " | ".join(f"{g} GPUs{' + offload' if off else ''}" for g, off in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    longest = {}
    for seq_len in SEQ_LENS:
        cells = []
        for gpus, off in columns:
            plan = smallest_cp(model, limits[gpus, off], seq_len, gpus, off)
            if plan is None:
                cells.append("-")
                continue
            longest[gpus, off] = seq_len
            star = "*" if plan[3] else ""
            cells.append(f"cp {plan[0]} ({plan[1]:.1f}{star}" + (f" / {plan[2]:.1f})" if off else ")"))
        print(f"| {_k(seq_len)} | " + " | ".join(cells) + " |")
    print("| **longest** | " + " | ".join(_k(longest[c]) if c in longest else "none" for c in columns) + " |")
    print("| tokens per rank (measured) | " + " | ".join(_k(limits[c][0]) if limits[c][0] else "-" for c in columns)
          + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/llama3_8b_1m.toml")
    parser.add_argument("--models", default="llama3_8b,llama3_70b")
    args = parser.parse_args()
    start = time.perf_counter()
    log = lambda line: print(line, flush=True)  # noqa: E731
    for name in args.models.split(","):
        cfg = load_config(args.recipe, ["--model.name", name])
        usable = cfg.hardware.device_memory_gib - RUNTIME_RESERVE_GIB
        model = fit(cfg, log)
        limits = {(g, off): verify(cfg, model, g, off, usable, log) for g in GPUS for off in (False, True)}
        print_table(name, model, limits, usable)
    print(f"\n({time.perf_counter() - start:.0f}s; probes on a fake process group, see the module docstring)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
