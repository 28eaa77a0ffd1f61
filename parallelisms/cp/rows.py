"""K/V in flat buffers, so one transfer carries both: whole blocks (`pack_kv`, the dense exchanges) or chosen token
rows (`pack_rows`, the sparse exchanges of the documents layout). Pure tensor shapes; a leaf of the package."""
from __future__ import annotations

import torch


def pack_kv(k: torch.Tensor, v: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)]).to(dtype or k.dtype)


def unpack_kv(buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a `pack_kv` buffer in the shapes of `k` and `v`."""
    n = k.numel()
    return buf[:n].view(k.shape), buf[n:].view(v.shape)


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B * L, H * D): one row per token (a view when x is a (B, L, H, D) projection seen as
    (B, H, L, D))."""
    b, h, length, d = x.shape
    return x.transpose(1, 2).reshape(b * length, h * d)


def block_view(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (B * L, H * D) buffer seen as `like`'s (B, H, L, D)."""
    b, h, length, d = like.shape
    return flat.view(b, length, h, d).transpose(1, 2)


def pack_rows(k, v, rows: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.cat([flat_rows(k).index_select(0, rows).reshape(-1),
                      flat_rows(v).index_select(0, rows).reshape(-1)]).to(dtype or k.dtype)


def unpack_rows(buf: torch.Tensor, k, v, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, Hkv * D) views of K and V in a `pack_rows` buffer."""
    width = k.size(1) * k.size(3)
    return buf[:n_rows * width].view(n_rows, width), buf[n_rows * width:].view(n_rows, width)


def received_block(buf: torch.Tensor, rows: torch.Tensor, k, v):
    """The received rows written at their own rows of (B, Hkv, L, D) blocks (other rows are never read)."""
    in_k, in_v = unpack_rows(buf, k, v, rows.numel())
    k_blk, v_blk = (torch.empty_like(flat_rows(x)) for x in (k, v))
    k_blk.index_copy_(0, rows, in_k)
    v_blk.index_copy_(0, rows, in_v)
    return block_view(k_blk, k), block_view(v_blk, v)


def grad_rows_buffers(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed float32 dK/dV accumulators, one row per token: (B * L, Hkv * D)."""
    return tuple(torch.zeros(flat_rows(x).shape, dtype=torch.float32, device=x.device) for x in (k, v))
