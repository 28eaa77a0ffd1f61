"""Pipeline parallelism: the stage split, the plan's one-line refusals, and every schedule's loss and gradients
against the unsplit model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.llama import Llama, LlamaConfig, canonical_name
from parallelisms.pipeline_parallel import SCHEDULES, PipelinePlan, plan_pipeline, split_layers, stage_module
from tests.distributed import run_ranks
from config import RecipeError

TINY = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, rope_theta=10000.0)
BATCH, SEQ, POSITION_OFFSET = 4, 16, 5


# ---------------------------------------------------------------- the split
@pytest.mark.parametrize("n_layers, stages, per_stage, expected_sizes", [
    (6, 2, 0, [3, 3]),
    (7, 2, 0, [3, 4]),
    (6, 4, 0, [1, 2, 2, 1]),        # spare layers go to the middle: the ends also run embedding / output
    (10, 4, 0, [2, 3, 3, 2]),
    (6, 2, 4, [3, 3]),              # k per stage, the shortfall taken from the first and last stage
    (7, 4, 2, [1, 2, 2, 2]),
    (32, 4, 9, [7, 9, 9, 7]),
    (8, 4, 2, [2, 2, 2, 2]),
])
def test_split_layers(n_layers, stages, per_stage, expected_sizes):
    split = split_layers(n_layers, stages, per_stage)
    assert [len(s) for s in split] == expected_sizes
    assert [i for s in split for i in s] == list(range(n_layers))  # consecutive, each layer once


def test_stage_ranks_loop_and_v():
    loop = PipelinePlan("Interleaved1F1B", 2, ((0,), (1,), (2,), (3,)), 4)
    assert [loop.stages_of_rank(r) for r in range(2)] == [[0, 2], [1, 3]]
    v = PipelinePlan("ZBVZeroBubble", 2, ((0,), (1,), (2,), (3,)), 4)
    assert [v.stages_of_rank(r) for r in range(2)] == [[0, 3], [1, 2]]
    single = PipelinePlan("1F1B", 4, ((0,), (1,), (2,), (3,)), 4)
    assert [single.stages_of_rank(r) for r in range(4)] == [[0], [1], [2], [3]]


def test_stage_module_keeps_only_its_parts():
    with torch.device("meta"):
        model = Llama(LlamaConfig(**TINY))
    first = stage_module(model, [0, 1], True, False)
    middle = stage_module(model, [2], False, False)
    last = stage_module(model, [3], False, True)
    assert list(first.layers) == ["0", "1"] and first.tok_embeddings is not None and first.output is None
    assert list(middle.layers) == ["2"] and middle.tok_embeddings is None and middle.norm is None
    assert list(last.layers) == ["3"] and last.norm is not None and last.output is not None
    assert list(model.layers) == ["0", "1", "2", "3"]  # the full model is untouched


@pytest.mark.parametrize("kwargs, expect", [
    (dict(n_layers=2, pp=4), "n_layers 2 is fewer than the 4 pipeline stages"),
    (dict(n_layers=6, pp=4, schedule="Interleaved1F1B"), "n_layers 6 is fewer than the 8 pipeline stages"),
    (dict(local_batch_size=3, microbatches=2), "local_batch_size 3 cannot be split into parallelism.pp_microbatches 2"),
    (dict(local_batch_size=1), "needs at least pp = 2 microbatches"),
    (dict(schedule="ZBVZeroBubble", layers_per_stage=1), "needs exactly 2 x pp"),
    (dict(schedule="1F1B", layers_per_stage=2), "needs exactly pp"),
    (dict(schedule="Interleaved1F1B", local_batch_size=5), "pp_microbatches 5 to be a multiple of 2"),
])
def test_impossible_pipelines_are_refused(kwargs, expect):
    args = dict(n_layers=6, pp=2, schedule="1F1B", layers_per_stage=0, microbatches=0, local_batch_size=4)
    args.update(kwargs)
    with pytest.raises(RecipeError, match=expect) as info:
        plan_pipeline(**args)
    assert "\n" not in str(info.value)


def test_gpipe_takes_fewer_microbatches_than_stages():
    plan = plan_pipeline(6, 2, "GPipe", 0, 1, 1)
    assert plan.microbatches == 1 and plan.num_stages == 2


# ---------------------------------------------------------------- every schedule vs the unsplit model
def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ + 1), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ) + POSITION_OFFSET  # must reach every stage, not be re-derived
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), positions.contiguous()


def _reference():
    model = Llama(LlamaConfig(**TINY))
    model.init_weights(0)
    inputs, labels, positions = _batch()
    loss = F.cross_entropy(model(inputs, positions).flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.item(), {canonical_name(n): p.grad.clone() for n, p in model.named_parameters()}


def _schedules_body(rank, world_size):
    import torch.distributed as dist

    from parallelisms.pipeline_parallel import build_pipeline

    inputs, labels, positions = _batch()
    tokens = labels.numel()

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / tokens

    def materialize(module):
        module.to_empty(device="cpu")
        module.init_weights(0)

    results = {}
    for schedule in SCHEDULES:
        plan = plan_pipeline(TINY["n_layers"], world_size, schedule, 0, 2 if schedule == "GPipe" else 0, BATCH)
        pipe = build_pipeline(_meta_model(), plan, rank, dist.group.WORLD, torch.device("cpu"),
                              parallelize_stage=lambda m: m, materialize=materialize, loss_fn=loss_fn)
        loss = pipe.step({"input_ids": inputs.clone(), "labels": labels, "position_ids": positions})
        dist.all_reduce(loss)  # only the rank holding the last stage has it
        grads = {canonical_name(n): p.grad.numpy() for m in pipe.modules for n, p in m.named_parameters()}
        results[schedule] = (loss.item(), grads, [len(m.layers) for m in pipe.modules])
    return results


def _meta_model():
    with torch.device("meta"):
        return Llama(LlamaConfig(**TINY))


@pytest.fixture(scope="module")
def pp2_results():
    return run_ranks(_schedules_body, world_size=2, timeout=180)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_matches_the_unsplit_model(pp2_results, schedule):
    ref_loss, ref_grads = _reference()
    grads = {}
    for per_rank in pp2_results:
        loss, rank_grads, layers = per_rank[schedule]
        assert abs(loss - ref_loss) / ref_loss <= 1e-6, (loss, ref_loss)
        assert not set(grads) & set(rank_grads)  # every parameter lives on exactly one rank
        grads.update(rank_grads)
        assert sum(layers) == TINY["n_layers"] // 2  # 4 layers over 2 ranks
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        err = (torch.from_numpy(grads[name]) - ref).abs().max().item() / ref.abs().max().item()
        assert err <= 1e-5, (name, err)
