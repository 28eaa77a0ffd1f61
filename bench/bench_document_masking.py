"""Document masking on vs off in real training steps, side by side in one run (issue 15, acceptance 6).

The debug model on 1 rank at seq 8192, trained on the pydoc documents (~1.5K tokens each, so most causal pairs of a
packed row cross documents): the real trainer (train.py under torch.distributed.run) runs the same rows with
`data.document_masking` false and true. Printed:
- step time masked / unmasked: the summed times of the steps after the warm-up ones (forward, backward and
  optimizer; the same rows on both sides), so rows of one long document and rows of many short ones weigh as their
  work does (a median would pick one kind of row while the pair count below sums all of them),
- visible / causal pairs of those steps' rows, counted from their document ids (sum of L(L+1)/2 over documents vs
  S(S+1)/2 per row): the fraction of the attention work masking leaves,
- peak memory masked / unmasked: the trainer's own `memory` metric (peak RSS of each process on CPU, peak allocated
  on CUDA), the same accounting on both sides.
Targets: time ratio <= visible/causal + 0.15 (attention is most, not all, of a step), memory ratio <= 1.05.

    python bench/bench_document_masking.py [--steps 10] [--warmup 2] [--rounds 2] [--seq-len 8192] [--compile]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/bench_document_masking.py` puts bench/ first on the path, not the root
    sys.path.insert(0, ROOT)

from harness.launch_env import child_env  # noqa: E402
from training.metrics import read_metrics  # noqa: E402

RECIPE = os.path.join(ROOT, "recipes", "debug.toml")


def common_overrides(steps: int, seq_len: int, dtype: str, compile: bool) -> list[str]:
    return ["--training.steps", str(steps), "--training.seq_len", str(seq_len), "--training.local_batch_size", "1",
            "--training.dtype", dtype, "--parallelism.dp_shard", "1", "--metrics.enable_tensorboard", "false",
            "--training.compile", "true" if compile else "false"]


def run_trainer(masking: bool, overrides: list[str]) -> list[dict]:
    """The trainer on 1 rank; its metrics.jsonl records."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.join(ROOT, "train.py"), RECIPE, *overrides, "--job.dump_folder", out,
               "--data.document_masking", "true" if masking else "false"]
        env = child_env()
        env.pop("OMP_NUM_THREADS", None)  # the trainer sizes its threads itself
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        return read_metrics(out)


def pair_ratio(overrides: list[str], steps: int, warmup: int) -> tuple[float, float]:
    """(visible / causal pairs, mean tokens per document) of the rows of the measured steps, from the loader the
    trainer's rows are checked against (tests/loss_reference.py's reference: same packing, same order)."""
    import torch

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from config.recipe import load_config
    from data.corpus import load_documents
    from data.loader import build_dataloader
    from data.tokenizer import build_tokenizer
    from models.llama import model_config

    cfg = load_config(RECIPE, overrides)
    documents = load_documents(cfg.data.corpus)
    cache_dir = cfg.data.cache_dir if os.path.isabs(cfg.data.cache_dir) else os.path.join(ROOT, cfg.data.cache_dir)
    tokenizer = build_tokenizer(None, documents, model_config(cfg.model.name).vocab_size, cache_dir)
    loader = build_dataloader(tokenizer, documents, seq_len=cfg.training.seq_len, local_batch_size=1, dp_rank=0,
                              dp_size=1, seed=cfg.job.seed, document_masking=True)
    visible = causal = docs = 0
    for step, batch in zip(range(steps), loader):
        if step < warmup:
            continue
        for row in batch["document_ids"]:
            lengths = torch.unique_consecutive(row, return_counts=True)[1].double()
            visible += float((lengths * (lengths + 1) / 2).sum())
            causal += row.numel() * (row.numel() + 1) / 2
            docs += lengths.numel()
    return visible / causal, (steps - warmup) * cfg.training.seq_len / docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the sums")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2, help="trainer runs per side, in alternating order")
    parser.add_argument("--compile", action="store_true", help="training.compile on both sides (the blocks compiled, "
                        "attention eager between the graphs); compiling happens in the warm-up steps")
    args = parser.parse_args()
    overrides = common_overrides(args.steps, args.seq_len, args.dtype, args.compile)
    # Rounds alternate their order (off, on, then on, off, ...) so a box whose speed drifts during the bench (a
    # shared VM's does, by 10-20% over minutes) weighs on both sides alike; each round's own ratio shows the spread.
    runs, round_ratios = {False: [], True: []}, []
    for i in range(args.rounds):
        times = {}
        for masking in (False, True) if i % 2 == 0 else (True, False):
            records = run_trainer(masking, overrides)
            runs[masking].append(records)
            times[masking] = statistics.fmean(r["step_time"] for r in records[args.warmup:])
        round_ratios.append(times[True] / times[False])
    step = {m: statistics.fmean(r["step_time"] for records in rs for r in records[args.warmup:])
            for m, rs in runs.items()}
    memory = {m: max(r["memory"] for records in rs for r in records) for m, rs in runs.items()}
    visible, doc_tokens = pair_ratio(overrides, args.steps, args.warmup)
    print(f"debug model, 1 rank, seq {args.seq_len}, local batch 1, {args.dtype}, pydoc documents "
          f"(~{doc_tokens:,.0f} tokens each), {os.cpu_count()} cores, mean of steps {args.warmup + 1}-{args.steps} "
          f"over {args.rounds} round(s){', compiled' if args.compile else ''}")
    print(f"{'document masking':>17} {'step s':>8} {'tok/s':>8} {'peak GiB':>9}")
    for m in (False, True):
        print(f"{'on' if m else 'off':>17} {step[m]:>8.2f} {args.seq_len / step[m]:>8.0f} {memory[m]:>9.2f}")
    time_ratio, memory_ratio = step[True] / step[False], memory[True] / memory[False]
    print(f"step time masked / unmasked: {time_ratio:.3f}   (target <= visible/causal + 0.15 = {visible + 0.15:.3f}; "
          f"per round {', '.join(f'{r:.3f}' for r in round_ratios)})")
    print(f"visible / causal pairs:      {visible:.3f}")
    print(f"peak memory masked / unmasked: {memory_ratio:.3f}   (target <= 1.05)")


if __name__ == "__main__":
    main()
