"""Host syncs of the trainer's whole micro-step as a GPU would run it, counted on a CPU-only box (issue 27).

One rank of a fake process group of the run's world size (collectives return at once, in this process) builds the
recipe's model with the real composer on a `cuda` mesh and materialises it as fake CUDA tensors (FakeTensorMode; the
no-op CUDA device guard of training/planning/cuda_path_probe.py lets them be sliced). Its micro-batches come from the trainer's
own loader path (training/batch_plans.step_loader: placement by work and the documents plan made by the loader's
collate function, on real host ids); each one then goes through the trainer's loop body, `step.move_batch` to
"cuda" (host-to-device copies, which make the fake device tensors), `step.micro_step`, and the per-micro-step
metric (`metrics.visible_pairs`), under `HostSyncCounter`: every `_local_scalar_dense` and device-to-host copy of a
fake CUDA tensor is one place where a GPU run's host would wait for the stream.

The backward needs more than cuda_path_probe's no-op device guard: autograd's engine asks for the accelerator (CUDA,
which a CPU build reports absent), its current streams and events. `fake_cuda_runtime()` compiles a small library
that registers, for CUDA, a device guard with no-op streams and events on device 0 and CUDA hooks that report CUDA
built and present; `torch.cuda.is_available()` stays False. The hooks are read once, when torch starts, so the
library must be preloaded (LD_PRELOAD): the probe runs in a process of its own (`fake_cuda_env`).

What it does not count: the reads once per optimizer step outside the micro-step (`Trainer.train_step` returns
`loss.item()` and `float(grad_norm)`: two per step) and the once-per-log-step metrics.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from config.schema import Config
from data.placement import StepSlots
from models.llama import Llama, recipe_model_config
from parallelisms.context_parallel import CommStats
from parallelisms.parallel_dims import ParallelDims
from parallelisms.parallelize import parallelize, uses_loss_parallel
from parallelisms.stage_meshes import add_hybrid_subgroups
from parallelisms.cp.layouts import DOCUMENTS
from training import step
from training.batch_plans import CpPlanning, step_loader
from training.build import stage_ulysses_degree
from training.planning.cuda_path_probe import LaunchCounter, build_torch_library
from training.planning.host_syncs import HostSyncCounter
from training.planning.memory_probe import _forget_dtensor_caches, _sharding_propagation_in_its_own_fake_mode
from training.metrics import visible_pairs
from training.step import StepSetup, clip_grad_norm_


FAKE_CUDA_RUNTIME_SOURCE = r"""#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
using c10::Device; using c10::Stream;
struct FakeCudaGuard : c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA> {
  Device getDevice() const override { return Device(c10::DeviceType::CUDA, 0); }
  Device exchangeDevice(Device) const override { return getDevice(); }
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, Device(c10::DeviceType::CUDA, 0)); }
  Stream getNewStream(Device d, int) const override { return getStream(d); }
  Stream exchangeStream(Stream s) const noexcept override { return getStream(s.device()); }
  void record(void**, const Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
};
C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);
namespace at {
struct FakeCudaHooks : CUDAHooksInterface {
  FakeCudaHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
};
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCudaHooks);
}
"""


def fake_cuda_runtime() -> str:
    """The preloadable fake CUDA runtime library (see the module docstring), built once per torch (version and
    library folder) and source into the temp folder; raises when it cannot be built (no compiler or headers)."""
    return build_torch_library("fake_cuda_runtime", FAKE_CUDA_RUNTIME_SOURCE, ["c10", "torch_cpu"])


def fake_cuda_env(env: dict) -> dict:
    """`env` for a child process that runs this probe: the fake CUDA runtime preloaded."""
    preload = " ".join(x for x in (fake_cuda_runtime(), env.get("LD_PRELOAD", "")) if x)
    return dict(env, LD_PRELOAD=preload)


_FSDP_MODULES = ("_fsdp_collectives", "_fsdp_init", "_fsdp_param_group", "_fsdp_state")


@contextlib.contextmanager
def _fsdp_streams_on_fake_cuda():
    """FSDP2 asks its device's module (`torch.cuda` on a cuda mesh) for the current device, streams and events, which
    a CPU build refuses. Until exit, its modules get torch.cpu's no-op streams and events, and device index 0, for
    "cuda": the ops FSDP issues (all-gathers, copies, reduce-scatters) are unchanged; only stream ordering is gone."""
    import importlib

    handle = types.SimpleNamespace(Stream=torch.cpu.Stream, Event=torch.cpu.Event, stream=torch.cpu.stream,
                                   current_stream=torch.cpu.current_stream, current_device=lambda: 0)
    modules = [importlib.import_module(f"torch.distributed.fsdp._fully_shard.{m}") for m in _FSDP_MODULES]
    saved = [m._get_device_handle for m in modules]
    for module, original in zip(modules, saved):
        module._get_device_handle = (lambda original: lambda device_type="cuda": handle if device_type == "cuda"
                                     else original(device_type))(original)
    try:
        yield
    finally:
        for module, original in zip(modules, saved):
            module._get_device_handle = original


@dataclass
class StepSyncs:
    """Host syncs of one rank's micro-steps on fake CUDA tensors."""
    micro_steps: int
    counts: dict
    """{"_local_scalar_dense" | "device_to_host": count} over all micro-steps."""
    places: dict
    """{"<kind> at <file:line function>": count}: where each one was made."""
    attention_calls: dict
    """{aten op name: calls} of the attention kernels the micro-steps ran (CUDA flash / varlen on fake CUDA)."""
    aten_ops: int
    clip_counts: dict | None = None
    """Host syncs of the step's gradient clipping by the global norm (`step.clip_grad_norm_`), once per optimizer
    step after the micro-steps; None when the micro-steps stopped early."""
    stopped: str | None = None
    """Why the micro-steps stopped early: fake tensors hold no values, so a step that reads one back (`.item()`,
    `.tolist()`) fails right after the counter has seen and located that read."""


def host_steps(cfg: Config, mesh, micro_loader, steps: int) -> list[dict]:
    """`steps` optimizer steps of this rank as the trainer's loader yields them (Trainer._step_loader's arguments):
    placed by work when the recipe places, each micro-batch with its documents plan when the layout is documents."""
    p, t = cfg.parallelism, cfg.training
    micro_steps = t.grad_accum_steps(mesh.dims.dp)
    slots = StepSlots(micro_steps, mesh.dims.dp, t.local_batch_size, t.seq_len) if cfg.data.places_by_work() else None
    shards = p.cp > 1 or cfg.data.document_masking
    cp = None
    if shards and cfg.data.document_masking and p.cp_load_balancer == DOCUMENTS:
        cp = CpPlanning(p.cp, mesh.cp_mesh.get_local_rank(), p.cp_impl, varlen=True)  # as on a GPU
    loader = step_loader(micro_loader, micro_steps, slots, mesh.dp_rank, cp, num_workers=max(1, cfg.data.num_workers),
                         pin_memory=False)
    iterator = iter(loader)
    return [next(iterator) for _ in range(steps)]


def count_micro_step_syncs(cfg: Config, world_size: int, rank: int, micro_loader_for, steps: int = 1,
                           where: bool = True) -> StepSyncs:
    """`rank` of a fake process group of `world_size` runs `steps` optimizer steps' micro-steps on fake CUDA tensors;
    `micro_loader_for(mesh)` builds this rank's per-micro-batch loader (training/build.build_stage_data's)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not torch._C._accelerator_getAccelerator() or torch._C._accelerator_getAccelerator().type != "cuda":
        raise RuntimeError("the fake CUDA runtime is not preloaded: run the probe with fake_cuda_env(os.environ)")
    excepthook = sys.excepthook  # init_process_group wraps it in a "[rankN]: " prefixer
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with _fsdp_streams_on_fake_cuda():
            return _count(cfg, world_size, micro_loader_for, steps, where)
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        _forget_dtensor_caches()


def _count(cfg: Config, world_size: int, micro_loader_for, steps: int, where: bool) -> StepSyncs:
    p, t = cfg.parallelism, cfg.training
    dims = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, world_size, where=cfg.recipe_path)
    mcfg = recipe_model_config(cfg)
    mesh = dims.build_mesh("cuda")
    add_hybrid_subgroups(mesh, stage_ulysses_degree(cfg, mcfg, mesh, "cuda"))
    batches = [b for s in host_steps(cfg, mesh, micro_loader_for(mesh), steps) for b in s["micro_batches"]]
    with torch.device("meta"):
        model = Llama(mcfg)
    with FakeTensorMode(allow_non_fake_inputs=True), _sharding_propagation_in_its_own_fake_mode():
        model = parallelize(model, mesh, cfg)  # in the mode: FSDP makes its (empty) buffers on "cuda"
        model.to_empty(device="cuda")
        setup = StepSetup(model, mesh, p, cfg.data.document_masking, uses_loss_parallel(cfg, mesh), CommStats(),
                          loss_chunk_tokens=t.loss_tile_tokens(mcfg.vocab_size))
        counted = _count_micro_steps(setup, batches, t.global_batch_rows(dims.dp) * t.seq_len, where)
        if not counted.stopped:
            with HostSyncCounter() as clip_syncs:
                clip_grad_norm_(list(model.parameters()), t.max_norm)
            counted.clip_counts = dict(clip_syncs.counts)
    return counted


def _count_micro_steps(setup: StepSetup, batches: list[dict], global_tokens: int, where: bool) -> StepSyncs:
    """The trainer's loop body (Trainer.train_step) per micro-batch, counted; stops at the first failure."""
    counts, places, attention = collections.Counter(), collections.Counter(), collections.Counter()
    ops, stopped = 0, None
    for batch in batches:
        launches = LaunchCounter(record=True)
        try:
            with launches, HostSyncCounter(where=where) as syncs:
                local = step.move_batch(batch, torch.device("cuda"))
                step.micro_step(setup, local, global_tokens)
                visible_pairs(local["position_ids"])
        except Exception as e:  # a value read back from a fake tensor (counted and located), or any failure
            stopped = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        counts.update(syncs.counts)
        places.update(syncs.places or {})
        attention.update(str(call[0]) for call in launches.attention_calls)
        ops += launches.ops
        if stopped:
            break
    return StepSyncs(len(batches), dict(counts), dict(places), dict(attention), ops, None, stopped)
