"""A float64 stand-in for cudnn-frontend's Python graph API (`cudnn.pygraph` with `sdpa` / `sdpa_backward` on
packed THD tensors), so the THD orchestration (kernel_cudnn_thd.py and every CP path that calls it) can be checked on
CPU, where no cuDNN exists. It answers in the frontend's own convention, written here from its documented contract:
- tensors are declared [B, H, S, D] with strides; buffers are bound by uid at execute and read as raw memory:
  element (b, h, s, d) of a ragged tensor lies at ragged_offset[b] + h x stride[1] + s x stride[2] + d x stride[3],
  offsets counted in ELEMENTS (a byte count reads the wrong rows, or past the buffer: the test fails);
- seq_len_q / seq_len_kv (B, 1, 1, 1) int32 give each sequence's length (the padding mask; 0 allowed); ragged offsets
  are int64 (B + 1, 1, 1, 1);
- stats are float32 natural-log sums, and must be declared token-major ([S x H, 1, H, 1]): head-major stats are
  refused here, as they silently gave zero gradients on some backends;
- a causal band (right bound 0) is aligned top-left or bottom-right per sequence.
Every graph built is recorded (`graphs`), so tests can count distinct graphs and calls."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensor

data_type = SimpleNamespace(HALF="half", BFLOAT16="bfloat16", FLOAT="float", INT32="int32", INT64="int64")
heur_mode = SimpleNamespace(A="A", FALLBACK="FALLBACK")
diagonal_alignment = SimpleNamespace(TOP_LEFT="top_left", BOTTOM_RIGHT="bottom_right")
TORCH_TYPES = {"half": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32, "int32": torch.int32,
               "int64": torch.int64}


class StandInTensor:
    def __init__(self, name, dim=None, stride=None, data_type=None, uid=None):
        self.name, self.dim, self.stride, self.data_type, self.uid = name, dim, stride, data_type, uid
        self.ragged, self.output = None, False

    def set_ragged_offset(self, ragged):
        self.ragged = ragged
        return self

    def set_uid(self, uid):
        self.uid = uid
        return self

    def set_output(self, output):
        self.output = output
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, data_type):
        self.data_type = data_type
        return self


class StandInGraph:
    def __init__(self, frontend, io_data_type, intermediate_data_type, compute_data_type, handle=None):
        assert intermediate_data_type == compute_data_type == data_type.FLOAT
        self.frontend, self.io = frontend, io_data_type
        self.node, self.built = None, []

    def tensor(self, name, dim, stride, data_type, uid):
        assert len(dim) == len(stride) == 4, (name, dim, stride)
        return StandInTensor(name, list(dim), list(stride), data_type, uid)

    def sdpa(self, name, q, k, v, generate_stats, attn_scale, use_padding_mask, seq_len_q, seq_len_kv,
             diagonal_alignment, diagonal_band_right_bound=None, **unused):
        assert generate_stats and use_padding_mask and not unused, unused
        self.node = ("forward", dict(q=q, k=k, v=v, scale=attn_scale, seq_q=seq_len_q, seq_k=seq_len_kv,
                                     align=diagonal_alignment, causal=diagonal_band_right_bound == 0))
        self.outputs = (StandInTensor("o"), StandInTensor("stats"))
        return self.outputs

    def sdpa_backward(self, name, q, k, v, o, dO, stats, attn_scale, use_padding_mask, seq_len_q, seq_len_kv,
                      max_total_seq_len_q, max_total_seq_len_kv, use_deterministic_algorithm, diagonal_alignment,
                      diagonal_band_right_bound=None, **unused):
        assert use_padding_mask and not unused, unused
        self.node = ("backward", dict(q=q, k=k, v=v, o=o, do=dO, stats=stats, scale=attn_scale, seq_q=seq_len_q,
                                      seq_k=seq_len_kv, align=diagonal_alignment,
                                      causal=diagonal_band_right_bound == 0, total_q=max_total_seq_len_q,
                                      total_k=max_total_seq_len_kv))
        self.outputs = (StandInTensor("dq"), StandInTensor("dk"), StandInTensor("dv"))
        return self.outputs

    def validate(self):
        self.built.append("validate")

    def build_operation_graph(self):
        self.built.append("build_operation_graph")

    def create_execution_plans(self, modes):
        assert modes, "no heuristics mode"

    def check_support(self):
        pass

    def build_plans(self):
        self.frontend.graphs.append(self)

    def get_workspace_size(self):
        return 0

    def execute(self, buffers, workspace, handle=None, tensor_uids=None):
        """`buffers`: {uid: tensor}, or a list of tensors with their `tensor_uids` (the frontend's two forms)."""
        if tensor_uids is not None:
            assert len(set(tensor_uids)) == len(tensor_uids) == len(buffers), "uids must be distinct, one per buffer"
            buffers = dict(zip(tensor_uids, buffers))
        direction, t = self.node
        self.frontend.calls.append(direction)
        _check_bindings(self, t, buffers)
        if any(isinstance(b, FakeTensor) for b in buffers.values()):
            return  # fake CUDA: the bindings' metadata checked, nothing to compute
        (_forward if direction == "forward" else _backward)(self, t, buffers)


def _check_bindings(graph: StandInGraph, t: dict, buffers: dict) -> None:
    """What the frontend would take on trust, checked from the tensors' metadata alone (so on fake CUDA too): every
    declared uid bound once and nothing else; each buffer's dtype the declared one; all on one device; the int
    columns (B, 1, 1, 1) / (B + 1, 1, 1, 1); each packed tensor a (T, H, D) buffer whose head and token strides are
    the declared ones, with H and D as declared (a raw pointer has no strides of its own: a buffer laid out otherwise
    is read wrong without an error)."""
    declared = {}
    for tensor in [*(v for v in t.values() if isinstance(v, StandInTensor)), *graph.outputs]:
        for one in (tensor, tensor.ragged):
            if one is not None:
                declared[one.uid] = one
    assert set(buffers) == set(declared), f"bound uids {sorted(buffers)} != declared {sorted(declared)}"
    assert len({b.device for b in buffers.values()}) == 1, {u: b.device for u, b in buffers.items()}
    for uid, tensor in declared.items():
        buf = buffers[uid]
        assert buf.dtype == TORCH_TYPES[tensor.data_type], (tensor.name, buf.dtype, tensor.data_type)
        b, h, _, d = tensor.dim
        if tensor.ragged is None:  # an int column
            assert tuple(buf.shape) == (b, 1, 1, 1), (tensor.name, tuple(buf.shape))
            continue
        if tensor.name == "stats":
            _check_stats(tensor)  # its own message: the mistake the frontend does not report
        _, head_stride, token_stride, one = tensor.stride
        assert one == 1 and buf.dim() == 3 and tuple(buf.shape[1:]) == (h, d), (tensor.name, tuple(buf.shape))
        assert (buf.stride(0), buf.stride(1), buf.stride(2)) == (token_stride, head_stride, 1) or buf.size(0) <= 1, (
            f"{tensor.name}: bound with strides {buf.stride()}, declared token {token_stride} head {head_stride}")


def _check_stats(stats: StandInTensor) -> None:
    b, h, s, one = stats.dim
    assert one == 1 and stats.stride == [s * h, 1, h, 1], (
        f"stats must be declared token-major (T, H, 1): stride [S*H, 1, H, 1], got {stats.stride}")


def _column(buffers, tensor: StandInTensor, dtype, rows: int) -> torch.Tensor:
    buf = buffers[tensor.uid]
    assert buf.dtype == dtype and tuple(buf.shape) == (rows, 1, 1, 1), (tensor.name, buf.dtype, tuple(buf.shape))
    return buf.reshape(-1)


def _flat(buf: torch.Tensor) -> torch.Tensor:
    """The raw memory a device pointer to `buf` would address, as a flat view (from its first element on)."""
    size = buf.untyped_storage().nbytes() // buf.element_size() - buf.storage_offset()
    return buf.as_strided((size,), (1,), buf.storage_offset())


def _index(tensor: StandInTensor, start: int, length: int) -> torch.Tensor:
    """(length, H, D) element indices of one sequence of a ragged tensor."""
    _, h, _, d = tensor.dim
    _, sh, st, sd = tensor.stride
    return (start + torch.arange(length)[:, None, None] * st + torch.arange(h)[None, :, None] * sh
            + torch.arange(d)[None, None, :] * sd)


def _sequences(t: dict, buffers: dict, ragged_of: dict):
    """Per sequence: its length in queries and keys and each ragged tensor's start (elements)."""
    b = t["q"].dim[0]
    seq_q = _column(buffers, t["seq_q"], torch.int32, b)
    seq_k = _column(buffers, t["seq_k"], torch.int32, b)
    starts = {name: _column(buffers, tensor.ragged, torch.int64, b + 1) for name, tensor in ragged_of.items()}
    for i in range(b):
        lq, lk = int(seq_q[i]), int(seq_k[i])
        assert lq <= t["q"].dim[2] and lk <= t["k"].dim[2], "a sequence longer than the graph's declared S"
        yield lq, lk, {name: int(s[i]) for name, s in starts.items()}


def _read(buffers, tensor: StandInTensor, start: int, length: int) -> torch.Tensor:
    flat = _flat(buffers[tensor.uid])
    index = _index(tensor, start, length)
    assert index.numel() == 0 or int(index.max()) < flat.numel(), f"{tensor.name}: read past the buffer"
    return flat[index].double()


def _write(buffers, tensor: StandInTensor, start: int, values: torch.Tensor) -> None:
    flat = _flat(buffers[tensor.uid])
    index = _index(tensor, start, values.size(0))
    assert index.numel() == 0 or int(index.max()) < flat.numel(), f"{tensor.name}: write past the buffer"
    flat[index] = values.to(flat.dtype)


def _probabilities(q, k, scale, causal, align):
    """(H, Lq, Lk) float64 scores of one sequence, K expanded over query-head groups, with the causal band."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        lq, lk = q.size(0), k.size(0)
        shift = lk - lq if align == diagonal_alignment.BOTTOM_RIGHT else 0
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + shift
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _forward(graph, t, buffers):
    o, stats = graph.outputs
    _check_stats(stats)
    for lq, lk, at in _sequences(t, buffers, {"q": t["q"], "k": t["k"], "o": o, "stats": stats}):
        if lq == 0:
            continue
        q = _read(buffers, t["q"], at["q"], lq)
        k, v = (_read(buffers, t[n], at["k"], lk) for n in ("k", "v"))
        s = _probabilities(q, k, t["scale"], t["causal"], t["align"])
        lse = torch.logsumexp(s, dim=-1)  # (H, Lq)
        vs = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        _write(buffers, o, at["o"], torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vs))
        _write(buffers, stats, at["stats"], lse.T[..., None])


def _backward(graph, t, buffers):
    dq_t, dk_t, dv_t = graph.outputs
    _check_stats(t["stats"])
    ragged = {"q": t["q"], "k": t["k"], "o": t["o"], "stats": t["stats"], "dq": dq_t, "dk": dk_t, "dv": dv_t}
    for tensor in (dq_t, dk_t, dv_t):
        _flat(buffers[tensor.uid]).zero_()
    for lq, lk, at in _sequences(t, buffers, ragged):
        if lq == 0:
            continue
        assert at["q"] // t["q"].stride[2] + lq <= t["total_q"], "max_total_seq_len_q below the tokens it holds"
        q, o, do = (_read(buffers, t[n], at["q" if n == "q" else "o"], lq) for n in ("q", "o", "do"))
        k, v = (_read(buffers, t[n], at["k"], lk) for n in ("k", "v"))
        lse = _read(buffers, t["stats"], at["stats"], lq)[..., 0].T  # (H, Lq)
        groups = q.size(1) // k.size(1)
        p = torch.exp(_probabilities(q, k, t["scale"], t["causal"], t["align"]) - lse[..., None])
        ks, vs = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        dv_h = torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, vs)
        ds = p * (dp - (do * o).sum(-1).T[..., None])
        dq = torch.einsum("hqk,khd->qhd", ds, ks) * t["scale"]
        dk_h = torch.einsum("hqk,qhd->khd", ds, q) * t["scale"]
        fold = lambda g: g.view(g.size(0), k.size(1), groups, g.size(2)).sum(2)  # noqa: E731
        _write(buffers, dq_t, at["dq"], dq)
        _write(buffers, dk_t, at["dk"], fold(dk_h))
        _write(buffers, dv_t, at["dv"], fold(dv_h))


class StandInFrontend:
    """What kernel_cudnn_thd.ThdGraphs uses of the `cudnn` module."""
    data_type, heur_mode, diagonal_alignment = data_type, heur_mode, diagonal_alignment

    def __init__(self):
        self.graphs: list[StandInGraph] = []
        self.calls: list[str] = []

    def pygraph(self, handle=None, io_data_type=None, intermediate_data_type=None, compute_data_type=None):
        return StandInGraph(self, io_data_type, intermediate_data_type, compute_data_type, handle)
