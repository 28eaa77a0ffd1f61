"""Entry point: recipe -> mesh -> data -> model -> parallelize -> train loop.

Launched by run_train.sh under torchrun:  train.py [RECIPE.toml] [--section.key value ...] [--print-config]
`--dry-run` (one process, no torchrun) measures every stage's memory per rank on a fake process group and prints it
with a roofline step time (training/dry_run.py).
`--check` validates the recipe and the launch (corpus paths, degrees vs ranks) and prints the number of ranks it
needs, without starting a process group: run_train.sh calls it first so bad input fails in one line.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import time

from training.config import Config, default_recipe, load_config, to_toml
from training.errors import RecipeError


def parse_cli(argv: list[str]) -> tuple[str, list[str], set[str]]:
    flags = {a for a in argv if a in ("--print-config", "--check", "--dry-run")}
    rest = [a for a in argv if a not in flags]
    recipe = default_recipe()
    if rest and not rest[0].startswith("--"):
        recipe, rest = rest[0], rest[1:]
    return recipe, rest, flags


def required_ranks(cfg: Config) -> int:
    """The ranks a recipe asks for when NPROC is not given (dp_shard = -1 counts as 1)."""
    p = cfg.parallelism
    return p.pp * p.dp_replicate * max(1, p.dp_shard) * p.cp * p.tp


def preflight(cfg: Config, world_size: int):
    """Every check that needs no process group; returns the resolved parallel degrees."""
    from data.corpus import load_documents
    from models.llama import model_config
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.pipeline_parallel import plan_pipeline
    from parallelisms.tensor_parallel import check_tp_degree

    p = cfg.parallelism
    dims = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, world_size, where=cfg.recipe_path)
    mcfg = model_config(cfg.model.name, **model_overrides(cfg))
    load_documents(cfg.data.corpus)  # raises on a missing path
    if cfg.data.tokenizer_path and not os.path.exists(cfg.data.tokenizer_path):
        raise RecipeError(f"{cfg.recipe_path}: data.tokenizer_path '{cfg.data.tokenizer_path}' does not exist. "
                          f"Point it at a SentencePiece .model file or leave it empty to train one.")
    rows_per_step = cfg.training.local_batch_size * dims.dp
    gbs = cfg.training.global_batch_size
    if gbs != -1 and (gbs <= 0 or gbs % rows_per_step):
        raise RecipeError(f"{cfg.recipe_path}: training.global_batch_size {gbs} must be a multiple of "
                          f"local_batch_size x dp = {rows_per_step}. Use {max(1, gbs // rows_per_step) * rows_per_step}.")
    if p.tp > 1:
        check_tp_degree(mcfg.n_heads, mcfg.num_kv_heads, p.tp, where=cfg.recipe_path)
    check_sequence_split(cfg)
    if p.pp > 1:
        if cfg.data.document_masking:
            raise RecipeError(f"{cfg.recipe_path}: data.document_masking is not supported with parallelism.pp > 1 "
                              f"(document ids are per batch, the pipeline splits batches). Set pp = 1.")
        plan_pipeline(mcfg.n_layers, p.pp, p.pp_schedule, p.pp_layers_per_stage, p.pp_microbatches,
                      cfg.training.local_batch_size, where=cfg.recipe_path)
    return dims


def check_sequence_split(cfg: Config) -> None:
    """seq_len must split into CP shards (2*cp chunks for zigzag; the ring also runs at cp=1 for document masking)
    and each CP shard into tp pieces for sequence parallelism."""
    p = cfg.parallelism
    seq_len = cfg.training.seq_len
    cp_active = p.cp > 1 or cfg.data.document_masking
    cp_multiple = (2 * p.cp if p.cp_load_balancer == "zigzag" else p.cp) if cp_active else 1
    multiple = math.lcm(cp_multiple, p.cp * p.tp)
    if seq_len % multiple == 0:
        return
    nearest = max(multiple, round(seq_len / multiple) * multiple)
    parts = []
    if cp_multiple > 1:
        parts.append(f"{cp_multiple} for {p.cp_load_balancer} CP over {p.cp} rank(s)")
    if p.tp > 1:
        parts.append(f"cp x tp = {p.cp * p.tp} for sequence parallelism over tp {p.tp}")
    raise RecipeError(f"{cfg.recipe_path}: training.seq_len {seq_len} is not divisible by {multiple} "
                      f"({'; '.join(parts)}). Use {nearest}.")


def model_overrides(cfg: Config) -> dict:
    m = cfg.model
    names = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "rope_theta")
    out = {k: getattr(m, k) for k in names if getattr(m, k)}
    if m.rope_scaling_factor:
        out["rope_scaling_factor"] = None if m.rope_scaling_factor < 0 else m.rope_scaling_factor
    return out


class Trainer:
    comm_stats = None  # ring-attention byte counters (parallelisms.context_parallel.CommStats), set by run()

    def __init__(self, cfg: Config):
        import torch
        import torch.distributed as dist

        from data.corpus import load_documents
        from data.loader import build_dataloader
        from data.tokenizer import build_tokenizer
        from models.llama import Llama, flops_per_token, model_config
        from parallelisms.parallelize import materialize, parallelize, uses_loss_parallel
        from parallelisms.pipeline_parallel import build_pipeline, plan_pipeline
        from training.hardware import peak_flops, pick_device
        from training.checkpoint import Checkpointer
        from training.lr_schedule import build_lr_scheduler
        from training.metrics import MetricsLogger

        self.cfg = cfg
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.dims = preflight(cfg, world)
        self.device = pick_device(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        timeout = datetime.timedelta(seconds=cfg.job.collective_timeout_s)
        dist.init_process_group(self.device.backend, timeout=timeout, device_id=None)
        self.rank = dist.get_rank()
        self.mesh = self.dims.build_mesh(self.device.type)
        torch.manual_seed(cfg.job.seed)

        # Data: rank 0 trains (or loads) the tokenizer first so the others hit its cache.
        documents = load_documents(cfg.data.corpus)
        if self.rank == 0:
            build_tokenizer(cfg.data.tokenizer_path or None, documents, self._vocab_size(), cfg.data.cache_dir)
        dist.barrier()
        self.tokenizer = build_tokenizer(cfg.data.tokenizer_path or None, documents, self._vocab_size(),
                                         cfg.data.cache_dir)
        t = cfg.training
        self.grad_accum = 1 if t.global_batch_size == -1 else t.global_batch_size // (t.local_batch_size * self.dims.dp)
        self.global_batch_size = t.local_batch_size * self.dims.dp * self.grad_accum
        self.dataloader = build_dataloader(
            self.tokenizer, documents, seq_len=t.seq_len, local_batch_size=t.local_batch_size,
            dp_rank=self.mesh.dp_rank, dp_size=self.dims.dp, seed=cfg.job.seed,
            document_masking=cfg.data.document_masking, num_workers=cfg.data.num_workers)

        # Model: built on the meta device, split into pipeline stages, parallelized, then materialised and
        # initialised identically on any mesh.
        self.model_cfg = model_config(cfg.model.name, **model_overrides(cfg))
        with torch.device("meta"):
            model = Llama(self.model_cfg)
        p = cfg.parallelism
        self.loss_parallel = uses_loss_parallel(cfg, self.mesh)
        self.pipeline = None
        if p.pp > 1:
            plan = plan_pipeline(self.model_cfg.n_layers, p.pp, p.pp_schedule,
                                 p.pp_layers_per_stage, p.pp_microbatches, t.local_batch_size, cfg.recipe_path)
            self.pipeline = build_pipeline(
                model, plan, self.mesh.pp_mesh.get_local_rank(), self.mesh.pp_mesh.get_group(),
                self.device.torch_device, parallelize_stage=lambda m: parallelize(m, self.mesh, cfg),
                materialize=lambda m: materialize(m, self.device.torch_device, cfg, self.mesh),
                loss_fn=self._pipeline_loss)
            self.model_parts = self.pipeline.modules  # pipeline stages held by this rank
        else:
            model = parallelize(model, self.mesh, cfg)
            materialize(model, self.device.torch_device, cfg, self.mesh)
            self.model_parts = [model]
        self.model = self.model_parts[0]
        dtype = getattr(torch, t.dtype)

        o = cfg.optimizer
        params = [p for part in self.model_parts for p in part.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=True)
        s = cfg.lr_scheduler
        self.scheduler = build_lr_scheduler(self.optimizer, s.warmup_steps, t.steps, s.decay_type, s.min_lr_ratio)
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.job.dump_folder, self.model_parts, self.optimizer,
                                         self.scheduler, self.dataloader, self.model_cfg, vars(self.dims))
        self.step = self.checkpointer.load()  # 0, or the step of the checkpoint resumed
        self.flops_per_token = flops_per_token(self.model_cfg, t.seq_len, causal=True)
        dist.barrier()  # every rank measures its peak at the same time, sharing the cores as in training
        self.peak_flops, self.peak_source = peak_flops(self.device, dtype)
        self.logger = MetricsLogger(cfg.job.dump_folder, t.steps, cfg.metrics.enable_tensorboard,
                                    is_writer=self.rank == 0, start_step=self.step)

    def _vocab_size(self) -> int:
        from models.llama import model_config

        return model_config(self.cfg.model.name, **model_overrides(self.cfg)).vocab_size

    def _cp_context(self, batch: dict):
        """Shards the batch over the CP ranks and routes attention to the ring (also at cp=1 for document masking)."""
        p = self.cfg.parallelism
        if p.cp == 1 and not self.cfg.data.document_masking:
            return contextlib.nullcontext()
        from parallelisms.context_parallel import context_parallel

        names = ["input_ids", "labels", "position_ids", "document_ids"]
        return context_parallel(
            self.mesh.cp_mesh, buffers=[batch[n] for n in names], buffer_seq_dims=[1] * len(names),
            no_restore_buffers={batch[n] for n in names}, load_balancer=p.cp_load_balancer,
            document_ids=batch["document_ids"] if self.cfg.data.document_masking else None, stats=self.comm_stats)

    def _global_tokens(self) -> int:
        """Label tokens in one optimizer step over all ranks: every loss is a local sum divided by this."""
        return self.global_batch_size * self.cfg.training.seq_len

    def _pipeline_loss(self, logits, labels):
        """The last stage's loss for one microbatch (runs inside the schedule, under the loss-parallel context)."""
        from parallelisms.tensor_parallel import token_loss_sum

        return token_loss_sum(logits, labels) / self._global_tokens()

    def train_step(self, batches: list[dict]) -> tuple[float, float]:
        """One optimizer step over `grad_accum` micro-batches; returns (global mean loss, grad norm).

        The loss is the true global mean: local token sums / global token count, summed over the loss mesh
        (dp x cp; TP ranks already hold the same value) and, under PP, taken from the rank holding the last stage.
        """
        import torch
        import torch.distributed as dist

        from parallelisms.parallelize import clip_grad_norm_
        from parallelisms.tensor_parallel import loss_context, token_loss_sum

        global_tokens = self._global_tokens()
        loss = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        for batch in batches:
            batch = {k: v.to(self.device.torch_device) for k, v in batch.items()}
            with self._cp_context(batch), loss_context(self.loss_parallel):
                if self.pipeline is not None:
                    loss += self.pipeline.step(batch)
                else:
                    logits = self.model(batch["input_ids"], batch["position_ids"])
                    scaled = token_loss_sum(logits, batch["labels"]) / global_tokens
                    scaled.backward()
                    loss += scaled.detach()
        pp_group = self.mesh.pp_mesh.get_group() if self.dims.pp > 1 else None
        params = [p for part in self.model_parts for p in part.parameters()]
        grad_norm = clip_grad_norm_(params, self.cfg.training.max_norm, pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.dims.world_size > 1:
            dist.all_reduce(loss, group=self.mesh.loss.get_group())
        if pp_group is not None:  # only the ranks holding the last stage have a non-zero loss
            dist.all_reduce(loss, group=pp_group)
        return loss.item(), float(grad_norm)

    def run(self) -> None:
        import torch
        import torch.distributed as dist

        from training.hardware import peak_memory_gib

        cfg, t = self.cfg, self.cfg.training
        if self.rank == 0:
            print(f"training {self.model_cfg.n_layers}-layer dim-{self.model_cfg.dim} Llama on {self.dims.world_size} "
                  f"rank(s) ({self.device.type}/{self.device.backend}); mesh pp {self.dims.pp} x dp_replicate "
                  f"{self.dims.dp_replicate} x dp_shard {self.dims.dp_shard} x cp {self.dims.cp} x tp {self.dims.tp}; "
                  f"seq {t.seq_len}, global batch {self.global_batch_size}, peak {self.peak_flops / 1e9:.0f} GFLOP/s "
                  f"per rank ({self.peak_source})", flush=True)
        from parallelisms.context_parallel import CommStats
        from training.roofline import Layout, fsdp_bytes_per_step

        self.comm_stats = CommStats()
        logged_ring_bytes, logged_step = 0, self.step
        layout = Layout(self.dims.pp, self.dims.dp_replicate, self.dims.dp_shard, self.dims.cp, self.dims.tp, 1)
        reshard = cfg.parallelism.fsdp_reshard_after_forward in ("always", "default" if self.dims.pp == 1 else "")
        fsdp_bytes = sum(fsdp_bytes_per_step(self.model_cfg, layout, t.dtype, self.grad_accum, reshard))
        data_iter = iter(self.dataloader)
        while self.step < t.steps:
            start = time.perf_counter()
            batches = [next(data_iter) for _ in range(self.grad_accum)]
            data_time = time.perf_counter() - start
            lr = self.scheduler.get_last_lr()[0]
            loss, grad_norm = self.train_step(batches)
            self.step += 1
            step_time = time.perf_counter() - start
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {self.step}; lower optimizer.lr or check data.")
            self.checkpointer.maybe_save(self.step, last=self.step == t.steps)
            if self.step % cfg.metrics.log_freq and self.step != t.steps:
                continue
            ring_bytes = self.comm_stats.kv_bytes_sent + self.comm_stats.backward_bytes_sent
            ring_per_step = (ring_bytes - logged_ring_bytes) / max(1, self.step - logged_step)
            logged_ring_bytes, logged_step = ring_bytes, self.step
            # Maxima over ranks: step_time is the slowest rank's; -step_time gives the fastest rank's.
            stats = torch.tensor([step_time, peak_memory_gib(self.device), data_time, ring_per_step, -step_time],
                                 dtype=torch.float64)
            if self.dims.world_size > 1:
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            step_time, memory, data_time, ring_per_step, fastest = stats.tolist()
            tokens_per_sec = self.global_batch_size * t.seq_len / step_time
            mfu = self.flops_per_token * tokens_per_sec / (self.peak_flops * self.dims.world_size)
            self.logger.log(self.step, {
                "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
                "tokens_per_sec_per_rank": tokens_per_sec / self.dims.world_size, "mfu": mfu,
                "peak_flops_per_rank": self.peak_flops, "peak_source": self.peak_source,
                "seq_len": t.seq_len, "cp": self.dims.cp, "global_batch_size": self.global_batch_size,
                "tokens_seen": self.step * self.global_batch_size * t.seq_len, "memory": memory,
                "step_time": step_time, "data_time": data_time, "step_time_fastest_rank": -fastest,
                "cp_comm_bytes": ring_per_step, "fsdp_comm_bytes": fsdp_bytes})

    def close(self) -> None:
        import torch.distributed as dist

        self.checkpointer.close()  # waits for an async save in flight
        self.logger.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        recipe, overrides, flags = parse_cli(argv)
        cfg = load_config(recipe, overrides)
        if "--print-config" in flags:
            print(to_toml(cfg))
            return 0
        world = int(os.environ.get("WORLD_SIZE") or os.environ.get("NPROC") or 0) or required_ranks(cfg)
        if "--dry-run" in flags:  # one process, fake process group: memory and speed of every stage (no GPU needed)
            from training.dry_run import run_dry_run
            return run_dry_run(cfg, world)
        preflight(cfg, world)
        from training.device_check import check_gpus
        check_gpus(cfg, world)  # a GPU-sized recipe without GPUs stops here, in one line
        from models.llama import model_config
        from training.checkpoint import preflight_checkpoint
        preflight_checkpoint(cfg, model_config(cfg.model.name, **model_overrides(cfg)))
        if "--check" in flags:
            print(world)
            return 0
        trainer = Trainer(cfg)
    except RecipeError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.run()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
