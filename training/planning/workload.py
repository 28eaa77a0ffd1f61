"""The one input every price of a step reads: what one rank runs in one optimizer step (`Workload`), built from a
resolved recipe stage in one place (`workload_for`), with the byte formulas of its collectives written once.

Why one file: the roofline bound (roofline.py), the calibrated prediction (price.py), the ramp planner and the
trainer's logged `fsdp_comm_bytes` (training/metrics.py) all price the same layout, parameter count, FSDP / TP / ring
bytes and documents; written once here, they cannot drift apart (they did: `//` in one copy, `/` in the other, float8
all-gathers in one and not the other). Documents: one set of lengths (`document_lengths`) cut into rows as the packer
cuts them (`document_row_pieces`) prices both the CP 1 packed calls and the ring's visible pairs, and the CUDA-path
table (cuda_path_table.py) counts on a row of the same lengths.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from models.llama import LlamaConfig, recipe_model_config
from training.planning import documents_cost
from training.planning.accelerators import kernel_on
from training.planning.float8_cost import converted_params_per_block

DOCUMENT_MIX = ((0.5, None), (0.5, 4096))
"""Without the recipe's prepared stores: half the tokens in documents at least a row long (plain causal over the
row), half in 4,096-token documents (a ProLong-like long-document mix). (share of tokens, document length)."""


@dataclass(frozen=True)
class Layout:
    """The parallel degrees and how many GPUs share a node."""
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def intra_node(self, span: int) -> bool:
        """Whether a group spanning `span` consecutive ranks fits in one node (mesh order, outer to inner: pp,
        dp_replicate, dp_shard, cp, tp): then its ring stays on NVLink, else it crosses the network."""
        return span <= self.gpus_per_node


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one rank runs in one optimizer step (the recipe, resolved); built by keyword only."""
    model: LlamaConfig
    layout: Layout
    seq_len: int
    local_batch_size: int
    grad_accum: int
    dtype: str = "bfloat16"
    ac_mode: str = "none"
    ac_every: int = 2
    compile: bool = False
    loss_chunk_tokens: int = 0
    reshard_after_forward: bool = True
    visible_pair_fraction: float | None = None
    """Visible (query, key) pairs / S^2 per row; None = plain causal."""
    attention_length: float | None = None
    """Tokens of one attention call's blocks (documents shorter than S / cp shorten it); None = S / cp."""
    cp_ring_bytes: float | None = None
    """The ring's sends per micro-batch, measured by the dry run; None = estimated from the K/V sizes."""
    offload_bytes: float = 0.0
    """Host bytes per micro-batch (activation offload), each way over PCIe."""
    offload_prefetch: bool = True
    """The copies back under the previous block's compute; off: each one waited for (activation_checkpoint)."""
    sublayer_groups: bool = False
    """The attention sublayer in head groups (parallelism.attention_sublayer_groups > 1 under CP): its backward
    projects q, k and v again from the saved input (parallelisms/sublayer_groups.py)."""
    attention_kernel: str = "flash"
    """The kernel family the attention runs (`stage_attention_kernel`): "cudnn" is priced at cuDNN's rate."""
    document_pieces: tuple[tuple[int, float], ...] | None = None
    """Document masking: ((piece length, pieces per row), ...) of the recipe's documents cut into rows as the packer
    cuts them (documents_cost.row_pieces); at CP 1 each layer's packed call is priced piece by piece."""
    documents_kernel: str = "flash_varlen"
    """What the packed calls of documents run (`stage_documents_kernel`): cudnn_thd or flash_varlen."""
    float8: str = "off"
    """training.float8: the blocks' converted linear layers priced in float8 (training/planning/float8_cost.py)."""
    tiled_mlp: bool = False
    """model.mlp_chunk_tokens > 0: the feed-forward stays in the training dtype under float8."""
    bandwidth_bytes: float | None = None
    """HBM bytes of one micro-step's elementwise kernels, copies and casts as the trainer launches them eagerly,
    counted by the dry run's memory probe (training/planning/fake/counter.py); None = the per-op formula."""

    @property
    def act_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def micro_tokens(self) -> float:
        """Tokens of one micro-batch on one rank, before TP splits the work."""
        return self.local_batch_size * self.seq_len / self.layout.cp


def parameter_count(m: LlamaConfig) -> float:
    """Every parameter, embeddings and output included (once when tied); q/k/v biases and q/k norms too."""
    block = m.dim * m.head_dim * (2 * m.n_heads + 2 * m.num_kv_heads) + 3 * m.dim * m.ffn_hidden_dim + 2 * m.dim
    block += (m.n_heads + 2 * m.num_kv_heads) * m.head_dim * m.qkv_bias + 2 * m.head_dim * m.qk_norm
    return m.n_layers * block + (1 if m.tie_embeddings else 2) * m.dim * m.vocab_size + m.dim


def recomputed_block_fraction(ac_mode: str, every: int) -> float:
    """Share of block forwards that activation checkpointing runs twice (op-level AC recomputes no matmul)."""
    return {"full": 1.0, "selective": 1.0 / max(1, every)}.get(ac_mode, 0.0)


def float8_gathered_params(m: LlamaConfig, float8: str, tiled_mlp: bool) -> float:
    """Parameters (of the whole model) FSDP2 all-gathers in float8: tensorwise scaling casts each converted weight's
    shard before the gather (parallelisms/float8.float8_config); rowwise gathers in the training dtype."""
    return converted_params_per_block(m, tiled_mlp) * m.n_layers if float8 == "tensorwise" else 0.0


def fsdp_bytes_per_step(m: LlamaConfig, layout: Layout, dtype: str, grad_accum: int,
                        reshard_after_forward: bool, float8_params: float = 0.0) -> tuple[float, float]:
    """Bytes one rank sends for FSDP in one step: (within its dp_shard x cp group, across dp_replicate replicas).
    Per micro-batch: an all-gather of the parameters in the compute dtype for forward (and again for backward when
    resharded after forward) and a float32 reduce-scatter of the gradients; HSDP all-reduces the float32 shards.
    `float8_params` (of the whole model) are all-gathered in float8, 1 byte each (`float8_gathered_params`)."""
    lay = layout
    n, r = lay.dp_shard * lay.cp, lay.dp_replicate
    params = parameter_count(m) / (lay.pp * lay.tp)
    param_bytes = 4 if dtype == "float32" else 2
    gathered = params * param_bytes - float8_params / (lay.pp * lay.tp) * (param_bytes - 1)
    shard = (n - 1) / n * ((2 if reshard_after_forward else 1) * gathered + params * 4) * grad_accum
    replicate = 2 * params / n * 4 * (r - 1) / r
    return shard, replicate


def comm_bytes(w: Workload) -> dict[str, tuple[float, int]]:
    """{collective: (bytes one rank sends per step, consecutive ranks its group spans)}; the span says NVLink or
    network (`Layout.intra_node`). The roofline sums them per link; the prediction exposes each its own way."""
    m, lay = w.model, w.layout
    n, layers = lay.dp_shard * lay.cp, m.n_layers / lay.pp
    shard, replicate = fsdp_bytes_per_step(m, lay, w.dtype, w.grad_accum, w.reshard_after_forward,
                                           float8_gathered_params(m, w.float8, w.tiled_mlp))
    out = {"fsdp": (shard, n * lay.tp), "fsdp_replicate": (replicate, lay.dp_replicate * n * lay.tp)}
    recompute = recomputed_block_fraction(w.ac_mode, w.ac_every)
    if lay.tp > 1:  # sequence parallel: 2 all-gathers + 2 reduce-scatters per block forward, as many in backward
        per_layer = (8 + 4 * recompute) * w.micro_tokens * m.dim * w.act_bytes * (lay.tp - 1) / lay.tp
        out["tp"] = (per_layer * layers * w.grad_accum, lay.tp)
    if lay.cp > 1:  # measured sends, else K/V blocks (cp - 1 hops) forward, K/V plus float32 dK/dV backward
        ring = w.cp_ring_bytes
        if ring is None:
            kv = 2 * w.micro_tokens * m.num_kv_heads * m.head_dim / lay.tp
            ring = layers * (lay.cp - 1) * ((1 + recompute) * kv * w.act_bytes + kv * (w.act_bytes + 4))
        out["ring"] = (ring * w.grad_accum, lay.cp * lay.tp)
    if lay.pp > 1:  # one activation and its gradient per micro-batch cross each stage boundary
        out["pp"] = (2 * w.micro_tokens * m.dim * w.act_bytes / lay.tp * w.grad_accum, lay.world)
    return out


def workload_for(cfg, dims, gpus_per_node: int, cp_ring_bytes: float | None = None, offload_bytes: float = 0.0,
                 bandwidth_bytes: float | None = None) -> Workload:
    """The Workload of one resolved recipe stage; with document masking, the pieces of the recipe's documents
    (`document_row_pieces`) and their visible pairs. `cp_ring_bytes`, `offload_bytes`, `bandwidth_bytes`: the
    memory probe's."""
    t, p = cfg.training, cfg.parallelism
    fraction = length = pieces = None
    if cfg.data.document_masking:
        pieces = document_row_pieces(cfg, t.seq_len)
        fraction, doc_length = pieces_pairs(pieces, t.seq_len)
        length = min(doc_length, t.seq_len / dims.cp)
    mcfg = recipe_model_config(cfg)
    return Workload(
        model=mcfg, layout=Layout(dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, gpus_per_node),
        seq_len=t.seq_len, local_batch_size=t.local_batch_size, grad_accum=t.grad_accum_steps(dims.dp),
        dtype=t.dtype, ac_mode=cfg.activation_checkpoint.mode, ac_every=cfg.activation_checkpoint.every,
        compile=t.compiles("cuda"), loss_chunk_tokens=t.loss_tile_tokens(mcfg.vocab_size),
        reshard_after_forward=p.reshard_after_forward, visible_pair_fraction=fraction, attention_length=length,
        cp_ring_bytes=cp_ring_bytes, offload_bytes=offload_bytes, attention_kernel=stage_attention_kernel(cfg),
        offload_prefetch=cfg.activation_checkpoint.offload_prefetch,
        sublayer_groups=p.attention_sublayer_groups > 1 and (dims.cp > 1 or cfg.data.document_masking),
        document_pieces=pieces, documents_kernel=stage_documents_kernel(cfg),
        float8=t.float8, tiled_mlp=cfg.model.mlp_chunk_tokens > 0, bandwidth_bytes=bandwidth_bytes)


def stage_attention_kernel(cfg) -> str:
    """The kernel family a stage's attention runs on the recipe's accelerator: float32 the memory-efficient kernel,
    packed documents the flash varlen calls; otherwise `parallelism.attention_kernel` resolved by the accelerator's
    compute capability (auto: cuDNN on H100/H200), which the trainer also hands to SDPA as its backend order."""
    if cfg.training.dtype == "float32":
        return "efficient"  # flash and cuDNN are half precision only: the memory-efficient kernel
    if cfg.data.document_masking:
        return "flash"
    return kernel_on(cfg.hardware.accelerator, cfg.parallelism.attention_kernel)


def stage_documents_kernel(cfg) -> str:
    """What a stage's packed documents run on its accelerator (parallelisms/cp/kernel_cudnn_thd.packed_kernel_for):
    cuDNN THD where the run takes cuDNN (`attention_kernel` resolved on the accelerator), in half precision, with a
    head dim cuDNN serves; FlashAttention-2 varlen otherwise. THD needs nvidia-cudnn-frontend on the nodes
    (requirements-gpu.txt): without it the run takes FA2 varlen, as the dry run's documents line says."""
    head_dim = recipe_model_config(cfg).head_dim
    half = cfg.training.dtype in ("bfloat16", "float16")
    cudnn = kernel_on(cfg.hardware.accelerator, cfg.parallelism.attention_kernel) == "cudnn"
    return "cudnn_thd" if half and cudnn and head_dim % 8 == 0 and head_dim <= 128 else "flash_varlen"


def document_row_pieces(cfg, seq_len: int) -> tuple[tuple[int, float], ...]:
    """((piece length, pieces per row), ...) of rows packed from the recipe's documents (`document_lengths`, sources
    weighted by `weight`), else from DOCUMENT_MIX's documents, cut as the packer cuts them (documents_cost.row_pieces):
    the one cut model of the CP 1 pricing (piece by piece) and the ring's (`pieces_pairs`)."""
    stores = document_lengths(cfg) or {"mix": mix_lengths(seq_len)}
    weights = {name: 1.0 for name in stores} | {s.name: s.weight for s in cfg.data.sources}
    total = sum(weights[name] for name in stores)
    pieces: dict[int, float] = {}
    for name, lengths in stores.items():
        for length, count in documents_cost.row_pieces(lengths, seq_len).items():
            pieces[length] = pieces.get(length, 0.0) + weights[name] / total * count
    return tuple(sorted(pieces.items()))


def pieces_pairs(pieces: tuple[tuple[int, float], ...], seq_len: int) -> tuple[float, float]:
    """(visible pairs / S^2, pair-weighted piece length) of rows of `pieces`: causal inside each piece."""
    pairs = [(count * length * (length + 1) / 2, length) for length, count in pieces]
    total = sum(p for p, _ in pairs)
    return total / seq_len ** 2, sum(p * length for p, length in pairs) / total


def mix_lengths(seq_len: int, mix=DOCUMENT_MIX, rows: int | None = None) -> np.ndarray:
    """Document lengths that pack, in order, into `rows` rows of `mix` (default: as few as give each share whole
    rows, so that no document of one share is cut by another's): each share fills its share of the tokens with
    documents of its length (None: one document of all of them, plain causal over its rows), the last one shorter."""
    rows = rows or round(1 / min(share for share, _ in mix))
    lengths = []
    for share, length in mix:
        left = round(share * rows * seq_len)
        step = min(length or left, left) or 1
        lengths += [step] * (left // step) + ([left % step] if left % step else [])
    lengths[-1] += rows * seq_len - sum(lengths)
    return np.array(lengths, dtype=np.int64)


def document_lengths(cfg) -> dict[str, np.ndarray] | None:
    """{source: its documents' token counts}: the prepared stores, opened as the trainer opens them (this tokenizer,
    these files), else, where every source is Python's built-in pydoc corpus (79 documents), that corpus tokenized
    here with the recipe's tokenizer (~0.3 s; the stores' document filters are not applied); None: the stated mix
    (a store or tokenizer that is not here: the dry run's data usually lives where the recipe will run)."""
    import os

    from data.corpus import PYDOC, pydoc_documents
    from data.prepare import open_store
    from data.sources import build_run_tokenizer, source_list, store_specs
    sources = source_list(cfg)
    pydoc = all(list(s.path) == [PYDOC] and s.format == "text" for s in sources)
    prepared = cfg.data.cache_dir and cfg.data.tokenizer_path and os.path.exists(cfg.data.tokenizer_path)
    tokenizer = stores = None
    try:
        if prepared or pydoc:
            tokenizer = build_run_tokenizer(cfg, recipe_model_config(cfg).vocab_size)
        if prepared:
            stores = {spec.name: open_store(spec, tokenizer) for spec in store_specs(cfg)}
    except Exception:  # noqa: BLE001 - a tokenizer that does not load here, a missing or stale store: the next choice
        pass
    if stores and all(s is not None and s.num_documents > 0 for s in stores.values()):
        return {name: s.doc_lengths.astype(np.int64) for name, s in stores.items()}
    if not pydoc or tokenizer is None:
        return None
    lengths = np.array([len(ids) for ids in tokenizer.encode_batch(pydoc_documents())], dtype=np.int64)
    return {s.name: lengths for s in sources}
