"""`BlockSpec`: what one CP attention call fixes for every block it computes (group, causality, scale, layout,
documents, counters, head groups, kernel family); its `pieces` are the mask-free kernel calls a rank makes against one source rank's K/V
(plan_pieces.py: blocks cut by documents)."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from parallelisms.cp.counters import CommStats
from parallelisms.cp.layouts import DOCUMENTS
from parallelisms.cp.plan_piece import Piece
from parallelisms.cp.plan_pieces import DocumentShards, block_tasks, plain_pieces


@dataclass(frozen=True)
class BlockSpec:
    """What one CP attention call fixes for every block it computes."""
    group: dist.ProcessGroup
    is_causal: bool
    scale: float | None
    load_balancer: str
    docs: DocumentShards | None
    stats: CommStats | None
    head_groups: int = 0
    """K/V head groups computed one after another (autograd.py); 0 = as many as keep a group's float32 dQ
    accumulator within `HEAD_GROUP_BYTES`."""
    kernel: str = "flash"
    """The kernel family of every block (kernel_blocks.CONCRETE_KERNELS: flash, cudnn, fa3, fa4), "auto" resolved."""
    packed: str = "flash"
    """The kernel of document pieces' packed calls on CUDA (kernel_cudnn_thd.PACKED_KERNELS: flash varlen, or
    cuDNN THD when `attention_kernel = "cudnn"` and the frontend serves the device)."""

    def pieces(self, rank: int, src: int, size: int, local_len: int) -> list[Piece]:
        """The mask-free kernel calls `rank` makes against the K/V of rank `src` (cached per batch with documents)."""
        if self.load_balancer == DOCUMENTS:
            return self.docs.layout_pieces(rank, src, self.is_causal)
        tasks = block_tasks(rank, src, size, local_len, self.load_balancer, self.is_causal)
        if self.docs is None:
            return plain_pieces(tasks)
        return self.docs.pieces(rank, src, tasks, local_len)
