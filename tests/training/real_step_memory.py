"""One rank's peak memory for one optimizer step of a recipe, measured on real tensors in a real gloo run: the
reference the dry run's fake-process-group measurement (training/planning/memory_probe.py) is checked against.

The model, optimizer and step are the trainer's own (training/build.py, training/step.py), set up the way the dry run's
fake world sets them up (AdamW state created by its warm-up step, training/planning/fake/world.warm_up_optimizer, then
one measured micro-step and one clip + optimizer step); only the world is real (gloo ranks, real tensors).

Accounting: live tensor storages, as a GPU's caching allocator would hold them. A dispatch mode sees every tensor an
op of the step returns (FSDP's all-gather and reduce-scatter buffers, the ring's receive buffers, checkpoint
recomputation, the optimizer's temporaries); each new storage counts from then until it is freed, whichever thread
frees it, and FSDP's storage resizes count as they happen. The peak of that sum plus the state that existed before
(parameters, buffers, optimizer state, and gradients in the optimizer phase) is the peak. Not seen, by construction:
- gloo's staging. Gloo copies all-gather and reduce-scatter through temporaries the size of the whole output/input
  (allocator events of one fp32 dp_shard2 step: 17.8 MiB inside c10d::_allgather_base_, 17.8 MiB inside
  gloo:all_gather on its worker thread, 10.5 MiB inside c10d::_reduce_scatter_base_). NCCL writes into the caller's
  buffers and keeps its own outside the caching allocator (the dry run's RUNTIME_RESERVE_GIB): no GPU run holds these.
- scratch allocated inside kernels (the CPU attention backward's accumulators): replaying the allocator's own events
  (torch.profiler, step thread, collectives left out) puts the peaks 0.16 MiB (cp2) and 0.12 MiB (dp_shard2 x cp2)
  above this count, and equal to it on the other meshes.
That allocator replay is not the reference because gloo's worker thread sometimes drops the last reference to a
collective's buffer, and a free on that thread is not recorded: the same step then reads 4 MiB higher (62.6 instead of
58.6 MiB, fp32 dp_shard2) in some runs. Summing `self_cpu_memory_usage` of the profiler's op events by start time (an
earlier check) is worse: it applies each op's net allocation at the op's start, so an op spanning others (an autograd
node, an FSDP post-backward hook that frees at its end) moves bytes to the wrong moment; it read 69 to 77 MiB in five
runs of that 58.6 MiB step, and 63 to 67 MiB for the 1-rank step whose peak is 71.1 MiB.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def persistent_storages(model, optimizer) -> list:
    """The distinct storages of this rank's parameters, buffers, gradients and optimizer state."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return list({id(st): st for st in (_local(t).untyped_storage() for t in tensors)}.values())


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages the ops inside it create, live at each moment; `peak` the most at once, on top of
    `existing` (storages that are there already, counted once)."""

    def __init__(self, existing: list):
        super().__init__()
        self._existing = existing  # held, so that their ids stay theirs
        self._known = {id(st) for st in existing}
        self._live: dict[int, int] = {}
        self._lock = threading.RLock()  # frees may run on gloo's threads
        self._step_thread = threading.get_ident()
        self.current = self.peak = sum(st.nbytes() for st in existing)

    def _add(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._live[key] = self._live.get(key, 0) + nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        with self._lock:
            self.current -= self._live.pop(key, 0)

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self._known or key in self._live:
            return
        weakref.finalize(storage, self._free, key)
        self._add(key, storage.nbytes())

    def __enter__(self):
        self._resize = original = torch.UntypedStorage.resize_

        def resize_(storage, size):  # FSDP frees and re-allocates its unsharded parameters by resizing storages
            before = storage.nbytes()
            original(storage, size)
            if id(storage) in self._live:
                self._add(id(storage), storage.nbytes() - before)
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._guards import active_fake_mode
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        # Not DTensor's sharding propagation on fake tensors, not gloo's worker threads, and not views: a view
        # allocates nothing, and a storage first seen through one was allocated inside a kernel no op here returned
        # it from (gloo's reduce-scatter splits its own full-size copy of the input, cp allgather: 1 MiB).
        if active_fake_mode() is None and threading.get_ident() == self._step_thread and not func.is_view:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                    self._track(t.untyped_storage())
        return out


def _batch(cfg, vocab_size: int) -> dict:
    t = cfg.training
    shape = (t.local_batch_size, t.seq_len)
    ids = torch.randint(0, vocab_size, shape)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(t.seq_len).expand(shape).clone(),
            "document_ids": torch.zeros(shape, dtype=torch.long)}


def real_step_peaks(cfg, world_size: int) -> dict:
    """On an initialised gloo process group of `world_size`: {"forward_backward", "optimizer_step", "peak"} bytes."""
    from models.llama import recipe_model_config
    from parallelisms.context_parallel import CommStats
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.parallelize import uses_loss_parallel
    from training import step
    from training.build import build_model, build_optimizer
    from training.planning.fake.world import warm_up_optimizer
    from training.step import StepSetup, clip_grad_norm_

    p, t = cfg.parallelism, cfg.training
    dims = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, world_size, where=cfg.recipe_path)
    mesh = dims.build_mesh("cpu")
    mcfg = recipe_model_config(cfg)
    (model,) = build_model(cfg, mcfg, mesh, torch.device("cpu")).parts
    optimizer, _ = build_optimizer(cfg, [model])
    setup = StepSetup(model, mesh, p, document_masking=False, loss_parallel=uses_loss_parallel(cfg, mesh),
                      stats=CommStats(), loss_chunk_tokens=t.loss_tile_tokens(mcfg.vocab_size))
    params = list(model.parameters())
    warm_up_optimizer(params, optimizer, t.max_norm)  # AdamW's state exists from the first step on, as in the dry run
    global_tokens = t.global_batch_rows(dims.dp) * t.seq_len
    phases = {}
    with LiveStorages(persistent_storages(model, optimizer)) as live:
        step.micro_step(setup, _batch(cfg, mcfg.vocab_size), global_tokens)
    phases["forward_backward"] = live.peak
    with LiveStorages(persistent_storages(model, optimizer)) as live:
        clip_grad_norm_(params, t.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    phases["optimizer_step"] = live.peak
    phases["peak"] = max(phases.values())
    return phases
