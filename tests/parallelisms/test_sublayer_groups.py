"""The attention sublayer in K/V head groups (parallelisms/sublayer_groups.py) computes the model's numbers: a Llama
trained under context_parallel with its sublayers grouped gives the loss and every parameter gradient of the same
model on the whole sequence in one process, without CP (documents: each document run alone), for the ring,
all-gather and Ulysses exchanges and at CP 1, dense and with documents, every group count that divides the K/V
heads, in float32; and where it does not apply (auto, no open block) the model's own sublayer runs."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.llama import Llama, LlamaConfig
from tests.distributed import run_ranks
from tests.parallelisms.test_context_parallel import _batches, _reference_loss

CONFIG = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=64, multiple_of=32, rope_theta=10000.0)
"""GQA with 2 query heads per K/V head and 4 K/V heads: groups of 1, 2 and 4 K/V heads (4, 2 and 1 groups)."""
SEQ = 48
"""Zigzag at CP 2 cuts the sequence in 4 chunks of 12 tokens: every kind of ring step, documents crossing chunks."""


def _grouped_against_one_process(rank, size, cp_impl, balancer, with_docs, groups):
    from parallelisms.context_parallel import context_parallel
    from parallelisms.sublayer_groups import install

    torch.manual_seed(0)
    reference = Llama(LlamaConfig(**CONFIG))
    reference.init_weights(3)
    model = copy.deepcopy(reference)
    assert install(model, groups) == CONFIG["n_layers"]
    tokens, labels, positions, docs = next(_batches(1, 2, SEQ, CONFIG["vocab_size"], with_docs,
                                                    torch.Generator().manual_seed(11)))
    want = _reference_loss(reference, tokens, labels, positions, docs, with_docs) / labels.numel()
    want.backward()
    buffers = [tokens.clone(), labels.clone(), positions.clone(), docs.clone()]
    with context_parallel(dist.group.WORLD, buffers, [1, 1, 1, 1], load_balancer=balancer,
                          document_ids=buffers[3] if with_docs else None, cp_impl=cp_impl):
        logits = model(buffers[0], buffers[2])
        loss = F.cross_entropy(logits.flatten(0, 1), buffers[1].flatten(), reduction="sum") / labels.numel()
        loss.backward()
    dist.all_reduce(loss)
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        dist.all_reduce(p.grad)
        worst = max(worst, ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item())
    calls = sum(block.attention.sublayer_hook.calls for block in model.layers.values())
    return abs(loss.item() - want.item()), worst, calls


CASES = [("ring", "zigzag", False, 2), ("ring", "zigzag", True, 4), ("ring", "striped", False, 4),
         ("allgather", "zigzag", True, 2), ("ulysses", "zigzag", False, 2), ("ulysses", "zigzag", True, 4),
         ("ring", "zigzag", False, 1)]
"""Ulysses with 4 groups: each group's one K/V head is repeated so that its 2 query heads split over the 2 ranks."""


@pytest.mark.timeout(240)
def test_grouped_sublayers_give_the_one_process_loss_and_gradients():
    """Each case: loss within 2e-6 and every parameter's gradient within 2e-5 of its largest entry (float32; the
    groups' GEMMs and the summed x gradient round differently from the whole ones); every sublayer ran grouped
    (2 layers, forward and the block's recompute-free backward: 2 calls), and with 1 group none did."""
    results = run_ranks(_all_cases, world_size=2, timeout=200)
    for case, (loss_diff, grad_diff, calls) in zip(CASES, results[0]):
        assert loss_diff < 2e-6 and grad_diff < 2e-5, (case, loss_diff, grad_diff)
        assert calls == (CONFIG["n_layers"] if case[3] > 1 else 0), (case, calls)


def _all_cases(rank, size):
    return [_grouped_against_one_process(rank, size, *case) for case in CASES]


CP1_CASES = [("ring", "zigzag", False, 2), ("ring", "zigzag", False, 4), ("ring", "zigzag", True, 2)]
"""CP 1, the one-GPU recipes' case: the trainer's step opens a block of one rank (training/step.py), so the dense
sequence runs the ring of one rank and documents the packed call (cp/packed_documents.py), both grouped."""


@pytest.mark.timeout(120)
def test_at_cp1_grouped_sublayers_give_the_models_loss_and_gradients():
    """The same checks as above in a block of one rank: dense (2 and 4 groups) and packed documents (2 groups)."""
    results = run_ranks(_cp1_cases, world_size=1, timeout=100)
    for case, (loss_diff, grad_diff, calls) in zip(CP1_CASES, results[0]):
        assert loss_diff < 2e-6 and grad_diff < 2e-5, (case, loss_diff, grad_diff)
        assert calls == CONFIG["n_layers"], (case, calls)


def _cp1_cases(rank, size):
    return [_grouped_against_one_process(rank, size, *case) for case in CP1_CASES]


def _ulysses_and_outside(rank, size):
    from parallelisms.context_parallel import context_parallel
    from parallelisms.sublayer_groups import install

    model = Llama(LlamaConfig(**CONFIG))
    model.init_weights(3)
    install(model, 2)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(SEQ)[None]
    model(tokens, positions)  # no context_parallel block: the model's own sublayer
    outside = sum(block.attention.sublayer_hook.calls for block in model.layers.values())
    buffers = [tokens.clone(), positions.clone()]
    with context_parallel(dist.group.WORLD, buffers, [1, 1], cp_impl="auto"):
        model(buffers[0], buffers[1])
    return outside, sum(block.attention.sublayer_hook.calls for block in model.layers.values())


@pytest.mark.timeout(120)
def test_where_the_exchange_is_chosen_per_call_or_no_cp_block_is_open_the_models_own_sublayer_runs():
    assert run_ranks(_ulysses_and_outside, world_size=2, timeout=100)[0] == (0, 0)


TRAINER = ["--training.steps", "3", "--training.seq_len", "256", "--parallelism.cp", "2", "--parallelism.dp_shard",
           "1", "--activation_checkpoint.mode", "full", "--activation_checkpoint.offload", "true",
           "--model.n_layers", "2", "--metrics.enable_tensorboard", "false"]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_the_trainer_with_grouped_sublayers_compiled_steps_as_the_eager_ungrouped_run(tmp_path):
    """Slow tier (two 2-rank trainer runs, one compiled: ~45 CPU-s): the recipe key through the composer, under FSDP,
    full checkpointing (the grouped function runs again in the recompute), block-input offload and
    `training.compile` (the feed-forward compiled, the grouped sublayer eager beside it: parallelize.apply_compile),
    debug model at cp 2, float32: 3 steps' losses and gradient norms equal the eager run without groups within
    1e-5 relative, the compiled meshes' bound (tests/training/test_compile.py; step 3 reads AdamW state from steps 1
    and 2). The debug model has 16 K/V heads: 4 groups of 4."""
    from tests.trainer_runs import read_metrics, run_train

    runs = {}
    for groups, compiled in (("0", "false"), ("4", "true")):
        out = str(tmp_path / groups)
        done = run_train("--job.dump_folder", out, *TRAINER, "--parallelism.attention_sublayer_groups", groups,
                         "--training.compile", compiled, nproc=2, timeout=400, forked=True)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[groups] = [(r["loss"], r["grad_norm"]) for r in read_metrics(out)]
    assert len(runs["4"]) == 3
    for (loss, norm), (want_loss, want_norm) in zip(runs["4"], runs["0"]):
        assert abs(loss - want_loss) <= 1e-5 * want_loss and abs(norm - want_norm) <= 1e-5 * want_norm, runs

@pytest.mark.parametrize("overrides, expect", [
    (["--parallelism.attention_sublayer_groups", "3"], "it must divide the model's 16 K/V heads: use one of [2, 4, 8, 16]"),
    (["--parallelism.cp_impl", "hybrid"], "set parallelism.cp_impl = \"ring\""),
    (["--parallelism.cp_impl", "ulysses", "--parallelism.attention_sublayer_groups", "16"],
     "each group's 1 query heads must split over cp 2: use one of [2, 4, 8]"),
    (["--parallelism.tp", "2", "--parallelism.cp", "1"], "set parallelism.tp = 1"),
    (["--activation_checkpoint.mode", "op"], "use mode = \"full\""),
])
def test_a_recipe_asking_groups_where_they_would_not_run_is_refused_in_one_line(overrides, expect):
    """Before any rank starts: the key, the recipe and the fix on one line (a silently ungrouped sublayer would leave
    the dry run's plan wrong). Ulysses with 4 groups of 4 query heads over cp 2 passes."""
    import os

    from config import RecipeError
    from config.recipe import load_config
    from tests.trainer_runs import ROOT
    from training.launch_checks.preflight import preflight_stages

    recipe = os.path.join(ROOT, "recipes", "debug.toml")
    base = ["--parallelism.cp", "2", "--parallelism.dp_shard", "1", "--parallelism.attention_sublayer_groups", "4"]
    preflight_stages(load_config(recipe, base + ["--parallelism.cp_impl", "ulysses"]), world_size=2)
    with pytest.raises(RecipeError) as err:
        preflight_stages(load_config(recipe, base + overrides), world_size=2)
    message = str(err.value)
    assert "parallelism.attention_sublayer_groups" in message and recipe in message and "\n" not in message, message
    assert expect in message, message
