"""One rank's memory for one training step of a recipe, measured without a GPU and without the memory.

The rank joins a fake process group of the recipe's world size (collectives return at once, in one process), the
real model is built on the meta device and given to the real composer (TP, activation checkpointing, FSDP2), then
materialised as fake tensors (shapes and dtypes, no storage). One optimizer step runs under torch's FSDPMemTracker,
which sees every tensor the step creates and frees, including FSDP's all-gather buffers, checkpoint recomputation,
ring-attention blocks and the optimizer's temporaries. Nothing here is estimated from formulas.

Two phases are measured with separate trackers, forward+backward and gradient clipping + optimizer step, because a
step peaks in one or the other and each grows linearly with the number of (identical) blocks: `measure_memory` can
therefore measure 3, 4 and 5 blocks, check that they lie on one line, and extrapolate exactly to the full depth,
which keeps a 1M-token, CP-64 probe fast.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule

from config.schema import Config
from models.llama import Llama, recipe_model_config
from parallelisms.context_parallel import CommStats
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize, uses_loss_parallel
from parallelisms.stage_meshes import add_hybrid_subgroups
from parallelisms.cp.layouts import DOCUMENTS
from training import step
from training.build import build_optimizer, stage_ulysses_degree
from training.planning.eval_memory import measure_eval_peak
from training.planning.op_census import OpCensus
from training.step import StepSetup, clip_grad_norm_

GIB = 2**30


@dataclass
class RankMemory:
    """One rank's bytes for one optimizer step. The persistent state (params, grads, optimizer) is read after the
    optimizer step, when all of it exists; `peak` is the most the step ever held at once."""
    params: float
    """Parameters as this rank stores them (FSDP/TP shards), plus buffers."""
    grads: float
    """Gradients of those shards."""
    optimizer: float
    """AdamW state (two moments per parameter element)."""
    peak_forward_backward: float
    peak_optimizer_step: float
    cp_ring_bytes: float | None
    """Bytes this rank's ring attention sent in one micro-batch (forward, backward and any recomputation)."""
    blocks_measured: tuple[int, ...]
    host: float = 0.0
    """Peak bytes of offloaded block inputs in host memory (activation_checkpoint.offload); not part of `peak`."""
    peak_eval: float = 0.0
    """The most the stage's evaluations hold at once (training/planning/eval_memory.py); 0 when the stage runs none."""
    bandwidth_bytes: float = 0.0
    """HBM bytes of one micro-step's forward and backward in kernels priced by bandwidth (elementwise, copies and
    casts; training/planning/op_census.py), as this step launches them eagerly: the step model's elementwise time."""
    kernels: float = 0.0
    """Kernel-launching ops in one micro-step's forward and backward (op_census.OpCensus.kernels)."""

    @property
    def train_peak(self) -> float:
        return max(self.peak_forward_backward, self.peak_optimizer_step)

    @property
    def peak(self) -> float:
        """The stage's device peak: its training step or its evaluations, whichever holds more."""
        return max(self.train_peak, self.peak_eval)

    @property
    def peak_phase(self) -> str:
        if self.peak_eval > self.train_peak:
            return "evaluation"
        return "forward/backward" if self.peak_forward_backward >= self.peak_optimizer_step else "optimizer step"

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def activations(self) -> float:
        """Everything at the peak beyond the persistent state: saved activations, recomputation, logits and loss,
        gathered parameters and communication buffers (FSDP, ring attention)."""
        return self.peak - self.state

    def agrees_with(self, other: "RankMemory", rel: float = 1e-6) -> bool:
        names = ("params", "grads", "optimizer", "peak_forward_backward", "peak_optimizer_step", "cp_ring_bytes",
                 "host", "peak_eval")
        pairs = [(getattr(self, n), getattr(other, n)) for n in names]
        return all(a == b or abs(a - b) <= rel * max(abs(a), abs(b)) for a, b in pairs if a is not None)

    def extrapolate(self, deeper: "RankMemory", extra_blocks: float) -> "RankMemory":
        """self measured at d blocks, `deeper` at d + 1: every number is affine in the depth."""
        def line(a, b):
            return None if a is None else a + extra_blocks * (b - a)
        names = ("params", "grads", "optimizer", "peak_forward_backward", "peak_optimizer_step", "cp_ring_bytes",
                 "host", "peak_eval", "bandwidth_bytes", "kernels")
        values = {n: line(getattr(self, n), getattr(deeper, n)) for n in names}
        return RankMemory(**values, blocks_measured=self.blocks_measured + deeper.blocks_measured)


def _kind(category: str) -> str:
    name = category.lower()
    if "opt" in name:
        return "optimizer"
    if "grad" in name or "reduce scatter" in name:
        return "grads"
    if "param" in name or "all gather" in name or "buffer" in name:
        return "params"
    return "activations"


def _by_kind(snapshot: dict) -> dict[str, float]:
    """A tracker snapshot {device: {category: bytes}} summed into params / grads / optimizer / activations / Total."""
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0, "Total": 0.0}
    for per_device in snapshot.values():
        for category, nbytes in per_device.items():
            name = getattr(category, "value", category)
            out["Total" if name == "Total" else _kind(name)] += nbytes
    return out


def _tracker(model, optimizer):
    if isinstance(model, FSDPModule):
        return FSDPMemTracker(model, optimizer)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


@contextlib.contextmanager
def _sharding_propagation_in_its_own_fake_mode():
    """DTensor derives each op's output shape by running it on global-shape placeholders in `detect_fake_mode() or
    FakeTensorMode()`, uncached under a fake mode. On a real rank that is a throwaway fake mode, which the trackers
    skip; under the probe's FakeTensorMode it is the probe's own mode, so they counted the placeholders as this rank's
    memory (fp32 tp2: AdamW's foreach ops put full-size copies of every parameter at the optimizer step's peak, 53.5
    MiB predicted vs 27.3 MiB real). With this the probe's DTensor ops propagate as a real rank's do."""
    from torch.distributed.tensor import _sharding_prop

    saved = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = saved


def fake_batch(cfg: Config, device: str = "cpu") -> dict:
    t = cfg.training
    shape = (t.local_batch_size, t.seq_len)
    return {"input_ids": torch.zeros(shape, dtype=torch.long, device=device),
            "labels": torch.zeros(shape, dtype=torch.long, device=device),
            "position_ids": torch.arange(t.seq_len, device=device).expand(shape).clone(),
            "document_ids": torch.zeros(shape, dtype=torch.long, device=device)}


@dataclass
class FakeRank:
    """One rank's model, optimizer and step setup on fake tensors, as a training rank holds them after its first
    optimizer step (AdamW's state exists)."""
    cfg: Config
    model_config: object
    """The model's ModelConfig (models/llama.py), as recipe_model_config made it."""
    model: torch.nn.Module
    params: list
    optimizer: torch.optim.Optimizer
    setup: StepSetup
    global_tokens: int
    """Tokens of the global batch: the loss normaliser micro_step takes."""
    accum_steps: int
    """Micro-steps per optimizer step on this rank."""


@contextlib.contextmanager
def fake_rank(cfg: Config, world_size: int, rank: int = 0, device: str = "cpu"):
    """Rank `rank` of a fake process group of `world_size` (collectives return at once, in one process) with the
    recipe's real model built on the meta device, given to the real composer (TP, activation checkpointing, FSDP2) and
    materialised as fake tensors (shapes and dtypes, no storage); yields a `FakeRank` inside the fake mode.

    The micro-step is the trainer's own (training/step.py), without document masking: document ids are data, and
    fake tensors hold none (a masked ring skips blocks, so causal attention is the upper bound). The documents CP
    layout is measured as its row of one document, zigzag's layout: the same S / P tokens per rank. `device`: "cpu",
    or "cuda" in a process with training/planning/step_sync_probe.py's fake CUDA runtime preloaded (world 1:
    bench/bench_step_kernels.py)."""
    # Lazy: torch's internal testing package (it registers the "fake" backend) is needed by the probes only, and
    # this module is imported by every training rank through train.py.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    excepthook = sys.excepthook  # init_process_group wraps it in a "[rankN]: " prefixer: once per probe otherwise
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        p, t = cfg.parallelism, cfg.training
        dims = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, world_size, where=cfg.recipe_path)
        mcfg = recipe_model_config(cfg)
        mesh = dims.build_mesh(device)
        add_hybrid_subgroups(mesh, stage_ulysses_degree(cfg, mcfg, mesh, device))  # as the trainer makes them at setup
        with torch.device("meta"):
            model = Llama(mcfg)
        if device == "cpu":
            model = parallelize(model, mesh, cfg)
        if p.cp_load_balancer == DOCUMENTS:  # no ids to plan from: its one-document row, which is zigzag's layout
            p = dataclasses.replace(p, cp_load_balancer="zigzag")
        with FakeTensorMode(allow_non_fake_inputs=True), _sharding_propagation_in_its_own_fake_mode():
            if device != "cpu":  # in the mode: FSDP2 makes its (empty) buffers on the device
                model = parallelize(model, mesh, cfg)
            setup = StepSetup(model, mesh, p, document_masking=False, loss_parallel=uses_loss_parallel(cfg, mesh),
                              stats=CommStats(), loss_chunk_tokens=t.loss_tile_tokens(mcfg.vocab_size))
            model.to_empty(device=device)  # without FSDP float32 (one-device bf16 is autocast)
            params = list(model.parameters())
            optimizer, _ = build_optimizer(cfg, [model], device_type="cuda")  # as on the GPU it plans for
            # Create AdamW's state (and warm DTensor's sharding caches) before measuring: in training it exists from
            # the first step on, so every later step peaks with it in memory.
            for param in params:
                param.grad = torch.zeros_like(param)
            clip_grad_norm_(params, t.max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            yield FakeRank(cfg, mcfg, model, params, optimizer, setup, t.global_batch_rows(dims.dp) * t.seq_len,
                           t.grad_accum_steps(dims.dp))
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        _forget_dtensor_caches()


@contextlib.contextmanager
def _compiled_casts_uncounted(cfg: Config, census: OpCensus):
    """With float8 under torch.compile, torchao's scaling and casting of each GEMM operand runs fused inside the
    compiled regions: the census leaves those ops out (the step model prices them fused, float8_cost.cast_bytes).
    Eagerly they run op by op and are counted like every other kernel. FSDP2's float8 all-gather casts its weights
    before the all-gather, outside any compiled region, and stays counted."""
    if cfg.training.float8 == "off" or not cfg.training.compiles("cuda"):
        yield
        return
    import torchao.float8.float8_linear as float8_linear

    cast = float8_linear.hp_tensor_to_float8_dynamic

    def uncounted_cast(*args, **kwargs):
        with census.uncounted():
            return cast(*args, **kwargs)

    float8_linear.hp_tensor_to_float8_dynamic = uncounted_cast
    try:
        yield
    finally:
        float8_linear.hp_tensor_to_float8_dynamic = cast


def _measure_step(fake: FakeRank) -> RankMemory:
    """One optimizer step of `fake` (inside `fake_rank`) under torch's memory trackers."""
    cfg, model, params, optimizer, setup = fake.cfg, fake.model, fake.params, fake.optimizer, fake.setup
    t = cfg.training
    sent_before = 0
    if fake.accum_steps > 1:
        # With accumulation every micro-step after the first runs on top of existing gradients: run one first,
        # then measure the next (the memory tracker follows one forward/backward at a time).
        step.micro_step(setup, fake_batch(cfg), fake.global_tokens)
        sent_before = setup.stats.bytes_sent
    offloader = getattr(model, "activation_offloader", None)  # host copies: byte counts, not device tensors
    if offloader is not None:
        offloader.reset_peak()
    with _tracker(model, optimizer) as tracker, OpCensus() as census, _compiled_casts_uncounted(cfg, census):
        step.micro_step(setup, fake_batch(cfg), fake.global_tokens)
        peak_forward_backward = _by_kind(tracker.get_tracker_snapshot("peak"))["Total"]
    with _tracker(model, optimizer) as tracker:
        clip_grad_norm_(params, t.max_norm)
        optimizer.step()
        state = _by_kind(tracker.get_tracker_snapshot("current"))
        optimizer.zero_grad(set_to_none=True)
        peak_optimizer_step = _by_kind(tracker.get_tracker_snapshot("peak"))["Total"]
    peak_eval = measure_eval_peak(cfg, setup, lambda: _tracker(model, optimizer))
    ring = setup.stats.bytes_sent - sent_before
    return RankMemory(state["params"], state["grads"], state["optimizer"], peak_forward_backward,
                      peak_optimizer_step, float(ring) if cfg.parallelism.cp > 1 else None,
                      (fake.model_config.n_layers,),
                      float(offloader.peak_host_bytes) if offloader is not None else 0.0, peak_eval,
                      float(census.bandwidth_bytes()), float(census.kernels()))


def measure_rank(cfg: Config, world_size: int, rank: int = 0) -> RankMemory:
    """One rank of a fake process group of `world_size`, measured at the recipe's full depth."""
    with fake_rank(cfg, world_size, rank) as fake:
        return _measure_step(fake)


def _forget_dtensor_caches() -> None:
    """DTensor caches sharding propagation and redistribution plans by DeviceMesh, and two meshes compare equal when
    their shape and dim names do, whatever process groups they hold. The next probe's tp sub-mesh (a (2, 2, 2) mesh's
    and a (4, 2) mesh's are equal) would then get outputs on this probe's mesh, whose group names were destroyed with
    its process group or now name other groups: "Could not resolve the process group registered under the name 25"
    in the planner's tp > 1 probes. Each probe starts from empty caches, as a fresh training process does."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def with_blocks(cfg: Config, n_layers: int) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n_layers))


def measure_memory(cfg: Config, world_size: int, n_layers: int, rank: int = 0,
                   extrapolate_above: int = 6) -> RankMemory:
    """Full depth for shallow models. Deeper ones are measured at 3, 4 and 5 blocks: when the two increments agree
    (every block is the same shape, so memory peaks and the ring's bytes grow by the same amount per block once the
    first and last blocks' FSDP special cases are in place) the line is extrapolated to `n_layers`; otherwise the
    full depth is measured."""
    if n_layers <= extrapolate_above or cfg.parallelism.pp > 1:
        return measure_rank(cfg, world_size, rank)
    m3, m4, m5 = (measure_rank(with_blocks(cfg, d), world_size, rank) for d in (3, 4, 5))
    if m3.extrapolate(m4, 2).agrees_with(m5):
        return m3.extrapolate(m4, n_layers - 3)
    return measure_rank(cfg, world_size, rank)
