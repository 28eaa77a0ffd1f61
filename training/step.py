"""One training step, written once: the micro-step (forward under the CP and loss contexts, loss, backward),
gradient clipping by the global norm and the optimizer update.

`Trainer.train_step` (training/trainer.py), the dry run's memory probe (training/planning/memory_probe.py) and the passkey
evaluation (its CP context) call these functions, so a change to the step (a new loss, offloading) reaches the
planner's measurement too instead of leaving it measuring a copy.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from config import Refusal
from config.schema import ParallelismConfig
from parallelisms.comm import all_reduce_
from parallelisms.context_parallel import CommStats, context_parallel
from parallelisms.cp.kernel_blocks import sdpa_priority
from parallelisms.float8 import precompute_float8_scales, scales_over_context_parallel
from parallelisms.parallel_dims import TrainingMesh
from parallelisms.pipeline_parallel import Pipeline
from training.loss import loss_context, token_loss_sum

SEQUENCE_BUFFERS = ("input_ids", "labels", "position_ids")
"""The batch fields every micro-step shards over the CP ranks (all the same way, so RoPE sees true positions)."""


@dataclass
class StepSetup:
    """What every micro-step of a ramp stage shares."""
    model: nn.Module
    """The model this rank runs (unused under a pipeline, whose schedule holds the stages)."""
    mesh: TrainingMesh
    parallelism: ParallelismConfig
    document_masking: bool
    """Attention stays inside each packed document (the ring then also runs at cp = 1)."""
    loss_parallel: bool
    """The logits are vocabulary-sharded DTensors: compute the loss under torch's loss_parallel."""
    stats: CommStats | None = None
    """Counters the CP attention adds its bytes to."""
    pipeline: Pipeline | None = None
    loss_chunk_tokens: int = 0
    """> 0: the model returns the summed loss, projecting and scoring this many tokens at a time
    (models/chunked_loss.py) instead of returning whole logits."""
    sparse_labels: bool = False
    """Few tokens carry labels (passkey rows): the chunked loss projects only those (one host sync per micro-step)."""
    float8: str = "off"
    """training.float8: under CP its scales are taken over the whole sequence (float8.scales_over_context_parallel)."""

    def __post_init__(self):
        if self.loss_chunk_tokens < 0:
            raise Refusal("StepSetup.loss_chunk_tokens takes a resolved tile (TrainingConfig.loss_tile_tokens), "
                          f"not {self.loss_chunk_tokens}")

    @property
    def shards_sequence(self) -> bool:
        """Whether the step runs inside a `context_parallel` block: CP > 1, document masking (its packed call at
        CP 1), or the attention sublayer in head groups, which runs the CP op's bodies on the open block (a block
        of one rank at CP 1: its ring is one local call; parallelisms/sublayer_groups.py)."""
        return (self.parallelism.cp > 1 or self.document_masking
                or self.parallelism.attention_sublayer_groups > 1)


@contextlib.contextmanager
def cp_context(setup: StepSetup, batch: dict):
    """Shards the batch's sequence buffers over the CP ranks in place and routes attention to the CP variant until
    exit (at cp = 1 too when document masking or the grouped attention sublayer is on). Without context parallelism
    the model's SDPA calls run as they are, with torch's backends ordered by `parallelism.attention_kernel` on CUDA
    (cuDNN first on Hopper). With float8 linear layers under CP, their scales are taken over the whole sequence meanwhile
    (parallelisms/float8.scales_over_context_parallel): training and the evaluations alike."""
    cp_mesh = setup.mesh.cp_mesh if setup.parallelism.cp > 1 else None
    with _sequence_context(setup, batch), scales_over_context_parallel(setup.float8, cp_mesh):
        yield


def _sequence_context(setup: StepSetup, batch: dict):
    if not setup.shards_sequence:
        return sdpa_priority(setup.parallelism.attention_kernel, batch["input_ids"].device)
    names = SEQUENCE_BUFFERS + (("document_ids",) if setup.document_masking else ())
    p = setup.parallelism
    return context_parallel(
        setup.mesh.cp_mesh, buffers=[batch[n] for n in names], buffer_seq_dims=[1] * len(names),
        no_restore_buffers={batch[n] for n in names}, load_balancer=p.cp_load_balancer, cp_impl=p.cp_impl,
        document_ids=batch["document_ids"] if setup.document_masking else None, stats=setup.stats,
        cp_subgroups=setup.mesh.cp_subgroups, plan=batch.get("plan"), head_groups=p.attention_head_groups,
        attention_kernel=p.attention_kernel)


def move_batch(batch: dict, device: torch.device) -> dict:
    """The batch (and its host plan, training/batch_plans.py) on the run's device: host-to-device copies posted
    with non_blocking=True from the loader's pinned memory, so the host never waits for the stream here."""
    return {name: value.to(device, non_blocking=True) for name, value in batch.items()}


def local_loss_sum(setup: StepSetup, batch: dict) -> torch.Tensor:
    """This rank's summed token loss (float32 scalar): fused and chunked with the output projection, or from whole
    logits."""
    if setup.loss_chunk_tokens:
        return setup.model(batch["input_ids"], batch["position_ids"], labels=batch["labels"],
                           loss_chunk_tokens=setup.loss_chunk_tokens, sparse_labels=setup.sparse_labels)
    return token_loss_sum(setup.model(batch["input_ids"], batch["position_ids"]), batch["labels"])


def micro_step(setup: StepSetup, batch: dict, global_tokens: int) -> torch.Tensor:
    """Forward and backward of one local batch; returns its loss (local token sum / `global_tokens`), detached.

    The backward runs inside the CP context: autograd refuses tensors that changed after it saved them, and the
    context restores nothing it was told to keep sharded."""
    with cp_context(setup, batch), loss_context(setup.loss_parallel):
        if setup.pipeline is not None:
            return setup.pipeline.step(batch, loss_divisor=global_tokens, loss_chunk_tokens=setup.loss_chunk_tokens,
                                       sparse_labels=setup.sparse_labels)
        scaled = local_loss_sum(setup, batch) / global_tokens
        scaled.backward()
    return scaled.detach()


def optimizer_step(optimizer, scheduler, parts: list[nn.Module], float8: bool = False) -> None:
    """The update after clipping: AdamW, then with float8 linear layers every float8-all-gathered weight's scale
    from its new values (one all-reduce instead of one per weight in the next forward's all-gathers), then the
    gradients freed and the learning rate advanced."""
    optimizer.step()
    if float8:
        precompute_float8_scales(parts)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clips by the global 2-norm over every shard (FSDP/TP DTensors are reduced over their meshes) and, with
    `pp_group`, over every pipeline stage; returns that norm. max_norm <= 0 only measures.

    Accumulated in float64: a float32 CPU norm of one large gradient is off by ~1e-5 relative, which would show up as
    a mesh-dependent grad norm (every mesh shards the tensors differently)."""
    params = [p for p in parameters if p.grad is not None]
    per_tensor = torch._foreach_norm([p.grad for p in params], 2.0, dtype=torch.float64)
    norm = torch.linalg.vector_norm(torch.stack(per_tensor))
    if isinstance(norm, DTensor):  # a partial norm over the sharded mesh dims: sum the squares over each of them
        # on the mesh's device: host-offloaded gradients (training.cpu_offload) give a host norm NCCL cannot reduce
        local = norm.to_local()
        if local.device.type != norm.device_mesh.device_type:
            local = local.to(norm.device_mesh.device_type)
        squared = local ** 2
        for dim, placement in enumerate(norm.placements):
            if placement.is_partial():
                all_reduce_(squared, group=norm.device_mesh.get_group(dim))
    else:
        squared = norm**2
    if pp_group is not None:
        all_reduce_(squared, group=pp_group)
    norm = squared.sqrt()
    if max_norm > 0:
        # foreach on CUDA (one launch per chunk of gradients); on host gradients the per-tensor loop, the same
        # products, without DTensor's propagation of a foreach op over every gradient (as build_optimizer's AdamW).
        # Said here, not left to torch's default, which takes the loop for DTensor gradients on CUDA too.
        on_cuda = bool(params) and params[0].grad.device.type == "cuda"
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.float(), foreach=on_cuda)
    return norm
