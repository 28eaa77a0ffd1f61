"""Passkey retrieval evaluation: accuracy by key depth x context length, run on the training mesh (CP included).

A sample counts as retrieved when the model's argmax at every answer position is the key's digit (teacher forcing;
when all argmaxes are right, greedy decoding writes exactly the key). Evaluation rows use their own seed, so they
are never training rows.
"""
from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import torch

from config.schema import Config
from data.passkey import IGNORE_INDEX, PasskeyRows
from parallelisms.context_parallel import unshard_sequence
from training.step import StepSetup, cp_context

EVAL_SEED_OFFSET = 1_000_003


def _full_predictions(logits: torch.Tensor, cp_mesh, cp_size: int, load_balancer: str) -> torch.Tensor:
    if hasattr(logits, "full_tensor"):  # tensor-parallel logits are sharded over the vocabulary
        logits = logits.full_tensor()
    predictions = logits.argmax(dim=-1)
    if cp_size > 1:
        predictions = unshard_sequence(predictions.contiguous(), 1, cp_mesh, load_balancer=load_balancer)
    return predictions


@torch.no_grad()
def passkey_accuracy(model, rows: PasskeyRows, indices: list[int], device: torch.device, cp_context, cp_mesh,
                     cp_size: int, load_balancer: str, batch_size: int = 8) -> float:
    """Fraction of rows `indices` whose key the model retrieves. `cp_context(batch)` shards the batch like training."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(indices), batch_size):
        fields = [rows.row_fields(i) for i in indices[start:start + batch_size]]
        batch = {k: torch.from_numpy(np.stack([f[k] for f in fields])).to(device) for k in fields[0]}
        labels = batch["labels"].clone()
        with cp_context(batch) if cp_context else contextlib.nullcontext():
            logits = model(batch["input_ids"], batch["position_ids"])
        predictions = _full_predictions(logits, cp_mesh, cp_size, load_balancer)
        answer = labels != IGNORE_INDEX
        hits = ((predictions == labels) | ~answer).all(dim=1)
        correct += int(hits.sum())
    model.train(was_training)
    return correct / len(indices)


def evaluate_passkey(model, tokenizer, filler_documents: list[str] | None, *, context_lengths: list[int],
                     depths: list[float], samples: int, seed: int, device: torch.device, cp_context=None,
                     cp_mesh=None, cp_size: int = 1, load_balancer: str = "zigzag") -> dict[tuple[int, float], float]:
    """{(context length, depth): accuracy} over `samples` rows each."""
    results = {}
    for length in context_lengths:
        for depth in depths:
            rows = PasskeyRows(tokenizer, filler_documents, seq_len=length, seed=seed + EVAL_SEED_OFFSET, depth=depth)
            results[(length, depth)] = passkey_accuracy(model, rows, list(range(samples)), device, cp_context,
                                                        cp_mesh, cp_size, load_balancer)
    return results


def format_passkey_table(results: dict[tuple[int, float], float]) -> str:
    lengths = sorted({length for length, _ in results})
    depths = sorted({depth for _, depth in results})
    lines = ["passkey accuracy (rows: key depth; columns: context length)",
             "depth  " + "".join(f"{length:>9}" for length in lengths)]
    for depth in depths:
        lines.append(f"{depth:5.2f}  " + "".join(f"{100 * results[(length, depth)]:>8.0f}%" for length in lengths))
    overall = sum(results.values()) / len(results)
    lines.append(f"mean   {100 * overall:.1f}%")
    return "\n".join(lines)


def run_passkey_eval(cfg: Config, setup: StepSetup, tokenizer, device: torch.device, is_writer: bool) -> None:
    """Passkey retrieval by depth x context length on the training mesh, sharded by the training step's own CP
    context; rank 0 prints the table and saves <dump_folder>/passkey_eval.json."""
    e, p = cfg.eval, cfg.parallelism
    depths = [i / max(1, e.passkey_depths - 1) for i in range(e.passkey_depths)]
    results = evaluate_passkey(
        setup.model, tokenizer, None, context_lengths=e.passkey_lengths or [cfg.training.seq_len], depths=depths,
        samples=e.passkey_samples, seed=cfg.job.seed, device=device,
        cp_context=(lambda batch: cp_context(setup, batch)) if setup.shards_sequence else None,
        cp_mesh=setup.mesh.cp_mesh, cp_size=p.cp, load_balancer=p.cp_load_balancer)
    if is_writer:
        print(format_passkey_table(results), flush=True)
        with open(os.path.join(cfg.job.dump_folder, "passkey_eval.json"), "w") as f:
            json.dump([{"context_length": n, "depth": d, "accuracy": a} for (n, d), a in results.items()], f)
