"""What a compiled transformer block looks like to dynamo under context parallelism (the registered CP op, issue
47): `block_graph_report` explains one block of the debug model under a CP group and records the graph dynamo hands
its backend. Shared by tests/parallelisms/test_cp_compiled_op.py (CP 2 on gloo) and the bench."""
from __future__ import annotations

import torch

P2P_NAMES = ("isend", "irecv", "batch_isend_irecv", "send", "recv", "all_to_all", "all_gather", "reduce_scatter")
VARIANTS = {  # name: (load balancer, cp_impl, with document ids)
    "ring": ("zigzag", "ring", False),
    "allgather": ("zigzag", "allgather", False),
    "documents": ("documents", "ring", True),
    "ulysses": ("zigzag", "ulysses", False),
    "hybrid": ("zigzag", "hybrid", False),
}


def debug_model(n_layers: int = 2, ac: str = "none"):
    from models.llama import Llama, model_config
    from parallelisms.activation_checkpoint import apply_activation_checkpointing

    cfg = model_config("debug", dim=64, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, n_layers=n_layers)
    model = Llama(cfg)
    model.init_weights(0)
    apply_activation_checkpointing(model, ac)
    return model


def document_ids(batch: int, seq: int) -> torch.Tensor:
    """Rows of several documents of uneven lengths (the same on every rank)."""
    cuts = [0, seq // 8, seq // 2, seq - seq // 4, seq]
    ids = torch.zeros(seq, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        ids[a:b] = i
    return ids.expand(batch, seq).clone()


def _graph_ops(graph_modules: list) -> list[str]:
    """Every call's target, inside activation checkpointing's subgraphs too."""
    return [str(node.target) for top in graph_modules for gm in top.modules() if isinstance(gm, torch.fx.GraphModule)
            for node in gm.graph.nodes if node.op == "call_function"]


class RecordingBackend:
    """aot_eager that keeps the op targets of every forward and backward graph it is handed."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd

        self.forward, self.backward = [], []
        self.backend = aot_autograd(fw_compiler=self._keeper(self.forward), bw_compiler=self._keeper(self.backward))

    @staticmethod
    def _keeper(into: list):
        from functorch.compile import make_boxed_func

        def compile_graph(gm, example_inputs):
            into.append(_graph_ops([gm]))
            return make_boxed_func(gm.forward)
        return compile_graph


def block_explanation(group, variant: str, seq: int = 32) -> dict:
    """dynamo's explanation of layer 0's inner block (no checkpoint wrapper: explain calls the inner module, so the
    activation-checkpoint mode cannot change it, and one explanation per variant serves every mode) under
    `context_parallel` on `group`: its graph and break counts, the break reasons and the ops of its graphs."""
    import torch._dynamo

    from parallelisms.context_parallel import context_parallel

    load_balancer, cp_impl, with_ids = VARIANTS[variant]
    model = debug_model()
    tokens = torch.zeros(2, seq, dtype=torch.long)
    buffers = [tokens] + ([document_ids(2, seq)] if with_ids else [])
    torch._dynamo.reset()
    with context_parallel(group, buffers, [1] * len(buffers), load_balancer=load_balancer, cp_impl=cp_impl,
                          document_ids=buffers[1] if with_ids else None):
        local = tokens.size(1)
        h = torch.randn(2, local, 64, generator=torch.Generator().manual_seed(7), requires_grad=True)
        cos, sin = model.rope(torch.arange(local).expand(2, local))
        explained = torch._dynamo.explain(model.layers["0"])(h, cos, sin)
    ops = _graph_ops(explained.graphs)
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
            "reasons": [str(b.reason) for b in explained.break_reasons],
            "cp_ops": sum(op == "titan_cp.attention.default" for op in ops),
            "p2p": [op for op in ops if any(name in op for name in P2P_NAMES)]}


def block_graph_report(group, variant: str, ac: str, seq: int = 32, explained: dict | None = None) -> dict:
    """Layer 0 of the debug model under `context_parallel` on `group`, AC-wrapped as `ac` and compiled as
    apply_compile does (the block inside its checkpoint wrapper, fullgraph) with a recording backend: dynamo's
    explanation of the block (`explained`, block_explanation's for this variant, or made here), the ops of the graphs
    it built, and the compiled forward and input gradient's largest difference from the eager CP path (the
    autograd.Function exchanges, a separate implementation)."""
    import torch._dynamo

    from parallelisms.context_parallel import context_parallel

    if explained is None:
        explained = block_explanation(group, variant, seq)
    load_balancer, cp_impl, with_ids = VARIANTS[variant]
    model = debug_model(ac=ac)
    block = model.layers["0"]
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    tokens = torch.zeros(2, seq, dtype=torch.long)
    buffers = [tokens] + ([document_ids(2, seq)] if with_ids else [])
    torch._dynamo.reset()
    recorder = RecordingBackend()
    with context_parallel(group, buffers, [1] * len(buffers), load_balancer=load_balancer, cp_impl=cp_impl,
                          document_ids=buffers[1] if with_ids else None):
        local = tokens.size(1)
        h = torch.randn(2, local, 64, generator=torch.Generator().manual_seed(7), requires_grad=True)
        cos, sin = model.rope(torch.arange(local).expand(2, local))
        eager = block(h, cos, sin)
        (eager_grad,) = torch.autograd.grad(eager.square().sum(), h)
        inner.compile(backend=recorder.backend, fullgraph=True)
        compiled = block(h, cos, sin)
        (compiled_grad,) = torch.autograd.grad(compiled.square().sum(), h)
    return {**explained,
            "aot_forward_cp_ops": [sum(op == "titan_cp.attention.default" for op in g) for g in recorder.forward],
            "aot_backward_cp_ops": [sum(op == "titan_cp.attention_backward.default" for op in g)
                                    for g in recorder.backward],
            "aot_p2p": [op for g in recorder.forward + recorder.backward for op in g
                        if any(name in op for name in P2P_NAMES)],
            "max_error": max((compiled - eager).abs().max().item(), (compiled_grad - eager_grad).abs().max().item())}
