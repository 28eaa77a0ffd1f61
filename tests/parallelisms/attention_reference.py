"""Independent references for the CP tests: full-sequence SDPA in float64 with explicitly expanded heads and an
explicit boolean mask, and random packed-document layouts."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_attention(q, k, v, is_causal: bool, document_ids: torch.Tensor | None) -> torch.Tensor:
    """q (B, Hq, S, D), k/v (B, Hkv, S, D): heads expanded by repeat_interleave, mask built from positions and ids."""
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    batch, seq = q.size(0), q.size(2)
    allowed = torch.ones(batch, seq, seq, dtype=torch.bool)
    if is_causal:
        allowed &= torch.arange(seq)[None, :] <= torch.arange(seq)[:, None]
    if document_ids is not None:
        allowed &= document_ids[:, :, None] == document_ids[:, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])


def random_documents(batch: int, seq: int, max_len: int, generator: torch.Generator) -> torch.Tensor:
    """(B, S) ids of consecutive documents with random lengths in [1, max_len]."""
    rows = []
    for _ in range(batch):
        lengths = torch.randint(1, max_len + 1, (seq,), generator=generator)
        rows.append(torch.repeat_interleave(torch.arange(seq), lengths)[:seq])
    return torch.stack(rows)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| / max |reference| (elementwise ratios are meaningless near zero)."""
    reference = reference.detach().double()
    return ((value.detach().double() - reference).abs().max() / reference.abs().max()).item()


def per_document_attention(q, k, v, is_causal: bool, document_ids: torch.Tensor) -> torch.Tensor:
    """Every document of every row run alone through plain SDPA (no mask at all; causal within the document), the
    results put back at the document's positions: document masking written without any mask or piece logic."""
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    rows = []
    for b in range(q.size(0)):
        out = q.new_zeros(q.shape[1:])
        for doc in document_ids[b].unique():
            at = (document_ids[b] == doc).nonzero().flatten()
            alone = F.scaled_dot_product_attention(q[b:b + 1, :, at], k[b:b + 1, :, at], v[b:b + 1, :, at],
                                                   is_causal=is_causal)
            out = out.index_put((torch.arange(q.size(1))[:, None], at[None, :]), alone[0])
        rows.append(out)
    return torch.stack(rows)
