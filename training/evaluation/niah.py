"""Needle-in-a-haystack evaluation on the training mesh: rows of data/niah.py at each (context length, depth), sharded
by the training step's own CP context and scored like the passkey (greedy argmax at every answer token, exact
match), every `niah_interval` steps and at the end. Rank 0 writes <dump_folder>/niah_eval.json (every evaluation so
far), <dump_folder>/niah_heatmap.png (the latest) and a TensorBoard image (tag niah/heatmap)."""
from __future__ import annotations

import json
import os

import torch

from config.schema import Config
from data.niah import NiahRows
from data.sources import heldout_haystack
from training.evaluation.passkey import EVAL_SEED_OFFSET, answer_hits, format_passkey_table
from training.evaluation.rows import eval_spread
from training.checkpoint_files import write_json_atomically
from training.evaluation.heatmap import log_heatmap_image, write_heatmap
from training.step import StepSetup, cp_context


def check_niah_lengths(cfg: Config, tokenizer) -> None:
    """Every evaluated length fits the needles and the question (a one-line error before any process group)."""
    lengths = cfg.eval.niah_lengths or [cfg.training.seq_len]
    for length in lengths:
        NiahRows(tokenizer, None, seq_len=length, seed=0, depth=0.5, keys=cfg.eval.niah_keys,
                 values=cfg.eval.niah_values)


def niah_eval_lengths(cfg: Config) -> list[int]:
    """The lengths a stage evaluates: those it has reached (the model has not seen longer rows yet)."""
    return [n for n in cfg.eval.niah_lengths if n <= cfg.training.seq_len] or [cfg.training.seq_len]


def niah_depths(count: int) -> list[float]:
    return [i / max(1, count - 1) for i in range(count)]


def evaluate_niah(model, tokenizer, haystack, *, lengths: list[int], depths: list[float], samples: int, seed: int,
                  keys: int, values: int, device, cp_context=None, cp_mesh=None, cp_size: int = 1,
                  load_balancer: str = "zigzag", batch_size: int = 8,
                  **spread) -> dict[tuple[int, float], tuple[float, float]]:
    """{(context length, depth): (exact-answer accuracy, answer-token accuracy)} over `samples` rows each (the same
    rows on every mesh); `spread` splits them over the data-parallel ranks (training.evaluation.passkey.answer_hits)."""
    results = {}
    for length in lengths:
        for depth in depths:
            rows = NiahRows(tokenizer, haystack, seq_len=length, seed=seed + EVAL_SEED_OFFSET, depth=depth,
                            keys=keys, values=values)
            results[(length, depth)] = answer_hits(model, rows, list(range(samples)), device, cp_context,
                                                   cp_mesh, cp_size, load_balancer, batch_size, **spread)
    return results


def variant_name(keys: int, values: int) -> str:
    return "single" if keys == 1 and values == 1 else f"multi-key {keys}" if values == 1 else \
        f"multi-value {values}" + (f", {keys} keys" if keys > 1 else "")


def run_niah_eval(cfg: Config, setup: StepSetup, tokenizer, stores: dict, device: torch.device, is_writer: bool,
                  step: int, comm=None) -> dict[tuple[int, float], tuple[float, float]]:
    e, p = cfg.eval, cfg.parallelism
    lengths = niah_eval_lengths(cfg)
    haystack = heldout_haystack(cfg, stores, 2 * max(lengths)) if stores else None
    results = evaluate_niah(
        setup.model, tokenizer, haystack, lengths=lengths, depths=niah_depths(e.niah_depths), samples=e.niah_samples,
        seed=cfg.job.seed, keys=e.niah_keys, values=e.niah_values, device=device,
        cp_context=(lambda batch: cp_context(setup, batch)) if setup.shards_sequence else None,
        cp_mesh=setup.mesh.cp_mesh, cp_size=p.cp, load_balancer=p.cp_load_balancer,
        batch_size=cfg.training.local_batch_size, **eval_spread(setup, comm))
    if is_writer:
        write_niah_outputs(cfg, results, step, haystack is not None)
    return results


def write_niah_outputs(cfg: Config, results: dict, step: int, own_documents: bool) -> None:
    e, folder = cfg.eval, cfg.job.dump_folder
    variant = variant_name(e.niah_keys, e.niah_values)
    exact = {cell: hits[0] for cell, hits in results.items()}
    print(format_passkey_table(exact).replace("passkey accuracy", f"NIAH ({variant}) at step {step}: accuracy"),
          flush=True)
    path = os.path.join(folder, "niah_eval.json")
    history = []
    if os.path.exists(path):
        with open(path) as f:
            history = [r for r in json.load(f) if r["step"] != step]
    history.append({"step": step, "variant": variant, "keys": e.niah_keys, "values": e.niah_values,
                    "haystack": "held-out documents" if own_documents else "passkey filler",
                    "cells": [{"context_length": n, "depth": d, "accuracy": a, "answer_token_accuracy": t}
                              for (n, d), (a, t) in results.items()]})
    write_json_atomically(path, history)  # read back by the next evaluation: a kill mid-write must not tear it
    title = f"Needle in a haystack ({variant}), step {step}"
    pixels = write_heatmap(exact, title, os.path.join(folder, "niah_heatmap.png"))
    if cfg.metrics.enable_tensorboard:
        log_heatmap_image(os.path.join(folder, "tb"), "niah/heatmap", pixels, step)
