"""One rank's memory for one training step of a recipe, measured without a GPU and without the memory.

The rank lives in the planning probes' fake world (training/planning/fake/world.py: the real model and composer on
fake tensors in a fake process group). One optimizer step runs under torch's FSDPMemTracker, which sees every tensor
the step creates and frees, including FSDP's all-gather buffers, checkpoint recomputation, ring-attention blocks and
the optimizer's temporaries. Nothing here is estimated from formulas.

Two phases are measured with separate trackers, forward+backward and gradient clipping + optimizer step, because a
step peaks in one or the other and each grows linearly with the number of (identical) blocks: `measure_memory` can
therefore measure 3, 4 and 5 blocks, check that they lie on one line, and extrapolate exactly to the full depth,
which keeps a 1M-token, CP-64 probe fast (the evaluations at 3 and 4 blocks only: `_eval_on_state_line`).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from unittest import mock

from torch.distributed.fsdp import FSDPModule

from config.schema import Config
from training import step
from training.planning.eval_memory import PeakFSDPMemTracker, PeakMemTracker, measure_eval_peak, tracked_bytes
from training.planning.fake.counter import DispatchCounter
from training.planning.fake.world import FakeWorld, fake_batch, fake_world
from training.step import clip_grad_norm_

GIB = 2**30
_CHECKED = ("params", "grads", "optimizer", "peak_forward_backward", "peak_optimizer_step", "cp_ring_bytes", "host",
            "peak_eval")
"""The figures of RankMemory that a third depth must agree with before two are extrapolated."""


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
    casts; training/planning/fake/counter.py), as this step launches them eagerly: the step model's elementwise time."""
    kernels: float = 0.0
    """Kernel-launching ops in one micro-step's forward and backward (fake/counter.DispatchCounter.kernels)."""
    eval_ring_bytes: float = 0.0
    """Of `cp_ring_bytes`, what the evaluations' ring sent (it is counted in it)."""

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
        pairs = [(getattr(self, n), getattr(other, n)) for n in _CHECKED]
        return all(a == b or abs(a - b) <= rel * max(abs(a), abs(b)) for a, b in pairs if a is not None)

    def extrapolate(self, deeper: "RankMemory", extra_blocks: float) -> "RankMemory":
        """self measured at d blocks, `deeper` at d + 1: every number is affine in the depth."""
        def line(a, b):
            return None if a is None else a + extra_blocks * (b - a)
        values = {n: line(getattr(self, n), getattr(deeper, n))
                  for n in _CHECKED + ("bandwidth_bytes", "kernels", "eval_ring_bytes")}
        return RankMemory(**values, blocks_measured=self.blocks_measured + deeper.blocks_measured)


def _tracker(model, optimizer):
    if isinstance(model, FSDPModule):
        return PeakFSDPMemTracker(model, optimizer)
    tracker = PeakMemTracker()
    tracker.track_external(model, optimizer)
    return tracker


@contextlib.contextmanager
def _compiled_casts_uncounted(cfg: Config, census: DispatchCounter):
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

    with mock.patch.object(float8_linear, "hp_tensor_to_float8_dynamic", uncounted_cast):
        yield


def _measure_step(fake: FakeWorld, evaluate: bool = True) -> RankMemory:
    """One optimizer step of `fake` (inside `fake_world`, its optimizer warmed up) under torch's memory trackers;
    then, with `evaluate`, the stage's evaluations (else `peak_eval` is 0)."""
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
    with _tracker(model, optimizer) as tracker, DispatchCounter() as census, _compiled_casts_uncounted(cfg, census):
        step.micro_step(setup, fake_batch(cfg), fake.global_tokens)
        peak_forward_backward = tracked_bytes(tracker.get_tracker_snapshot("peak"))["Total"]
    with _tracker(model, optimizer) as tracker:
        clip_grad_norm_(params, t.max_norm)
        optimizer.step()
        state = tracked_bytes(tracker.get_tracker_snapshot("current"))
        optimizer.zero_grad(set_to_none=True)
        peak_optimizer_step = tracked_bytes(tracker.get_tracker_snapshot("peak"))["Total"]
    sent_training = setup.stats.bytes_sent
    peak_eval = measure_eval_peak(cfg, setup, lambda: _tracker(model, optimizer)) if evaluate else 0.0
    ring = setup.stats.bytes_sent - sent_before
    return RankMemory(state["params"], state["grads"], state["optimizer"], peak_forward_backward,
                      peak_optimizer_step, float(ring) if cfg.parallelism.cp > 1 else None,
                      (fake.model_config.n_layers,),
                      float(offloader.peak_host_bytes) if offloader is not None else 0.0, peak_eval,
                      float(census.bandwidth_bytes()), float(census.kernels()),
                      float(setup.stats.bytes_sent - sent_training))


def measure_rank(cfg: Config, world_size: int, rank: int = 0, evaluate: bool = True) -> RankMemory:
    """One rank of a fake process group of `world_size`, measured at the recipe's full depth (`evaluate`: see
    `_measure_step`)."""
    with fake_world(cfg, world_size, rank, optimizer=True) as fake:
        return _measure_step(fake, evaluate)


def with_section(cfg: Config, section: str, **values) -> Config:
    """`cfg` with `section`'s `values` replaced (the other sections shared, not copied)."""
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})


def measure_memory(cfg: Config, world_size: int, n_layers: int, rank: int = 0,
                   extrapolate_above: int = 12) -> RankMemory:
    """Full depth for shallow models (up to 12 blocks, what the three probes below hold together). Deeper ones are
    measured at 3, 4 and 5 blocks: when the two increments agree (every block is the same shape, so memory peaks and
    the ring's bytes grow by the same amount per block once the first and last blocks' FSDP special cases are in
    place) the line is extrapolated to `n_layers`; otherwise the full depth is measured.

    The evaluations are measured at 3 and 4 blocks only (`_eval_on_state_line`): the 5-block probe runs the training
    step alone when the evaluation peak grew from 3 to 4 blocks by exactly the parameters and AdamW state of one
    block, which makes its line exact (see there); otherwise it evaluates too and is checked as before."""
    if n_layers <= extrapolate_above or cfg.parallelism.pp > 1:
        return measure_rank(cfg, world_size, rank)
    m3, m4 = (measure_rank(with_section(cfg, "model", n_layers=d), world_size, rank) for d in (3, 4))
    line5 = m3.extrapolate(m4, 2)
    evaluate = not _eval_on_state_line(m3, m4)
    m5 = measure_rank(with_section(cfg, "model", n_layers=5), world_size, rank, evaluate)
    if not evaluate:  # its evaluation's figures are the line's (exact): the training step's are compared
        ring = None if m5.cp_ring_bytes is None else m5.cp_ring_bytes + line5.eval_ring_bytes
        m5 = dataclasses.replace(m5, peak_eval=line5.peak_eval, cp_ring_bytes=ring)
    if line5.agrees_with(m5):
        return m3.extrapolate(m4, n_layers - 3)
    return measure_rank(cfg, world_size, rank)


def _eval_on_state_line(m3: RankMemory, m4: RankMemory) -> bool:
    """Whether the evaluation peak is exactly linear in the depth, read from two depths: it is when one more block
    added exactly that block's parameters and AdamW state (gradients are freed before evaluating). An evaluation runs
    under no_grad: beyond that persistent state it holds one block's activations and gathered parameters at a time,
    the root's gathered embedding and output, and one chunk of logits, none of which depends on the depth once the
    first, a middle and the last block are there (3 blocks). So that increment at 3 -> 4 is the increment at every
    depth, and the line through 3 and 4 is the peak at any depth (measured equal at 5 on 1 rank, FSDP 2 x CP 2, TP 2
    and with activation offload). No evaluations (both 0) is a line too. The evaluations' ring bytes (CP) are the
    same per block, as the training step's are."""
    if m3.peak_eval == m4.peak_eval == 0:
        return True
    return m4.peak_eval - m3.peak_eval == (m4.params + m4.optimizer) - (m3.params + m3.optimizer)
