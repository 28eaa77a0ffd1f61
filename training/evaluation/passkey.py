"""Passkey retrieval evaluation: accuracy by key depth x context length, run on the training mesh (CP included).

A sample counts as retrieved when the model's argmax at every answer position is the key's digit (teacher forcing;
when all argmaxes are right, greedy decoding writes exactly the key). Evaluation rows use their own seed, so they
are never training rows.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from config.schema import Config
from data.passkey import IGNORE_INDEX, PasskeyRows
from data.sources import heldout_rows
from training.checkpoint_files import write_json_atomically
from training.evaluation.rows import (DEFAULT_EVAL_CHUNK_TOKENS, eval_chunk_tokens, eval_spread, padded_batch,
                                 rank_batches, score_tokens)
from training.step import StepSetup, cp_context

EVAL_SEED_OFFSET = 1_000_003


@torch.no_grad()
def passkey_accuracy(model, rows: PasskeyRows, indices: list[int], device: torch.device, cp_context, cp_mesh,
                     cp_size: int, load_balancer: str, batch_size: int = 8, **spread) -> float:
    """Fraction of rows `indices` whose key the model retrieves. `cp_context(batch)` shards the batch like training;
    `spread` as in `answer_hits`."""
    return answer_hits(model, rows, indices, device, cp_context, cp_mesh, cp_size, load_balancer, batch_size,
                       **spread)[0]


@torch.no_grad()
def answer_hits(model, rows, indices: list[int], device: torch.device, cp_context, cp_mesh, cp_size: int,
                load_balancer: str, batch_size: int = 8, *, chunk_tokens: int = DEFAULT_EVAL_CHUNK_TOKENS,
                dp_rank: int = 0, dp_size: int = 1, reduce_sums=None) -> tuple[float, float]:
    """(fraction of rows whose every answer token is the argmax, fraction of answer tokens that are).

    The rows are split over the `dp_size` data-parallel ranks and padded (training/evaluation/rows.py), so every rank runs
    the same forwards; `reduce_sums(list)` sums the counts over those ranks. The argmax comes from the hidden states,
    `chunk_tokens` answer tokens at a time (never the whole logits)."""
    was_training = model.training
    model.eval()
    correct, tokens_right, tokens = 0, 0, 0
    for batch_rows in rank_batches(len(indices), dp_rank, dp_size, batch_size):
        batch, real = padded_batch(lambda i: rows.row_fields(indices[i]), batch_rows, device)
        labels = batch["labels"].clone()
        full_ids = batch["document_ids"].clone() if "document_ids" in batch else None  # the documents layout's plan
        _, predictions = score_tokens(model, batch, chunk_tokens, sparse_labels=True, cp_context=cp_context,
                                      cp_mesh=cp_mesh, cp_size=cp_size, load_balancer=load_balancer,
                                      document_ids=full_ids)
        answer = labels != IGNORE_INDEX
        hits = ((predictions == labels) | ~answer).all(dim=1) & real
        correct += int(hits.sum())
        tokens_right += int(((predictions == labels) & answer).sum())
        tokens += int(answer.sum())
    model.train(was_training)
    if reduce_sums is not None:
        correct, tokens_right, tokens = reduce_sums([correct, tokens_right, tokens])
    return correct / len(indices), tokens_right / max(tokens, 1)


def evaluate_passkey(model, tokenizer, filler_documents: list[str] | None, *, context_lengths: list[int],
                     depths: list[float], samples: int, seed: int, device: torch.device, cp_context=None,
                     cp_mesh=None, cp_size: int = 1, load_balancer: str = "zigzag", batch_size: int = 8,
                     **spread) -> dict[tuple[int, float], float]:
    """{(context length, depth): accuracy} over `samples` rows each; `spread` as in `answer_hits`."""
    results = {}
    for length in context_lengths:
        for depth in depths:
            rows = PasskeyRows(tokenizer, filler_documents, seq_len=length, seed=seed + EVAL_SEED_OFFSET, depth=depth)
            results[(length, depth)] = passkey_accuracy(model, rows, list(range(samples)), device, cp_context,
                                                        cp_mesh, cp_size, load_balancer, batch_size, **spread)
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


def position_buckets(seq_len: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of position-in-document, growing 4x and ending at seq_len (e.g. 0-512, 512-2K, 2K-8K)."""
    edges = {0, seq_len} | {seq_len // 4 ** k for k in range(1, 16) if seq_len // 4 ** k >= 64}
    edges = sorted(edges)
    return list(zip(edges, edges[1:]))


def bucket_name(lo: int, hi: int) -> str:
    def short(n: int) -> str:
        return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
    return f"{short(lo)}-{short(hi)}"


def positions_in_document(document_ids: np.ndarray) -> np.ndarray:
    """Each token's position inside its own document (0 at a row's start and after each EOS)."""
    starts = np.flatnonzero(np.concatenate(([True], document_ids[1:] != document_ids[:-1])))
    run = np.searchsorted(starts, np.arange(len(document_ids)), side="right") - 1
    return np.arange(len(document_ids)) - starts[run]


@torch.no_grad()
def long_document_loss(model, sources: list, rows: int, *, device: torch.device, dp_rank: int, dp_size: int,
                       reduce_sums, cp_context=None, cp_mesh=None, cp_size: int = 1, load_balancer: str = "zigzag",
                       chunk_tokens: int = DEFAULT_EVAL_CHUNK_TOKENS) -> dict[str, float]:
    """Mean loss per position bucket over `rows` held-out rows (taken from `sources` in turn, split over the dp ranks
    with padding, one row per forward: ceil(rows / dp) forwards on every rank). `reduce_sums(list)` sums a list of
    numbers over the data-parallel ranks. Per-token losses come from the hidden states `chunk_tokens` at a time."""
    was_training = model.training
    model.eval()
    seq_len = sources[0].seq_len
    buckets = position_buckets(seq_len)
    sums, counts = np.zeros(len(buckets)), np.zeros(len(buckets))

    def row_fields(index: int) -> dict:
        packed = sources[index % len(sources)]
        return packed.row_fields((index // len(sources)) % packed.num_rows)

    for positions in rank_batches(rows, dp_rank, dp_size, 1):
        batch, _ = padded_batch(row_fields, positions, device)
        full_ids = batch["document_ids"].clone()
        in_document = positions_in_document(full_ids[0].cpu().numpy())
        valid = batch["labels"][0].cpu().numpy() != IGNORE_INDEX  # padding rows: nothing valid
        token_loss, _ = score_tokens(model, batch, chunk_tokens, sparse_labels=False, cp_context=cp_context,
                                     cp_mesh=cp_mesh, cp_size=cp_size, load_balancer=load_balancer,
                                     document_ids=full_ids.cpu())
        token_loss = token_loss[0].double().cpu().numpy()
        for b, (lo, hi) in enumerate(buckets):
            chosen = valid & (in_document >= lo) & (in_document < hi)
            sums[b] += token_loss[chosen].sum()
            counts[b] += chosen.sum()
    model.train(was_training)
    totals = reduce_sums(list(sums) + list(counts))
    sums, counts = totals[:len(buckets)], totals[len(buckets):]
    return {bucket_name(lo, hi): float(s / c) for (lo, hi), s, c in zip(buckets, sums, counts) if c > 0}


def passkey_stop_reached(e, results: dict) -> bool:
    """Whether an evaluation's {(length, depth): accuracy} ends the run: every cell at eval.passkey_stop_at or better
    and the mean at eval.passkey_stop_mean or better (a 0 leaves its condition out; both 0 never stop)."""
    if not (e.passkey_stop_at > 0 or e.passkey_stop_mean > 0):
        return False
    return min(results.values()) >= e.passkey_stop_at and sum(results.values()) / len(results) >= e.passkey_stop_mean


def passkey_stop_rule(e) -> str:
    """What eval.passkey_stop_at (a floor per cell) and passkey_stop_mean (the mean over cells) ask, in words."""
    parts = []
    if e.passkey_stop_mean > 0:
        parts.append(f"mean >= {e.passkey_stop_mean:g}")
    if e.passkey_stop_at > 0:
        parts.append(f">= {e.passkey_stop_at:g} in every cell")
    return " with ".join(parts)


def run_passkey_eval(cfg: Config, setup: StepSetup, tokenizer, device: torch.device, is_writer: bool,
                     comm=None) -> dict[tuple[int, float], float]:
    """Passkey retrieval by depth x context length on the training mesh, sharded by the training step's own CP
    context; rank 0 prints the table and saves <dump_folder>/passkey_eval.json. Returns {(length, depth): accuracy},
    the same on every rank."""
    e, p = cfg.eval, cfg.parallelism
    depths = [i / max(1, e.passkey_depths - 1) for i in range(e.passkey_depths)]
    results = evaluate_passkey(
        setup.model, tokenizer, None, context_lengths=e.passkey_lengths or [cfg.training.seq_len], depths=depths,
        samples=e.passkey_samples, seed=cfg.job.seed, device=device,
        cp_context=(lambda batch: cp_context(setup, batch)) if setup.shards_sequence else None,
        cp_mesh=setup.mesh.cp_mesh, cp_size=p.cp, load_balancer=p.cp_load_balancer,
        batch_size=cfg.training.local_batch_size, **eval_spread(setup, comm))
    if is_writer:
        print(format_passkey_table(results), flush=True)
        write_json_atomically(os.path.join(cfg.job.dump_folder, "passkey_eval.json"),
                              [{"context_length": n, "depth": d, "accuracy": a} for (n, d), a in results.items()])
    return results


def run_long_doc_eval(cfg: Config, setup: StepSetup, stores: dict, device: torch.device, comm, is_writer: bool) -> dict:
    """Loss by position bucket on the stores' held-out documents, sharded by the training step's own CP context;
    returns {"long_doc_loss": {bucket: loss}} for the step's metrics record."""
    p, data_group = cfg.parallelism, setup.mesh.data.get_group()
    result = long_document_loss(
        setup.model, heldout_rows(cfg, stores), cfg.eval.long_doc_rows, device=device, dp_rank=setup.mesh.dp_rank,
        dp_size=setup.mesh.dims.dp, reduce_sums=lambda values: comm.reduce_values(values, group=data_group),
        cp_context=(lambda batch: cp_context(setup, batch)) if setup.shards_sequence else None,
        cp_mesh=setup.mesh.cp_mesh, cp_size=p.cp, load_balancer=p.cp_load_balancer,
        chunk_tokens=eval_chunk_tokens(setup.loss_chunk_tokens))
    if is_writer:
        print("long-document loss by position: " + "  ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)
    return {"long_doc_loss": result}
