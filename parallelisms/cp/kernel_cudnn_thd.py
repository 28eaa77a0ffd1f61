"""cuDNN's packed-sequence (THD) attention through NVIDIA's cudnn-frontend Python graph API: the documents kernel on
Hopper, where cuDNN's fused attention runs about twice FlashAttention-2's rate (docs/gpu_step.md). torch 2.11's own
varlen cuDNN ops cannot serve training (their backward sizes its dQ accumulator wrongly and rebuilt the graph per
call), so the graphs are built here with the frontend (`nvidia-cudnn-frontend`, an optional dependency).

The convention, read from the frontend's 1.32.0 wheel (re-checked on a GPU by tests/gpu/test_gpu_cudnn_thd.py):
- a packed (T, H, D) tensor is declared as [B, H, S, D] with strides [S x token stride, head stride, token stride,
  1] and an int64 ragged offset per sequence (shape (B + 1, 1, 1, 1)), counted in ELEMENTS (cu_seqlens x token
  stride), with a padding mask of int32 seq_len_q / seq_len_kv (B, 1, 1, 1): sequences may have length 0;
- causality is a diagonal band with right bound 0, aligned top-left or bottom-right per sequence (ours are squares
  or full rectangles, so top-left);
- softmax stats are float32, the natural log of the scaled scores' sum of exponentials, written token-major (T, H, 1)
  with the ragged offset cu_seqlens x H (head-major stats with `max_total_seq_len` silently gave zero gradients on
  some backends); the backward takes the (final, merged) output and these stats, so a ring's merged out / LSE go in
  as they are;
- the backward sizes its dQ accumulator from `max_total_seq_len_q` (and K/V's), declared in the graph;
- it loads the libcudnn torch already loaded: its backend version must equal torch's, else it is refused.

Graphs cost 55 ms to 1 s to build, so they are built per shape BUCKET, never per batch: the number of sequences,
the longest sequence and the total tokens are rounded up (`ThdCall.shape`; unused batch entries get length 0: the
offsets repeat their last value), and each bucket's graph is cached for the process (`ThdGraphs.built` counts them,
reported in metrics.jsonl). A query row that sees no key would come back NaN on cuDNN < 9.25; the CP plans never
hand such rows to a kernel (an empty piece is not a call), and every sequence here has as many keys as queries or
more.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from config.errors import Refusal

THD_MIN_CUDNN = 90600
"""cuDNN 9.6: THD with GQA, int64 ragged offsets, per-sequence causal bands, token-major stats."""
THD_CAPABILITY_MAJORS = (9, 10)
"""Hopper and datacenter Blackwell: token-major ragged stats in the backward (SM 8.x / 12.x refuse them)."""
FRONTEND_MODULE = "cudnn"
BATCH_FLOOR, TOKENS_FLOOR = 16, 64
RECTANGLE_SEQ_FLOOR, RECTANGLE_TOKENS_FLOOR = 1024, 4096


def bucket(n: int, floor: int, base: int = 2) -> int:
    """The first of floor x base^i at or above n: a graph serves every shape up to it."""
    size = floor
    while size < n:
        size *= base
    return size


def thd_problem(device: torch.device, module_found) -> str | None:
    """Why cuDNN THD cannot run on `device` (None: it can). `module_found(name)`: whether a module is installed."""
    if device.type != "cuda":
        return f"cuDNN THD runs on CUDA GPUs and this run is on {device.type}"
    if not module_found(FRONTEND_MODULE):
        return "the nvidia-cudnn-frontend package (module `cudnn`) is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in THD_CAPABILITY_MAJORS:
        return f"cuDNN THD training needs compute capability 9.x or 10.x, this GPU has {major}.{minor}"
    version = torch.backends.cudnn.version() or 0
    if version < THD_MIN_CUDNN:
        return f"cuDNN THD needs cuDNN 9.6 or newer, torch has {version}"
    return None


@dataclass(frozen=True)
class ThdShape:
    """What one graph fixes (the bucket): everything else (offsets, lengths, pointers) is bound per call."""
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    max_q: int
    max_k: int
    total_q: int
    total_k: int
    q_strides: tuple[int, int]
    """(token, head) strides of q; k and v share theirs (`k_strides`); out / dO / dQ are packed contiguous."""
    k_strides: tuple[int, int]
    is_causal: bool
    scale: float
    deterministic: bool = False


class Uid:
    """The tensors' uids in every graph (the frontend binds buffers by uid)."""
    Q, K, V, O, STATS, DO, DQ, DK, DV = 1, 2, 3, 4, 5, 6, 7, 8, 9
    SEQ_Q, SEQ_K, RAG_Q, RAG_K, RAG_O, RAG_STATS, RAG_DKV = 20, 21, 22, 23, 24, 25, 26


class ThdGraphs:
    """Builds, caches and runs the forward and backward graphs of one device (one frontend handle)."""

    def __init__(self, frontend, handle):
        self.frontend, self.handle = frontend, handle
        self.graphs: dict = {}

    @property
    def built(self) -> dict[str, int]:
        """Distinct graphs built so far, per direction."""
        counts = {"forward": 0, "backward": 0}
        for direction, _ in self.graphs:
            counts[direction] += 1
        return counts

    # ---- graph construction ----
    def _declare(self, g, shape: ThdShape, backward: bool) -> dict:
        cudnn = self.frontend
        io = _io_type(cudnn, shape.dtype)
        b, h, hk, d = shape.batch, shape.heads, shape.kv_heads, shape.head_dim

        def packed(name, uid, heads, seq, strides):
            token, head = strides
            return g.tensor(name=name, dim=[b, heads, seq, d], stride=[seq * token, head, token, 1],
                            data_type=io, uid=uid)

        def column(name, uid, rows, dtype):
            return g.tensor(name=name, dim=[rows, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype, uid=uid)

        t = {"q": packed("q", Uid.Q, h, shape.max_q, shape.q_strides),
             "k": packed("k", Uid.K, hk, shape.max_k, shape.k_strides),
             "v": packed("v", Uid.V, hk, shape.max_k, shape.k_strides),
             "seq_q": column("seq_len_q", Uid.SEQ_Q, b, cudnn.data_type.INT32),
             "seq_k": column("seq_len_kv", Uid.SEQ_K, b, cudnn.data_type.INT32),
             "rag_q": column("ragged_q", Uid.RAG_Q, b + 1, cudnn.data_type.INT64),
             "rag_k": column("ragged_kv", Uid.RAG_K, b + 1, cudnn.data_type.INT64),
             "rag_o": column("ragged_o", Uid.RAG_O, b + 1, cudnn.data_type.INT64),
             "rag_stats": column("ragged_stats", Uid.RAG_STATS, b + 1, cudnn.data_type.INT64)}
        t["q"].set_ragged_offset(t["rag_q"])
        t["k"].set_ragged_offset(t["rag_k"])
        t["v"].set_ragged_offset(t["rag_k"])
        if backward:
            t["o"] = packed("o", Uid.O, h, shape.max_q, (h * d, d))
            t["do"] = packed("dO", Uid.DO, h, shape.max_q, (h * d, d))
            t["stats"] = g.tensor(name="stats", dim=[b, h, shape.max_q, 1], stride=_stats_stride(shape),
                                  data_type=cudnn.data_type.FLOAT, uid=Uid.STATS)
            for name in ("o", "do"):
                t[name].set_ragged_offset(t["rag_o"])
            t["stats"].set_ragged_offset(t["rag_stats"])
            t["rag_dkv"] = column("ragged_dkv", Uid.RAG_DKV, b + 1, cudnn.data_type.INT64)
        return t

    def _mask(self, shape: ThdShape) -> dict:
        causal = {"diagonal_alignment": self.frontend.diagonal_alignment.TOP_LEFT}
        if shape.is_causal:
            causal["diagonal_band_right_bound"] = 0
        return causal

    def _finish(self, g, shape: ThdShape, outputs: list) -> None:
        cudnn = self.frontend
        for tensor, uid, dims, stride, dtype, ragged in outputs:
            tensor.set_uid(uid).set_output(True).set_dim(dims).set_stride(stride).set_data_type(dtype)
            tensor.set_ragged_offset(ragged)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()

    def _build_forward(self, shape: ThdShape):
        cudnn = self.frontend
        g = self._graph(shape)
        t = self._declare(g, shape, backward=False)
        out, stats = g.sdpa(name="thd_forward", q=t["q"], k=t["k"], v=t["v"], generate_stats=True,
                            attn_scale=shape.scale, use_padding_mask=True, seq_len_q=t["seq_q"],
                            seq_len_kv=t["seq_k"], **self._mask(shape))
        b, h, d, s = shape.batch, shape.heads, shape.head_dim, shape.max_q
        self._finish(g, shape, [
            (out, Uid.O, [b, h, s, d], [s * h * d, d, h * d, 1], _io_type(cudnn, shape.dtype), t["rag_o"]),
            (stats, Uid.STATS, [b, h, s, 1], _stats_stride(shape), cudnn.data_type.FLOAT, t["rag_stats"])])
        return g, g.get_workspace_size()

    def _build_backward(self, shape: ThdShape):
        cudnn = self.frontend
        g = self._graph(shape)
        t = self._declare(g, shape, backward=True)
        dq, dk, dv = g.sdpa_backward(name="thd_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"],
                                     stats=t["stats"], attn_scale=shape.scale, use_padding_mask=True,
                                     seq_len_q=t["seq_q"], seq_len_kv=t["seq_k"],
                                     max_total_seq_len_q=shape.total_q, max_total_seq_len_kv=shape.total_k,
                                     use_deterministic_algorithm=shape.deterministic, **self._mask(shape))
        b, h, hk, d, sq, sk = shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.max_q, shape.max_k
        io = _io_type(cudnn, shape.dtype)
        # the gradients are allocated packed: dQ is laid out like O, dK / dV like each other (whatever q, k, v were)
        self._finish(g, shape, [(dq, Uid.DQ, [b, h, sq, d], [sq * h * d, d, h * d, 1], io, t["rag_o"]),
                                (dk, Uid.DK, [b, hk, sk, d], [sk * hk * d, d, hk * d, 1], io, t["rag_dkv"]),
                                (dv, Uid.DV, [b, hk, sk, d], [sk * hk * d, d, hk * d, 1], io, t["rag_dkv"])])
        return g, g.get_workspace_size()

    def _graph(self, shape: ThdShape):
        cudnn = self.frontend
        return cudnn.pygraph(handle=self.handle, io_data_type=_io_type(cudnn, shape.dtype),
                             intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT)

    def _cached(self, direction: str, shape: ThdShape):
        key = (direction, shape)
        if key not in self.graphs:
            build = self._build_forward if direction == "forward" else self._build_backward
            self.graphs[key] = build(shape)
        return self.graphs[key]

    # ---- calls ----
    def _execute(self, graph, workspace_size: int, buffers: dict, device) -> None:
        workspace = torch.empty(max(workspace_size, 1), dtype=torch.uint8, device=device)
        if device.type == "cuda" and hasattr(self.frontend, "set_stream"):
            self.frontend.set_stream(handle=self.handle, stream=torch.cuda.current_stream(device).cuda_stream)
        # the ordered form (buffers with their uids): the frontend caches the binding metadata by value
        graph.execute(list(buffers.values()), workspace, handle=self.handle, tensor_uids=list(buffers))

    def forward(self, q, k, v, call: "ThdCall", scale: float, deterministic: bool = False):
        """(out (Tq, Hq, D), stats (Tq, Hq, 1) float32) of packed q (Tq, Hq, D), k / v (Tk, Hkv, D) (v laid out
        like k: they share one ragged offset)."""
        _check_operands(q, k, v)
        shape = call.shape(q, k, scale, deterministic)
        graph, workspace = self._cached("forward", shape)
        out = torch.empty(q.size(0), q.size(1), v.size(2), dtype=q.dtype, device=q.device)
        stats = torch.empty(q.size(0), q.size(1), 1, dtype=torch.float32, device=q.device)
        self._execute(graph, workspace, {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: out, Uid.STATS: stats,
                                         **call.bindings(q, k)}, q.device)
        return out, stats

    def backward(self, dout, q, k, v, out, stats, call: "ThdCall", scale: float, deterministic: bool = False):
        """(dq, dk, dv), packed like q, k, v, against the FINAL out (Tq, Hq, D) and token-major stats (Tq, Hq, 1)."""
        _check_operands(q, k, v)
        shape = call.shape(q, k, scale, deterministic)
        graph, workspace = self._cached("backward", shape)
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        self._execute(graph, workspace, {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: out.contiguous(),
                                         Uid.DO: dout.contiguous(), Uid.STATS: stats.contiguous(),
                                         Uid.DQ: dq, Uid.DK: dk, Uid.DV: dv, **call.bindings(q, k, backward=True)},
                      q.device)
        return dq, dk, dv


@dataclass(frozen=True)
class ThdCall:
    """One packed call's sequences: cu_seqlens of its queries and keys (int32, on the device) and the host integers
    that pick its bucket (longest sequences; the sequence count is cu's size: no device read)."""
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    is_causal: bool
    made: dict = field(default_factory=dict, compare=False, repr=False)
    """Bindings already made, by layout (`bindings`)."""

    @property
    def sequences(self) -> int:
        return self.cu_q.numel() - 1

    def shape(self, q, k, scale: float, deterministic: bool) -> ThdShape:
        """The call's graph bucket. Causal calls (CP 1's whole batch, the ring's diagonal) round the longest
        sequence and the token count up to powers of two, so their grids stay close to the work; the fused
        rectangles of CP > 1, whose sizes vary most from batch to batch, round them to powers of four (from 1K and 4K
        tokens). The sequence count goes up in powers of four from 16 (empty entries cost a grid row each). A 20-step
        CP 2 run over changing documents then builds 6 graphs per direction (tests/parallelisms/test_cudnn_thd.py)."""
        tokens = max(q.size(0), k.size(0))
        longest = max(self.max_q, self.max_k)
        if self.is_causal:
            seq, total = bucket(longest, TOKENS_FLOOR), bucket(tokens, TOKENS_FLOOR)
        else:
            seq, total = bucket(longest, RECTANGLE_SEQ_FLOOR, 4), bucket(tokens, RECTANGLE_TOKENS_FLOOR, 4)
        return ThdShape(q.dtype, q.size(1), k.size(1), q.size(2), bucket(self.sequences, BATCH_FLOOR, 4),
                        seq, seq, total, total, (q.stride(0), q.stride(1)), (k.stride(0), k.stride(1)),
                        self.is_causal, float(scale), deterministic)

    def bindings(self, q, k, backward: bool = False) -> dict:
        """The per-call int columns, padded to the bucket's batch with length-0 sequences: seq_len_q / kv and the
        ragged offsets in elements (cu_seqlens x each tensor's token stride; stats: x heads; the backward's packed
        dK / dV: x K/V heads x head dim). Made once per call and layout (a batch's layers share one ThdCall), so
        their ~10 small kernels run once per batch, not per layer and direction."""
        key = (q.stride(0), q.size(1), q.size(2), k.stride(0), k.size(1), backward)
        if key not in self.made:
            self.made[key] = self._bindings(q, k, backward)
        return self.made[key]

    def _bindings(self, q, k, backward: bool) -> dict:
        batch = bucket(self.sequences, BATCH_FLOOR, 4)
        cu_q, cu_k = (_padded(cu, batch) for cu in (self.cu_q, self.cu_k))
        column = lambda x: x.reshape(-1, 1, 1, 1)  # noqa: E731
        q64, k64 = cu_q.to(torch.int64), cu_k.to(torch.int64)
        return {Uid.SEQ_Q: column((cu_q[1:] - cu_q[:-1]).to(torch.int32)),
                Uid.SEQ_K: column((cu_k[1:] - cu_k[:-1]).to(torch.int32)),
                Uid.RAG_Q: column(q64 * q.stride(0)), Uid.RAG_K: column(k64 * k.stride(0)),
                Uid.RAG_O: column(q64 * (q.size(1) * q.size(2))), Uid.RAG_STATS: column(q64 * q.size(1)),
                **({Uid.RAG_DKV: column(k64 * (k.size(1) * k.size(2)))} if backward else {})}


def _check_operands(q, k, v) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or v.stride() != k.stride():
        raise Refusal(f"cuDNN THD takes packed (T, H, D) q, k, v with v laid out like k, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)} {k.stride()}, {tuple(v.shape)} {v.stride()}")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise Refusal("cuDNN THD needs each token's head dim contiguous")


def _padded(cu: torch.Tensor, batch: int) -> torch.Tensor:
    """cu_seqlens (n + 1,) extended to (batch + 1,) by repeating its last offset: sequences of length 0."""
    missing = batch + 1 - cu.numel()
    return cu if missing == 0 else torch.cat([cu, cu[-1:].expand(missing)])


def _stats_stride(shape: ThdShape) -> list[int]:
    """Token-major (T, H, 1) stats declared as [B, H, S, 1]."""
    return [shape.max_q * shape.heads, 1, shape.heads, 1]


def _io_type(cudnn, dtype: torch.dtype):
    """The graph's io type. float32 only reaches here from the CPU tests' float64 stand-in: `packed_kernel` sends
    half precision only, and cuDNN itself would refuse float32 at check_support."""
    types = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16,
             torch.float32: cudnn.data_type.FLOAT}
    if dtype not in types:
        raise Refusal(f"cuDNN THD attention takes float16 / bfloat16, got {dtype}")
    return types[dtype]


@functools.lru_cache(maxsize=None)
def thd_graphs(device_index: int) -> ThdGraphs:
    """The graphs of CUDA device `device_index` (one frontend handle per device, for the process). Refuses a
    frontend that loaded another cuDNN than torch's."""
    import cudnn

    ours, theirs = torch.backends.cudnn.version(), cudnn.backend_version()
    if ours != theirs:
        raise RuntimeError(f"nvidia-cudnn-frontend runs cuDNN {theirs} but torch loaded {ours}: import torch first "
                           "and install a frontend built for torch's cuDNN, or set attention_kernel = \"flash\"")
    with torch.cuda.device(device_index):
        return ThdGraphs(cudnn, cudnn.create_handle())


PACKED_KERNELS = ("flash", "cudnn_thd")
"""The kernels of packed document sequences: FlashAttention's varlen ops (FA2, or FA3/FA4 once activated), or
cuDNN THD through the frontend."""


@functools.lru_cache(maxsize=None)
def _thd_problem_on(device_index: int) -> str | None:
    from parallelisms.cp.kernel_blocks import module_installed

    return thd_problem(torch.device("cuda", device_index), module_installed)


def packed_kernel(asked: str, q: torch.Tensor) -> str:
    """The packed-sequence kernel of document pieces for the run's `[parallelism] attention_kernel` (as asked, not
    resolved): cuDNN THD where the run takes cuDNN ("cudnn", or "auto" where torch itself prefers cuDNN: SM 9.x /
    10.x with cuDNN > 9.15) and this device serves it (half precision, head dim a multiple of 8 up to 128, the
    frontend installed, cuDNN 9.6+); FlashAttention's varlen ops otherwise. "auto" took THD once its GPU tests had
    passed on an H200 (bench/measurements/h200_documents_2026-11-28: faster per call than FA2 varlen at 8K and 64K,
    and faster trainer steps)."""
    return packed_kernel_for(asked, q.device, q.dtype, q.size(-1))


def packed_kernel_for(asked: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """`packed_kernel` from the call's device, dtype and head dim (the trainer names it at start-up)."""
    from parallelisms.cp.kernel_blocks import cudnn_serves, family_on

    if device.type != "cuda" or not cudnn_serves(dtype, head_dim, needs_mask=False):
        return "flash"
    if asked != "cudnn" and not (asked == "auto" and family_on(asked, device) == "cudnn"):
        return "flash"
    return "cudnn_thd" if _thd_problem_on(_index(device)) is None else "flash"


def documents_kernel_name(asked: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """What packed documents run on, for the start-up line and metrics.jsonl: "cudnn_thd", "flash_varlen" (CUDA,
    FA2 or FA3/FA4 once activated), or "per_document" (one block call per document: CPU, or a dtype / head dim the
    flash ops do not serve)."""
    from parallelisms.cp.kernel_blocks import FLASH_MAX_HEAD_DIM

    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim > FLASH_MAX_HEAD_DIM:
        return "per_document"
    return "cudnn_thd" if packed_kernel_for(asked, device, dtype, head_dim) == "cudnn_thd" else "flash_varlen"


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0  # fake CUDA: device 0


def graphs_for(device: torch.device) -> ThdGraphs:
    """The THD graphs of `device` (the process's handle for it)."""
    return thd_graphs(_index(device))


def default_scale(scale: float | None, head_dim: int) -> float:
    """SDPA's scale: the graph needs it as a number."""
    return float(scale) if scale is not None else head_dim ** -0.5
