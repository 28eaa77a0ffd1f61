"""How the thread double (tests/nccl_rules.py) computes a collective once every member runs it: the data each
member receives, or an error naming what NCCL would do wrong (mismatched sizes, splits, reduce ops or groups).
Inputs are the members' snapshots taken at post; outputs are private buffers delivered at wait()."""
from __future__ import annotations

import torch


_REDUCE = {"SUM": lambda ts: torch.stack(ts).sum(0), "AVG": lambda ts: torch.stack(ts).mean(0),
           "MAX": lambda ts: torch.stack(ts).amax(0), "MIN": lambda ts: torch.stack(ts).amin(0)}


def _reduce_name(op) -> str:
    return str(op).split(".")[-1].upper()


def _all_to_all_v(ops: list) -> str | None:
    """all_to_all_single with variable splits: rank i's j-th input split must be rank j's i-th output split."""
    n = len(ops)
    for op in ops:
        out_splits, in_splits = op.splits
        if len(out_splits) != n or len(in_splits) != n or sum(in_splits) != op.tensor.numel() \
                or sum(out_splits) != op.output.numel() or op.output.dtype != op.tensor.dtype:
            return f"all_to_all_single on ranks {list(op.comm)}: rank {op.rank}'s splits {op.splits} do not fit its " \
                   f"input {op.tensor.numel()} / output {op.output.numel()} x {op.tensor.dtype}"
    for i, a in enumerate(ops):
        for j, b in enumerate(ops):
            if a.splits[1][j] != b.splits[0][i]:
                return f"all_to_all_single on ranks {list(a.comm)}: rank {a.rank} sends {a.splits[1][j]} elements " \
                       f"to rank {b.rank}, which expects {b.splits[0][i]}"
    with torch.no_grad():
        for i, a in enumerate(ops):
            out_at = [sum(a.splits[0][:j]) for j in range(n)]
            for j, b in enumerate(ops):
                at = sum(b.splits[1][:i])
                a.output.view(-1)[out_at[j]:out_at[j] + a.splits[0][j]].copy_(
                    b.tensor.reshape(-1)[at:at + b.splits[1][i]])
    return None


def _check_split(ops: list) -> str | None:
    """The world split behind `new_group`: every rank that joins a group must name the same group."""
    chosen = {op.rank: op.splits for op in ops}
    for rank, group in chosen.items():
        if rank in group and any(chosen[m] != group for m in group):
            return f"new_group #{ops[0].pair_index}: rank {rank} creates {list(group)}, but its members ask for " \
                   f"{ {m: list(chosen[m]) for m in group} }"
    return None


def execute(kind: str, ops: list) -> str | None:
    """Runs one collective over its members' ops (in communicator rank order); returns an error or None."""
    if kind == "all_to_all_single_v":
        return _all_to_all_v(ops)
    if kind == "new_group":
        return _check_split(ops)
    reduce_ops = {_reduce_name(op.reduce_op) for op in ops}
    if len(reduce_ops) > 1:
        return f"{kind} on ranks {list(ops[0].comm)}: reduce ops differ: " \
               f"{ {op.rank: _reduce_name(op.reduce_op) for op in ops} } (NCCL would combine them silently)"
    n, inputs = len(ops), [op.tensor for op in ops]
    if len({(t.numel(), t.dtype) for t in inputs}) != 1:
        return f"{kind} on ranks {list(ops[0].comm)}: inputs differ: {[(t.numel(), t.dtype) for t in inputs]}"
    if kind != "all_gather" and any(op.output.dtype != inputs[0].dtype for op in ops):
        return f"{kind} on ranks {list(ops[0].comm)}: output dtype differs from the input's"
    count = inputs[0].numel()
    expected_out = {"all_gather_single": n * count, "reduce_scatter_single": count // n, "all_to_all_single": count}
    if kind in expected_out and (any(op.output.numel() != expected_out[kind] for op in ops) or
                                 (kind != "all_gather_single" and count % n)):
        return f"{kind} on ranks {list(ops[0].comm)}: output of {ops[0].output.numel()} elements for inputs of {count}"
    with torch.no_grad():
        if kind == "all_gather":
            for op in ops:
                for out, src in zip(op.output, inputs):
                    out.copy_(src)
        elif kind == "all_gather_single":
            for op in ops:
                op.output.view(n, -1).copy_(torch.stack([t.reshape(-1) for t in inputs]))
        elif kind == "reduce_scatter_single":
            total = _REDUCE[_reduce_name(ops[0].reduce_op)]([t.reshape(n, -1) for t in inputs])
            for i, op in enumerate(ops):
                op.output.view(-1).copy_(total[i])
        elif kind == "all_reduce":
            total = _REDUCE[_reduce_name(ops[0].reduce_op)](inputs)
            for op in ops:
                op.output.copy_(total)
        elif kind == "new_group":
            return None
        elif kind == "all_to_all_single":
            for i, op in enumerate(ops):
                out = op.output.view(n, -1)
                for j, t in enumerate(inputs):
                    out[j].copy_(t.reshape(n, -1)[i])
        else:
            return f"unknown collective {kind}"
    return None
