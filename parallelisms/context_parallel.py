"""Context parallelism for any model that calls `F.scaled_dot_product_attention` (CONTRACT, see docs/design.md): the
façade of the CP package (parallelisms/cp/, drawn in its __init__), which users and the trainer import.

`context_parallel(...)` shards the batch's sequence buffers in place (tokens, labels, position_ids, document ids: all
the same way, so RoPE sees true positions) and routes every SDPA call made inside it to a CP variant (`ring_attention`
by default) through a TorchFunctionMode, `SdpaToContextParallel` (cp/op.py, beside the registered op it routes to
under torch.compile): no monkey-patching, and the model needs no CP-specific code. SDPA calls the ring cannot compute
exactly (an attn_mask, dropout) raise `UnsupportedAttentionError` instead of computing something else.
`cp_impl` picks another exact variant on the same layouts (all-gather, Ulysses, hybrid, or auto: see cp/choice.py).

Labels must be shifted BEFORE sharding, and the loss divides the local sum by the global token count.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from config.errors import Refusal
from parallelisms.cp.attention import ring_attention
from parallelisms.cp.choice import CP_IMPLS, CPAttention, check_cp_impl
from parallelisms.cp.counters import CommStats, UnsupportedAttentionError
from parallelisms.cp.groups import resolve_group
from parallelisms.cp.kernel_blocks import ATTENTION_KERNELS
from parallelisms.cp.op import SdpaToContextParallel
from parallelisms.cp.layouts import (AUTO, DOCUMENTS, LOAD_BALANCERS, RING, ZIGZAG, check_load_balancer,
                                     check_sequence_length)
from parallelisms.cp.packed_documents import PackedDocuments
from parallelisms.cp.plan_host import HostDocumentIds
from parallelisms.cp.plan_layout import DocumentLayout
from parallelisms.cp.plan_pieces import DocumentShards
from parallelisms.cp.plan_sharding import local_positions, shard_sequence, unshard_sequence

__all__ = ["shard_sequence", "unshard_sequence", "ring_attention", "context_parallel", "CommStats",
           "UnsupportedAttentionError", "LOAD_BALANCERS", "CP_IMPLS", "ATTENTION_KERNELS", "check_sequence_length",
           "local_positions"]


def _check_buffers(buffers: Sequence[torch.Tensor], buffer_seq_dims: Sequence[int], document_ids) -> None:
    if len(buffers) != len(buffer_seq_dims):
        raise Refusal(f"context_parallel: {len(buffers)} buffers but {len(buffer_seq_dims)} buffer_seq_dims")
    if document_ids is not None:
        if not any(b is document_ids for b in buffers):
            raise Refusal("context_parallel: document_ids must be one of `buffers` (it is sharded with them)")
        if document_ids.dim() != 2:
            raise Refusal(f"context_parallel: document_ids must be (batch, seq), got {tuple(document_ids.shape)}")


def _documents_impl(cp_impl: str, document_ids) -> str:
    """The documents layout is planned from the ids; every variant reads it (auto resolves to the sparse ring)."""
    if document_ids is None:
        raise Refusal("context_parallel: load_balancer='documents' plans the layout from the document ids; "
                         "pass document_ids=")
    return RING if cp_impl == AUTO else cp_impl


def _check_plan(plan, cp_size: int, cp_rank: int, document_ids: torch.Tensor) -> None:
    """Shapes only (host metadata): a plan made for another mesh or batch must not shard this one."""
    expected = (cp_size, document_ids.size(0), document_ids.size(1) // cp_size)
    if tuple(plan.positions.shape) != expected or plan.cp_rank != cp_rank or plan.rank_positions is None:
        raise Refusal(f"context_parallel: the batch plan holds positions {tuple(plan.positions.shape)} for cp rank "
                         f"{plan.cp_rank}, but this call shards {tuple(document_ids.shape)} over {cp_size} ranks as "
                         f"rank {cp_rank} (or the plan was not moved with .to(device)); make it with "
                         "parallelisms.cp.plan_host.BatchPlan.build for this mesh")


def _shard_by_plan(buf: torch.Tensor, seq_dim: int, plan) -> torch.Tensor:
    """This rank's tokens of a (B, S, ...) buffer at the plan's device positions (a gather, no host copy)."""
    if seq_dim != 1:
        raise Refusal(f"the documents layout is per row: it needs seq_dim = 1, got {seq_dim}")
    rows = torch.arange(buf.size(0), device=buf.device)[:, None]
    return buf[rows, plan.rank_positions]


def _document_shards(document_ids, cp_size: int, cp_rank: int, load_balancer: str, plan):
    """(DocumentShards or None, DocumentLayout or None): every rank's ids and positions. The documents layout is
    planned per row from the full ids (identical on every rank), or taken from the batch's plan; the fixed layouts
    shard every rank's ids, taken before sharding (no collective needed)."""
    if load_balancer == DOCUMENTS:
        if plan is not None:
            _check_plan(plan, cp_size, cp_rank, document_ids)
            return DocumentShards.from_plan(plan), None
        layout = DocumentLayout.plan(document_ids, cp_size)
        return DocumentShards.from_layout(document_ids.detach(), layout), layout
    if document_ids is not None:
        return DocumentShards.from_full(_fixed_layout_ids(document_ids, plan), cp_size, load_balancer), None
    return None, None


def _fixed_layout_ids(document_ids: torch.Tensor, plan) -> torch.Tensor:
    """The full ids a fixed layout cuts its pieces from: the batch plan's host copy when the data workers made one
    (plan_host.HostDocumentIds: no device read in the step), else the buffer's own (one read, where they are)."""
    if isinstance(plan, HostDocumentIds):
        if tuple(plan.ids.shape) != tuple(document_ids.shape):
            raise Refusal(f"context_parallel: the batch plan's document ids are {tuple(plan.ids.shape)}, the "
                          f"document_ids buffer {tuple(document_ids.shape)}: the plan belongs to another batch")
        return plan.ids
    return document_ids.detach()


def _packed_documents(document_ids, cp_size: int, plan, device: torch.device) -> PackedDocuments | None:
    """CP 1 with documents: the batch's packed sequences (moved with the batch by the data workers, or made here from
    the ids: one host read), or None where the documents layout runs (CP > 1, or a document in two runs of a row).
    Its cu_seqlens go where the attention runs (`device`, the buffers'): ids or a plan left on the host beside CUDA
    queries would hand the kernel host offsets."""
    if cp_size != 1 or document_ids is None:
        return None
    if isinstance(plan, PackedDocuments):
        return plan if plan.cu_seqlens.device == device else plan.to(device)
    if plan is not None:  # the data workers found no packed form and planned the documents layout
        return None
    packed = PackedDocuments.from_ids(document_ids.detach().cpu().numpy())
    return None if packed is None else packed.to(device)


def _shard_in_place(buffers, buffer_seq_dims, no_restore_buffers, shard) -> list:
    """Replaces each buffer's storage with its contiguous local shard; returns (buffer, alias of the original) for
    the buffers to restore on exit."""
    keep = {id(b) for b in (no_restore_buffers or [])}
    originals = []
    with torch.no_grad():
        for buf, dim in zip(buffers, buffer_seq_dims):
            local = shard(buf, dim).clone(memory_format=torch.contiguous_format)
            if id(buf) not in keep:
                originals.append((buf, torch.empty(0, dtype=buf.dtype, device=buf.device).set_(buf)))
            buf.set_(local)
    return originals


@contextlib.contextmanager
def context_parallel(cp_mesh, buffers: Sequence[torch.Tensor], buffer_seq_dims: Sequence[int],
                     no_restore_buffers: Sequence[torch.Tensor] | None = None, load_balancer: str = ZIGZAG,
                     document_ids: torch.Tensor | None = None, stats: CommStats | None = None,
                     cp_impl: str = RING, ulysses_degree: int | None = None,
                     cp_subgroups: dict | None = None, plan=None, head_groups: int = 0,
                     attention_kernel: str = "auto") -> Iterator[None]:
    """Shards `buffers` in place along `buffer_seq_dims` and routes SDPA to the ring until exit.

    cp_mesh: a 1-D DeviceMesh or ProcessGroup (size 1 is valid and runs the same path). Buffers are restored on exit
    (without a copy) unless listed in `no_restore_buffers`; run the backward inside the block too, since autograd
    refuses tensors that changed after it saved them (tokens for the embedding, labels for the loss). `document_ids` (B, S), one of `buffers`: every routed SDPA
    call then masks attention to each token's own document, combined with causality when the call is causal.
    `stats`: a CommStats the ring adds its counters to. `cp_impl`: one of CP_IMPLS ("ring" is the default and the
    path above; see cp/choice.py); `ulysses_degree`: the Ulysses group size of cp_impl="hybrid" (None: in-node ranks).
    `cp_subgroups`: hybrid CP's {degree: (Ulysses group, ring group)}, made at setup (parallelisms/stage_meshes.py).
    `load_balancer="documents"` plans each row's layout from `document_ids` (cp/plan_layout.py) and runs the sparse
    ring (cp/exchange_ring_sparse.py; auto resolves to it), the sparse all-gather, Ulysses or hybrid. `plan`: that
    layout made before the step (parallelisms/cp/plan_host.BatchPlan, moved with `.to(device)`), as the trainer's data workers make
    it; then nothing here plans or reads a device tensor back. Without it the layout is planned here, on the host.
    `head_groups`: each attention call runs its K/V heads in at most this many groups, one after another, so its
    float32 accumulators and K/V in flight span one group (0 = by size: cp/autograd.py; the result is the same).
    With a CP group of one and `document_ids`, nothing is sharded: each layer makes one packed-sequence call over the
    batch's documents (cp/packed_documents.py); `plan` may then be that batch's PackedDocuments, moved with it. With
    a fixed load balancer `plan` may be the batch's ids on the host (cp/plan_host.HostDocumentIds), which the pieces
    are then cut from instead of reading `document_ids` back from the device.
    `attention_kernel`: the attention kernels' family, one of ATTENTION_KERNELS: "auto" (cuDNN's fused attention on
    CUDA SM 9.0+, FlashAttention-2 on older GPUs, the flash-CPU op on CPU), "cudnn", "flash", "fa3" / "fa4" (torch's
    flash ops once `torch.nn.attention.activate_flash_attention_impl` switched them; cp/kernel_blocks.py).
    """
    group = resolve_group(cp_mesh)
    check_load_balancer(load_balancer)
    check_cp_impl(cp_impl)
    if attention_kernel not in ATTENTION_KERNELS:
        raise Refusal(f"context_parallel: attention_kernel {attention_kernel!r} is none of {ATTENTION_KERNELS}")
    _check_buffers(buffers, buffer_seq_dims, document_ids)
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    for buf, dim in zip(buffers, buffer_seq_dims):
        check_sequence_length(buf.size(dim), cp_size, load_balancer)
    if load_balancer == DOCUMENTS:
        cp_impl = _documents_impl(cp_impl, document_ids)
    run_device = buffers[0].device if buffers else getattr(document_ids, "device", None)
    packed = _packed_documents(document_ids, cp_size, plan, run_device)
    if packed is not None:  # nothing to shard or exchange: every layout is the identity at P = 1
        with SdpaToContextParallel(group, load_balancer, set(), None, stats, kernel=attention_kernel, packed=packed):
            yield
        return
    documents, layout = _document_shards(document_ids, cp_size, cp_rank, load_balancer, plan)
    variant = None
    if cp_impl != RING:
        full_ids = None  # a host plan's ids (checked above), or a copy of the buffer, which is sharded in place below
        if document_ids is not None:
            full_ids = plan.ids if isinstance(plan, HostDocumentIds) else document_ids.detach().clone()
        variant = CPAttention(cp_impl, group, load_balancer, full_ids, documents, stats, ulysses_degree, cp_subgroups,
                              head_groups, attention_kernel)
    def shard(buf: torch.Tensor, dim: int) -> torch.Tensor:
        if plan is not None and load_balancer == DOCUMENTS:
            return _shard_by_plan(buf, dim, plan)
        if layout is not None:
            return layout.shard(buf, dim, cp_rank)
        return shard_sequence(buf, dim, cp_rank, cp_size, load_balancer)

    originals = _shard_in_place(buffers, buffer_seq_dims, no_restore_buffers, shard)
    local_lengths = {buf.size(dim) for buf, dim in zip(buffers, buffer_seq_dims)}
    try:
        with SdpaToContextParallel(group, load_balancer, local_lengths, documents, stats, variant, head_groups,
                                   attention_kernel):
            yield
    finally:
        with torch.no_grad():
            for buf, alias in originals:
                buf.set_(alias)
