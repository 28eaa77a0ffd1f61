"""Building a run, one function per part, in the order the trainer calls them: the process group and device, the
tokenizer, the model (pipeline stages or one module, parallelized and materialised), the optimizer with its learning
rate schedule, and the data of a ramp stage."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from config.schema import Config
from data.loader import PackedRowLoader, build_dataloader
from data.sources import build_run_tokenizer, describe_stores, open_stores, stage_rows
from models.llama import Llama, LlamaConfig
from parallelisms.comm import Collectives
from parallelisms.parallel_dims import TrainingMesh
from parallelisms.stage_meshes import build_stage_meshes, planned_ulysses_degree
from parallelisms.parallelize import materialize, parallelize
from parallelisms.pipeline_parallel import Pipeline, build_pipeline, plan_pipeline
from training.hardware import Device, pick_device
from training.loss import token_loss_sum
from training.lr_schedule import build_lr_scheduler


@dataclass
class Distributed:
    """This rank's place in the job: its device, its process group's rank, and the bookkeeping collectives."""
    device: Device
    rank: int
    comm: Collectives


def flight_recorder_env(cfg: Config, backend: str) -> dict[str, str]:
    """The environment NCCL's process groups read when they are made: the buffer size, the dump on a collective
    timeout, and the file prefix (<dump_folder>/flight_recorder/rank_, the rank appended), under both names torch has
    read it by (TORCH_FR_DUMP_TEMP_FILE; TORCH_NCCL_DEBUG_INFO_TEMP_FILE before it). The buffer size goes by its
    new name only: torch 2.11 on an H200 warned that TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated in favour of
    TORCH_FR_BUFFER_SIZE (bench/measurements/h200_gpu_report_2026-12-04), which 2.11-2.13 read first. {} for gloo or
    when off."""
    if backend != "nccl" or cfg.job.flight_recorder_entries == 0:
        return {}
    prefix = os.path.join(os.path.abspath(cfg.job.dump_folder), "flight_recorder", "rank_")
    return {"TORCH_FR_BUFFER_SIZE": str(cfg.job.flight_recorder_entries), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}


def flight_recorder_folder(cfg: Config, backend: str) -> str | None:
    """Where the flight recorder writes each rank's last collectives when one times out, or None (gloo, or off): the
    recipe's folder, or the one a TORCH_FR_DUMP_TEMP_FILE already in the environment names (it wins)."""
    env = flight_recorder_env(cfg, backend)
    if not env:
        return None
    return os.path.dirname(os.environ.get("TORCH_FR_DUMP_TEMP_FILE", env["TORCH_FR_DUMP_TEMP_FILE"]))


def init_distributed(cfg: Config) -> Distributed:
    """Picks the device from torchrun's environment and joins the process group (NCCL on GPUs, gloo on CPUs), with
    NCCL's flight recorder on as the recipe says."""
    device = pick_device(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    for name, value in flight_recorder_env(cfg, device.backend).items():
        os.environ.setdefault(name, value)  # a variable already set wins
    recorder = flight_recorder_folder(cfg, device.backend)
    if recorder is not None:
        os.makedirs(recorder, exist_ok=True)
    timeout = datetime.timedelta(seconds=cfg.job.init_timeout_s)  # the step timeout comes later
    # NCCL binds the communicator to this rank's GPU up front (and barriers use it); gloo needs no device.
    dist.init_process_group(device.backend, timeout=timeout,
                            device_id=device.torch_device if device.type == "cuda" else None)
    return Distributed(device, dist.get_rank(), Collectives(device.torch_device))


def build_shared_tokenizer(cfg: Config, vocab_size: int, rank: int):
    """Rank 0 trains (or loads) the tokenizer first, so the other ranks hit its cache instead of training it too."""
    if rank == 0:
        build_run_tokenizer(cfg, vocab_size)
    dist.barrier()
    return build_run_tokenizer(cfg, vocab_size)


def build_stores(cfg: Config, tokenizer, rank: int) -> dict:
    """{source name: memory-mapped TokenStore} (none for synthetic passkey rows); a missing store is prepared once,
    under a file lock, while the other ranks wait (run_train.sh's check process normally did it already)."""
    if cfg.data.dataset != "text":
        return {}
    stores = open_stores(cfg, tokenizer)
    if rank == 0:
        print(describe_stores(stores), flush=True)
    return stores


def stage_ulysses_degree(cfg: Config, model_cfg: LlamaConfig, mesh: TrainingMesh, device_type: str) -> int | None:
    """The hybrid CP degree a stage's attention will run (its subgroups are made at setup), from one TP rank's heads."""
    p = cfg.parallelism
    return planned_ulysses_degree(mesh, p.cp_impl, p.cp_load_balancer, model_cfg.n_heads // p.tp,
                                  model_cfg.num_kv_heads // p.tp, device_type)


def build_run_meshes(stages, device_type: str) -> list[TrainingMesh]:
    """Every ramp stage's mesh and hybrid CP subgroups, made now by every rank (parallelisms/stage_meshes.py): no
    process group is created after setup."""
    return build_stage_meshes([s.dims for s in stages], device_type,
                              lambda i, mesh: stage_ulysses_degree(stages[i].cfg, stages[i].model, mesh, device_type))


@dataclass
class BuiltModel:
    parts: list[nn.Module]
    """The modules this rank holds: the whole model, or its pipeline stages."""
    pipeline: Pipeline | None


def build_model(cfg: Config, model_cfg: LlamaConfig, mesh: TrainingMesh, device: torch.device) -> BuiltModel:
    """Built on the meta device, split into pipeline stages when pp > 1, parallelized by the composer, then
    materialised and initialised identically on any mesh."""
    with torch.device("meta"):
        model = Llama(model_cfg)
    p, t = cfg.parallelism, cfg.training
    if p.pp == 1:
        model = parallelize(model, mesh, cfg)
        materialize(model, device, cfg, mesh)
        return BuiltModel([model], None)
    plan = plan_pipeline(model_cfg.n_layers, p.pp, p.pp_schedule, p.pp_layers_per_stage, p.pp_microbatches,
                         t.local_batch_size, cfg.recipe_path)
    pipeline = build_pipeline(model, plan, mesh.pp_mesh.get_local_rank(), mesh.pp_mesh.get_group(), device,
                              parallelize_stage=lambda m: parallelize(m, mesh, cfg),
                              materialize=lambda m: materialize(m, device, cfg, mesh), loss_fn=token_loss_sum)
    return BuiltModel(pipeline.modules, pipeline)


def build_optimizer(cfg: Config, parts: list[nn.Module], device_type: str | None = None):
    """(AdamW over every parameter this rank holds, its learning-rate schedule).

    Fused AdamW (one multi-tensor kernel for the whole update, DTensor shards included) when the run is on CUDA:
    `device_type` is the run's device (the dry run's fake rank stands for a GPU rank on fake CPU tensors; None =
    where the parameters are). On CUDA with `training.cpu_offload` the parameters are on the host and the same flag
    picks torch's fused CPU kernel: 1.9 G parameters/s on one core against 0.3-0.6 G for foreach (16-32M fp32
    parameters, torch 2.13). CPU runs take torch's per-parameter loop: the CPU's fused kernel differs from foreach by
    an ulp, and the CPU tests' loss references were made with foreach, which the loop equals bit for bit (4 steps of
    dp_shard 2 x cp 2: every loss and grad norm). The loop, not foreach, because on DTensor parameters each foreach
    op has its sharding propagated over the whole parameter list, every step: an 8-rank pp 2 x cp 2 x tp 2 debug run
    took 10-12% more CPU with foreach (31.7-33.7 CPU-s against 27.5-30.0) and 4 ranks 11% (a CPU run's step profile
    then files the update under elementwise, not optimizer; a CPU run's offload keeps it: nothing moves there)."""
    o, s = cfg.optimizer, cfg.lr_scheduler
    params = [p for part in parts for p in part.parameters()]
    fused = all(p.device.type == "cuda" for p in params) if device_type is None else device_type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, **({"fused": True} if fused else {"foreach": False}))
    return optimizer, build_lr_scheduler(optimizer, s.warmup_steps, cfg.training.steps, s.decay_type, s.min_lr_ratio)


def build_stage_data(cfg: Config, tokenizer, stores: dict, mesh: TrainingMesh,
                     rows_consumed: int = 0) -> PackedRowLoader:
    """This rank's loader for one ramp stage (its seq_len, batch split and source weights), continuing at
    `rows_consumed` rows of that stage's row stream."""
    t = cfg.training
    # Placed by work, every rank reads the whole global micro-batch (dp x local rows) and data/placement.py picks its
    # rows; the loader's count of global rows, hence its checkpoint, is the same either way.
    dp_rank, dp_size, local_rows = mesh.dp_rank, mesh.dims.dp, t.local_batch_size
    if cfg.data.places_by_work():
        dp_rank, dp_size, local_rows = 0, 1, t.local_batch_size * mesh.dims.dp
    loader = build_dataloader(
        tokenizer, None, seq_len=t.seq_len, local_batch_size=local_rows, dp_rank=dp_rank,
        dp_size=dp_size, seed=cfg.job.seed, document_masking=cfg.data.document_masking,
        num_workers=cfg.data.num_workers, dataset=cfg.data.dataset, rows=stage_rows(cfg, stores) if stores else None)
    if rows_consumed:
        loader.load_state_dict({"global_rows_consumed": rows_consumed})
    return loader
