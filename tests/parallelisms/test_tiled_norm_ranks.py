"""The memory changes of the frontier against the path without them, on real gloo ranks, fp32: the tiled norms
(model.norm_chunk_tokens, with the tiled SwiGLU on in both runs) and CP attention in K/V head groups
(parallelism.attention_head_groups, GQA: 16 query / 4 K/V heads, 2 per TP rank): the same loss on every rank and every
parameter's full gradient within 1e-6, on cp2 x tp2 (sequence-parallel norms on DTensors) and on cp2 with document
masking and the documents layout."""
from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 64
LAYOUTS = {
    "cp2 x tp2": (["--parallelism.cp", "2", "--parallelism.tp", "2", "--parallelism.dp_shard", "1"], 4),
    "cp2 documents": (["--parallelism.cp", "2", "--parallelism.dp_shard", "1", "--data.document_masking", "true",
                       "--parallelism.cp_load_balancer", "documents"], 2),
}


def _batch(vocab: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (1, SEQ), generator=gen)
    docs = torch.tensor([0] * 20 + [1] * 30 + [2] * 14).view(1, SEQ)  # three documents in the row
    starts = torch.tensor([0, 20, 50])
    positions = torch.arange(SEQ) - starts[docs[0]]
    return {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": positions.view(1, SEQ).clone(),
            "document_ids": docs}


# (what the run without the change sets, what the run with it sets): model and parallelism fields
CHANGES = {
    "tiled norms": ({"norm_chunk_tokens": 0}, {"norm_chunk_tokens": 5}),
    "attention head groups": ({"attention_head_groups": 1}, {"attention_head_groups": 2}),
}


def _loss_and_grads(rank, world, overrides, change):
    import dataclasses

    from config.recipe import load_config
    from models.llama import recipe_model_config
    from parallelisms.context_parallel import CommStats
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.parallelize import uses_loss_parallel
    from training import step
    from training.build import build_model

    cfg = load_config(os.path.join(ROOT, "recipes", "debug.toml"),
                      ["--model.n_layers", "2", "--training.seq_len", str(SEQ), "--training.local_batch_size", "1",
                       "--model.mlp_chunk_tokens", "12", "--model.n_kv_heads", "4", *overrides])
    p = cfg.parallelism
    mesh = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, world).build_mesh("cpu")
    out = {}
    for which, fields in enumerate(CHANGES[change]):
        mcfg = recipe_model_config(cfg)
        mcfg = dataclasses.replace(mcfg, **{k: v for k, v in fields.items() if hasattr(mcfg, k)})
        p = dataclasses.replace(cfg.parallelism, **{k: v for k, v in fields.items() if hasattr(p, k)})
        (model,) = build_model(cfg, mcfg, mesh, torch.device("cpu")).parts
        setup = step.StepSetup(model, mesh, p, document_masking=cfg.data.document_masking,
                               loss_parallel=uses_loss_parallel(cfg, mesh), stats=CommStats(), loss_chunk_tokens=16)
        loss = step.micro_step(setup, _batch(mcfg.vocab_size), SEQ)
        grads = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
                 for n, g in ((n, prm.grad) for n, prm in model.named_parameters())}
        out[which] = (loss.item(), grads)
    (ref_loss, ref), (loss, grads) = out[0], out[1]
    errors = {n: ((grads[n].double() - g.double()).norm() / g.double().norm()).item() for n, g in ref.items()}
    return abs(loss - ref_loss) / abs(ref_loss), errors


@pytest.mark.timeout(240)
@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_memory_changes_change_no_loss_and_no_gradient(layout, change):
    overrides, world = LAYOUTS[layout]
    for loss_error, grad_errors in run_ranks(_loss_and_grads, world, args=(overrides, change), timeout=200):
        assert loss_error <= 1e-6 and max(grad_errors.values()) <= 1e-6, (loss_error, grad_errors)
        assert len(grad_errors) == 2 * 9 + 3  # every parameter of the 2-block model (untied output) compared
