"""The loss reference every parity test compares the trainer with: one plain single-process run, fp32, same data.

The reference is independent of the parallel code: a plain `Llama` (no FSDP / TP / PP / CP wrappers) initialised
from the same seed, fed the same global batch rows (the loader with one data-parallel rank), full-sequence attention,
mean cross entropy, AdamW, the same lr schedule and global-norm clipping. `trainer_run` runs the real trainer
(train.main on every rank, forked by harness/forked_launch.py with torchrun's environment: one interpreter start
instead of one per rank) and returns its metrics.jsonl, to be compared step by step. bench/loss_parity.py prints the
comparison for every mesh of `MESHES`.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import sys
import tempfile

from harness.launch_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "debug.toml")
GLOBAL_BATCH = 4

# name -> degrees (dp_shard explicit) and extra overrides; the acceptance lists of issues 4 and 14.
MESHES: dict[str, dict] = {
    "1 rank": dict(dp_shard=1),
    "dp_shard2": dict(dp_shard=2),
    "dp_replicate2": dict(dp_replicate=2, dp_shard=1),
    "dp_replicate2 x dp_shard2": dict(dp_replicate=2, dp_shard=2),  # 2-D HSDP
    "dp_replicate2 x dp_shard2 x cp2": dict(dp_replicate=2, dp_shard=2, cp=2),  # HSDP, each replica FSDP over dp_shard x cp
    "tp2": dict(tp=2, dp_shard=1),
    "cp2": dict(cp=2, dp_shard=1),
    "pp2": dict(pp=2, dp_shard=1),
    "dp_shard2 x cp2": dict(dp_shard=2, cp=2),
    "cp2 x tp2": dict(cp=2, tp=2, dp_shard=1),
    "pp2 x cp2": dict(pp=2, cp=2, dp_shard=1),
    "pp2 x tp2": dict(pp=2, tp=2, dp_shard=1),
    "pp2 x dp_shard2 x cp2 x tp2": dict(pp=2, dp_shard=2, cp=2, tp=2),
}
DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def world_size(degrees: dict) -> int:
    return math.prod(degrees.get(d, 1) for d in DEGREES)


def reference_run(steps: int, seq_len: int, global_batch: int = GLOBAL_BATCH, recipe: str = RECIPE,
                  dtype: str = "float32", document_masking: bool = False, hf_load_path: str = "",
                  n_layers: int = 0) -> list[dict]:
    """The single-process run: [{"loss", "grad_norm"}] per step. dtype "bfloat16" is FSDP2's mixed-precision policy
    written out by hand: float32 master weights and optimizer, each step's forward and backward on a bfloat16 copy of
    them, its gradients cast to float32 (reduce_dtype) before clipping and the update. With `document_masking` the
    loader packs rows the same way, and every document of a row runs alone through the model, unmasked and from
    position 0 (records then also count the documents of each step's rows). With `hf_load_path` the model is that
    Hugging Face folder, loaded whole by models.hf.load_hf (the trainer's `[model] name = "hf"` counterpart).
    `n_layers` (0 = the recipe's) is the trainer's `--model.n_layers`. A run is a pure function of its arguments, so a
    test process trains each distinct one once (the tests of a file and their parametrizations share it)."""
    return copy.deepcopy(_reference_run_once(steps, seq_len, global_batch, recipe, dtype, document_masking,
                                             hf_load_path, n_layers))


@functools.lru_cache(maxsize=None)
def _reference_run_once(steps: int, seq_len: int, global_batch: int, recipe: str, dtype: str, document_masking: bool,
                        hf_load_path: str, n_layers: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from data.corpus import load_documents
    from data.loader import build_dataloader
    from data.tokenizer import build_tokenizer
    from config.recipe import load_config
    from training.lr_schedule import build_lr_scheduler

    cfg = load_config(recipe, ["--training.seq_len", str(seq_len), "--training.steps", str(steps)])
    model = _reference_model(cfg, hf_load_path, n_layers)
    model_cfg = model.config
    documents = load_documents(cfg.data.corpus)
    cache_dir = os.path.join(ROOT, cfg.data.cache_dir) if not os.path.isabs(cfg.data.cache_dir) else cfg.data.cache_dir
    tokenizer = build_tokenizer(None, documents, model_cfg.vocab_size, cache_dir)
    loader = build_dataloader(tokenizer, documents, seq_len=seq_len, local_batch_size=global_batch, dp_rank=0,
                              dp_size=1, seed=cfg.job.seed, document_masking=document_masking)
    o, s = cfg.optimizer, cfg.lr_scheduler
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, foreach=True)
    scheduler = build_lr_scheduler(optimizer, s.warmup_steps, steps, s.decay_type, s.min_lr_ratio)
    records, batches = [], iter(loader)
    for _ in range(steps):
        batch = next(batches)
        compute = model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))
        with _HalfGemmsInFloat32() if dtype != "float32" else contextlib.nullcontext():
            logits = _documents_one_by_one(compute, batch) if document_masking else compute(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        if compute is not model:
            for master, low in zip(model.parameters(), compute.parameters()):
                master.grad = low.grad.float()
        grads = [p.grad.double() for p in model.parameters()]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))  # float64: a float32 norm is off by ~1e-5
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.training.max_norm, norm.float())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        records.append({"loss": loss.item(), "grad_norm": norm.item()})
        if document_masking:
            records[-1]["documents"] = int(sum(row.unique().numel() for row in batch["document_ids"]))
    return records


def _reference_model(cfg, hf_load_path: str, n_layers: int = 0):
    """The recipe's model from its seed (`n_layers` blocks where set), or the Hugging Face folder loaded whole
    (models.hf.load_hf)."""
    from models.llama import Llama, model_config

    if hf_load_path:
        from models.hf import load_hf

        return load_hf(hf_load_path)
    model = Llama(model_config(cfg.model.name, **({"n_layers": n_layers} if n_layers else {})))
    model.init_weights(cfg.job.seed)
    return model


class _HalfGemmsInFloat32:
    """The reference's half-precision linear layers as float32 products rounded once to the half dtype (forward and,
    through the casts, backward): what a bf16 GEMM computes (float32 accumulation, one rounding of the output), up to
    the order of the sums. Written here, not taken from models/cpu_half_gemm.py, so the reference stays independent
    of the trainer's code. Why: on a CPU without AVX-512, torch's own bf16 GEMM is a portable loop ~30x slower than
    float32 (docs/testing.md); the bf16 reference took 36 CPU seconds for 5 steps of the debug model, 7 this way."""

    def __enter__(self):
        import torch
        import torch.nn.functional as F

        class Mode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is F.linear and args[0].dtype in (torch.bfloat16, torch.float16):
                    x, weight, *rest = args
                    bias = rest[0] if rest else kwargs.get("bias")
                    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
                    return out.to(x.dtype)
                return func(*args, **kwargs)

        self._mode = Mode()
        return self._mode.__enter__()

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _documents_one_by_one(model, batch: dict):
    """Logits of packed rows with each document computed alone (its own sequence, default positions 0..n-1)."""
    import torch

    rows = []
    for ids, docs, positions in zip(batch["input_ids"], batch["document_ids"], batch["position_ids"]):
        pieces = []
        for doc in docs.unique():
            span = (docs == doc).nonzero().flatten()
            assert torch.equal(positions[span], torch.arange(span.numel())), "positions must restart per document"
            pieces.append(model(ids[span].unsqueeze(0))[0])
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


def trainer_run(degrees: dict, steps: int, seq_len: int, extra: list[str] = (), global_batch: int = GLOBAL_BATCH,
                timeout: float = 600, recipe: str = RECIPE, dtype: str = "float32") -> list[dict]:
    """The real trainer on world_size(degrees) local ranks (forked_launch.py); returns its metrics.jsonl records.
    A run is a pure function of its arguments (seeded data and weights), so a test process runs each distinct one
    once: the one-process references several tests of a file compare with (CI hands a file to one worker) are
    shared instead of trained again."""
    records = _trainer_run_once(tuple(sorted(degrees.items())), steps, seq_len, tuple(extra), global_batch, timeout,
                                recipe, dtype)
    return copy.deepcopy(records)


@functools.lru_cache(maxsize=None)
def _trainer_run_once(degree_items: tuple, steps: int, seq_len: int, extra: tuple, global_batch: int, timeout: float,
                      recipe: str, dtype: str) -> list[dict]:
    degrees = dict(degree_items)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.distributed import forked_train

    nproc = world_size(degrees)
    dp = degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1)
    overrides = [f"--parallelism.{d}={degrees.get(d, 1)}" for d in DEGREES]
    with tempfile.TemporaryDirectory() as out:
        train_args = [
            recipe, *overrides, "--training.steps", str(steps), "--training.seq_len", str(seq_len),
            "--training.local_batch_size", str(global_batch // dp), "--training.dtype", dtype, "--job.dump_folder", out,
            "--metrics.enable_tensorboard", "false", *extra]
        result = forked_train(nproc, train_args, child_env(OMP_NUM_THREADS="1"), ROOT, timeout)
        if result.returncode != 0:  # the ranks' own error lines first, then the launcher's tail
            causes = [line for line in result.stderr.splitlines() if line.startswith("[rank") and "Error" in line]
            raise RuntimeError(f"trainer on {degrees} {' '.join(extra)} failed ({result.returncode}):\n"
                               + "\n".join(dict.fromkeys(causes)) + f"\n{result.stderr[-3000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


def max_relative_error(reference: list[dict], records: list[dict], key: str) -> float:
    assert len(reference) == len(records), (len(reference), len(records))
    return max(abs(r[key] - ref[key]) / abs(ref[key]) for ref, r in zip(reference, records))
