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


def _grouped_against_one_process(rank, size, cp_impl, balancer, with_docs, groups, graphs=None):
    """(loss difference, worst relative gradient difference, grouped calls); `graphs`: a dict to fill with what
    compiling each block whole (fullgraph, aot_eager) made: the ops its graphs call, graphs built, graph breaks."""
    from parallelisms.context_parallel import context_parallel
    from parallelisms.sublayer_groups import install

    torch.manual_seed(0)
    reference = Llama(LlamaConfig(**CONFIG))
    reference.init_weights(3)
    model = copy.deepcopy(reference)
    assert install(model, groups) == CONFIG["n_layers"]
    if graphs is not None:
        _compile_blocks(model, graphs)
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
    if graphs is not None:
        from torch._dynamo.utils import counters

        graphs.update(built=counters["stats"]["unique_graphs"], breaks=sum(counters["graph_break"].values()))
    return abs(loss.item() - want.item()), worst, calls


def _compile_blocks(model, graphs: dict) -> None:
    """Each block's forward compiled whole, as parallelize.apply_compile does, on aot_eager (the graphs the trainer
    hands inductor, run by eager kernels: the op's path without inductor's C++ builds); the ops each graph calls are
    written into graphs["ops"]."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs["ops"] = set()

    def backend(gm, inputs):
        graphs["ops"].update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    for block in model.layers.values():
        block.forward = torch.compile(block.forward, fullgraph=True, backend=backend)


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


COMPILED_CASES = [("ring", "zigzag", False, 2), ("ring", "zigzag", True, 4), ("allgather", "zigzag", True, 2),
                  ("ulysses", "zigzag", False, 2), ("ulysses", "zigzag", True, 4)]


@pytest.mark.timeout(240)
def test_compiled_blocks_run_the_grouped_sublayer_as_one_op_with_the_one_process_numbers():
    """Each block compiled whole (fullgraph): the grouped sublayer is one registered op in its graph
    (torch.ops.titan_cp.grouped_sublayer, the group loop inside it), both layers share one graph, no graph break, no
    SDPA left in the graph; loss and gradients as eager's bounds against the one-process model: at cp 2 ring
    (dense, documents), all-gather with documents and Ulysses (dense, documents), and at CP 1 dense and packed
    documents."""
    for world, cases, results in ((2, COMPILED_CASES, run_ranks(_compiled_cases, world_size=2, timeout=200)[0]),
                                  (1, CP1_CASES, run_ranks(_compiled_cp1_cases, world_size=1, timeout=100)[0])):
        for case, (loss_diff, grad_diff, calls, graphs) in zip(cases, results):
            assert loss_diff < 2e-6 and grad_diff < 2e-5, (world, case, loss_diff, grad_diff)
            assert calls == CONFIG["n_layers"], (world, case, calls)
            assert "titan_cp.grouped_sublayer.default" in graphs["ops"], (world, case, graphs)
            assert not any("scaled_dot_product" in op for op in graphs["ops"]), (world, case, graphs)
            assert graphs["built"] == 1 and graphs["breaks"] == 0, (world, case, graphs)


def _compiled(rank, size, cases):
    results = []
    for case in cases:
        graphs = {}
        results.append((*_grouped_against_one_process(rank, size, *case, graphs=graphs), graphs))
    return results


def _compiled_cases(rank, size):
    return _compiled(rank, size, COMPILED_CASES)


def _compiled_cp1_cases(rank, size):
    return _compiled(rank, size, CP1_CASES)


def _opcheck_grouped(rank, size):
    """torch.library.opcheck of the grouped sublayer's op pair inside a one-rank block, dense and packed documents:
    schema, the fake against the real outputs, autograd registration, AOT dispatch."""
    from torch.library import opcheck

    from parallelisms.context_parallel import context_parallel
    from parallelisms.cp.op import ACTIVE

    generator = torch.Generator().manual_seed(3)
    reports = []
    for with_docs in (False, True):
        tokens = torch.zeros(1, SEQ, dtype=torch.long)
        docs = (torch.arange(SEQ) >= SEQ // 3).long()[None]
        buffers = [tokens] + ([docs] if with_docs else [])
        with context_parallel(dist.group.WORLD, buffers, [1] * len(buffers),
                              document_ids=buffers[1] if with_docs else None):
            dim, head_dim = CONFIG["dim"], CONFIG["dim"] // CONFIG["n_heads"]
            x = torch.randn(1, SEQ, dim, generator=generator)
            wq, wo = (torch.randn(dim, dim, generator=generator) * 0.1 for _ in range(2))
            wk, wv = (torch.randn(CONFIG["n_kv_heads"] * head_dim, dim, generator=generator) * 0.1 for _ in range(2))
            angles = torch.arange(SEQ, dtype=torch.float32)[None, :, None, None] * torch.rand(head_dim // 2)
            cos, sin = angles.cos(), angles.sin()
            constants = (2, head_dim)
            y, out, lse = torch.ops.titan_cp.grouped_sublayer(x, wq, wk, wv, wo, cos, sin, *constants)
            forward = opcheck(torch.ops.titan_cp.grouped_sublayer.default,
                              tuple(t.clone().requires_grad_() for t in (x, wq, wk, wv, wo)) + (cos, sin) + constants)
            backward = opcheck(torch.ops.titan_cp.grouped_sublayer_backward.default,
                               (torch.randn(y.shape, generator=generator), x, wq, wk, wv, wo, cos, sin, out, lse,
                                *constants))
            reports.append((ACTIVE.current(dist.group.WORLD.group_name).op_variant, forward, backward))
    return reports


@pytest.mark.timeout(120)
def test_the_grouped_sublayer_op_pair_passes_opcheck():
    (reports,) = run_ranks(_opcheck_grouped, world_size=1, timeout=100)
    assert [variant for variant, _, _ in reports] == ["ring", "packed"]
    for variant, forward, backward in reports:
        assert all(r == "SUCCESS" for r in (*forward.values(), *backward.values())), (variant, forward, backward)


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
    `training.compile` (each block one inductor graph with the grouped sublayer's op in it: parallelize.apply_compile),
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
        records = read_metrics(out)
        runs[groups] = [(r["loss"], r["grad_norm"]) for r in records]
        if compiled == "true":  # every block compiled whole: no frame left eager, no graph break
            counters = records[-1]["compile"]
            assert counters["frames_failed"] == 0 and not counters["graph_breaks"], counters
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
