"""The composer: turns a full Llama (or one pipeline stage of it) into this rank's parallel piece, in recipe order.

PP split into stages (parallelisms/pipeline_parallel.py, driven by the trainer) -> per stage: float8 linear layers
(parallelisms/float8.py; before TP, whose float8 styles take them) -> TP (+SP, loss parallel) -> CP (attention
becomes ring; applied per batch by `context_parallel`, nothing to do here) -> activation checkpointing ->
torch.compile of each whole block inside its checkpoint wrapper (attention and feed-forward separately under TP) ->
FSDP2 over (dp_shard x cp), replicated over dp_replicate.
Then the module is materialised from the meta device and initialised from the seed, identically on every mesh.
"""
from __future__ import annotations

import functools
import re

import torch
import torch.distributed as dist

from config.schema import Config
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.sublayer_groups import install as install_sublayer_groups
from parallelisms.data_parallel import apply_fsdp, offload_policy
from parallelisms.float8 import apply_float8, cast_under_autocast, float8_tp_styles
from parallelisms.parallel_dims import TrainingMesh
from parallelisms.tensor_parallel import apply_tp


def uses_fsdp(cfg: Config, mesh: TrainingMesh) -> bool:
    """FSDP whenever gradients cross ranks, and for bf16 under TP or PP on one data-parallel rank (its mixed precision
    keeps fp32 master weights); a single-device bf16 run uses autocast instead (`uses_autocast`). Always with
    `training.cpu_offload`: the offload is FSDP2's (on one GPU a mesh of one)."""
    return (mesh.dims.fsdp_enabled or cfg.training.cpu_offload
            or (cfg.training.dtype != "float32" and not uses_autocast(cfg, mesh)))


def uses_autocast(cfg: Config, mesh: TrainingMesh) -> bool:
    """One device, low precision: float32 parameters, gradients and optimizer, the forward under torch.autocast (every
    GEMM in `training.dtype`, each weight cast once per forward) instead of FSDP2 on a mesh of one, whose mixed
    precision copies every parameter in and out of its all-gather buffer and every gradient out of its reduce-scatter
    buffer each step (issue 36). Float8 linear layers too (parallelisms/float8.cast_under_autocast): on one H100,
    FSDP2 on a mesh of one made a float8 step at dim 4096 no faster than bf16's (0.0995 vs 0.0979 s: its copies
    and torchao's weight wrapper outside the compiled regions) where torchao's own layers ran 1.41x faster."""
    d = mesh.dims
    return (cfg.training.dtype != "float32" and not cfg.training.cpu_offload
            and d.dp_replicate * d.dp_shard * d.cp * d.tp * d.pp == 1)


def uses_loss_parallel(cfg: Config, mesh: TrainingMesh) -> bool:
    return mesh.dims.tp > 1 and cfg.parallelism.loss_parallel


def apply_compile(model: torch.nn.Module, split: bool = False) -> None:
    """Compiles each whole transformer block with `fullgraph=True` (norms, residual adds, projections, RoPE, the CP
    attention op, MLP) inside its activation-checkpoint wrapper, before FSDP2 wraps it. Under CP the attention is one
    registered op (parallelisms/cp/op.py), so a block is one graph. Every layer shares the compiled code (the module
    is an input of it), so the number of graphs does not grow with depth.

    Unlike TorchTitan, which compiles the checkpoint wrapper too, the checkpoint stays eager around the compiled
    block: dynamo traces a checkpoint body as a higher-order op without the active torch-function modes, so CP's
    router would not see the attention there (plain local attention: wrong by ~4e-2 at CP 2, measured), and its
    selective policies must be dispatch modes only. Eager around the graph, the recompute re-enters CP's router and
    reruns the compiled block, and the selective policy saves the CP op's output (no attention or exchange rerun).

    `split` (tensor parallelism): attention and feed-forward forwards compiled separately instead, TP's input hooks
    (sequence-sharded -> replicated) running eagerly between them; traced inside one graph those hooks gave the
    norm weights wrong gradients (tests/training/test_compile_tp_block.py is the minimal repro).

    The attention sublayer in head groups (parallelism.attention_sublayer_groups > 1) is one registered op in the
    block's graph, as the CP attention is (parallelisms/sublayer_groups.py)."""
    for name, block in model.layers.items():
        if split:
            inner = getattr(block, "_checkpoint_wrapped_module", block)  # set on the block, not on an AC wrapper
            for module in (inner.attention, inner.feed_forward):
                module.forward = torch.compile(module.forward)
        else:
            inner = getattr(block, "_checkpoint_wrapped_module", block)
            inner.forward = _whole_graph(inner.forward)


def _whole_graph(forward):
    """`forward` compiled with `fullgraph=True`, run eagerly while a fake-tensor mode is active: the dry run steps
    the model on fake tensors, where dynamo compiles nothing and `fullgraph=True` would refuse to run."""
    compiled = torch.compile(forward, fullgraph=True)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            return forward(*args, **kwargs)
        return compiled(*args, **kwargs)

    return run


def apply_autocast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The model's forward (loss included: the chunked loss runs inside it) under torch.autocast in `dtype` on the
    device of its first input. Activation checkpointing recomputes under the autocast state of the forward.

    The embedding's output is cast to `dtype` too (autocast leaves lookups in float32; the norms cast their weight,
    models/llama.py RMSNorm): activations then stay in `dtype` as on FSDP2's bf16 weights, where a float32 residual
    stream measured ~15% more activation memory."""
    def cast(module, args, out):
        return out.to(dtype)

    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            module.register_forward_hook(cast)
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(args[0].device.type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward


def compile_counters() -> dict:
    """Dynamo's own counters for this process, so a run can show it stayed compiled: graphs built (constant in the
    depth when every layer reuses them), frames dynamo gave up on (recompile limit or an unsupported construct; they
    run eagerly) and graph breaks by reason (none expected: under CP the attention is one registered op)."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return {"unique_graphs": counters["stats"]["unique_graphs"], "frames": frames["total"],
            "frames_failed": frames["total"] - frames["ok"], "unimplemented": sum(counters["unimplemented"].values()),
            "graph_breaks": {re.sub(r" at 0x[0-9a-f]+", "", " ".join(reason.split()))[:300]: n
                             for reason, n in counters["graph_break"].items()}}


def compile_surprises(counters: dict) -> list[str]:
    """What a compiled run should not do, one line each, from `compile_counters`: frames dynamo gave up on (they run
    eagerly), unsupported constructs, and every graph break (each whole block is one graph, CP attention included)."""
    lines = []
    if counters["frames_failed"]:
        lines.append(f"{counters['frames_failed']} frame(s) not compiled (recompile limit or an unsupported construct; "
                     "they run eagerly)")
    if counters["unimplemented"]:
        lines.append(f"{counters['unimplemented']} unsupported construct(s) met by dynamo")
    lines += [f"graph break x{n}: {reason}" for reason, n in counters["graph_breaks"].items()]
    return lines


def parallelize(model: torch.nn.Module, mesh: TrainingMesh, cfg: Config) -> torch.nn.Module:
    apply_float8(model, cfg, fsdp=uses_fsdp(cfg, mesh), device_type=mesh.world.device_type)
    if mesh.dims.tp > 1:
        float8 = float8_tp_styles(cfg.training.float8, dist.get_backend(mesh.tp_mesh.get_group()))
        apply_tp(model, mesh.tp_mesh, uses_loss_parallel(cfg, mesh), float8)
    if cfg.parallelism.attention_sublayer_groups > 1:  # before the wrappers: it sets an attribute of each attention
        install_sublayer_groups(model, cfg.parallelism.attention_sublayer_groups)
    ac = cfg.activation_checkpoint
    apply_activation_checkpointing(model, ac.mode, ac.every, ac.offload, ac.offload_prefetch, ac.offload_keep_last)
    if cfg.training.compiles(mesh.world.device_type):
        apply_compile(model, split=mesh.dims.tp > 1)
    if uses_autocast(cfg, mesh):
        cast_under_autocast(model)
        apply_autocast(model, getattr(torch, cfg.training.dtype))
    if uses_fsdp(cfg, mesh):
        apply_fsdp(model, mesh.fsdp_mesh(), getattr(torch, cfg.training.dtype),
                   cfg.parallelism.reshard_after_forward,
                   offload_policy(cfg.training.cpu_offload, mesh.world.device_type))
    return model


def materialize(model: torch.nn.Module, device: torch.device, cfg: Config, mesh: TrainingMesh) -> None:
    """Meta -> real storage on `device`, then the mesh-independent per-parameter init from the job seed. With
    `training.cpu_offload` the parameters are made in host memory (FSDP2's offload refuses device-resident shards)
    and only the buffers (RoPE's frequencies) go to `device`, where the forward reads them."""
    if cfg.training.cpu_offload:
        model.to_empty(device="cpu")
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module.register_buffer(name, buffer.to(device), persistent=name not in
                                       module._non_persistent_buffers_set)
    else:
        model.to_empty(device=device)
    if not uses_fsdp(cfg, mesh) and not uses_autocast(cfg, mesh):
        model.to(getattr(torch, cfg.training.dtype))
    model.tie_weights()  # to_empty / to replace parameters module by module (FSDP2 keeps a shared one itself)
    with torch.no_grad():
        model.init_weights(cfg.job.seed)

