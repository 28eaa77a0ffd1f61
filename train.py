"""Entry point: recipe -> mesh -> data -> model -> parallelize -> train loop.

Launched by run_train.sh under torchrun:  train.py [RECIPE.toml] [--section.key value ...] [--print-config]
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
    flags = {a for a in argv if a in ("--print-config", "--check")}
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

    p = cfg.parallelism
    dims = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, world_size, where=cfg.recipe_path)
    model_config(cfg.model.name, **model_overrides(cfg))
    load_documents(cfg.data.corpus)  # raises on a missing path
    if cfg.data.tokenizer_path and not os.path.exists(cfg.data.tokenizer_path):
        raise RecipeError(f"{cfg.recipe_path}: data.tokenizer_path '{cfg.data.tokenizer_path}' does not exist. "
                          f"Point it at a SentencePiece .model file or leave it empty to train one.")
    rows_per_step = cfg.training.local_batch_size * dims.dp
    gbs = cfg.training.global_batch_size
    if gbs != -1 and (gbs <= 0 or gbs % rows_per_step):
        raise RecipeError(f"{cfg.recipe_path}: training.global_batch_size {gbs} must be a multiple of "
                          f"local_batch_size x dp = {rows_per_step}. Use {max(1, gbs // rows_per_step) * rows_per_step}.")
    multiple = 2 * p.cp if p.cp_load_balancer == "zigzag" else p.cp
    if p.cp > 1 and cfg.training.seq_len % multiple:
        nearest = max(multiple, round(cfg.training.seq_len / multiple) * multiple)
        raise RecipeError(f"{cfg.recipe_path}: training.seq_len {cfg.training.seq_len} is not divisible by "
                          f"{multiple} ({p.cp_load_balancer} CP over {p.cp} ranks). Use {nearest}.")
    return dims


def model_overrides(cfg: Config) -> dict:
    m = cfg.model
    names = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "rope_theta")
    out = {k: getattr(m, k) for k in names if getattr(m, k)}
    if m.rope_scaling_factor:
        out["rope_scaling_factor"] = None if m.rope_scaling_factor < 0 else m.rope_scaling_factor
    return out


class Trainer:
    def __init__(self, cfg: Config):
        import torch
        import torch.distributed as dist

        from data.corpus import load_documents
        from data.loader import build_dataloader
        from data.tokenizer import build_tokenizer
        from models.llama import Llama, flops_per_token, model_config
        from parallelisms.parallelize import parallelize, uses_fsdp
        from training.hardware import peak_flops, pick_device
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

        # Model: built on the meta device, parallelized, then materialised and initialised identically on any mesh.
        self.model_cfg = model_config(cfg.model.name, **model_overrides(cfg))
        with torch.device("meta"):
            model = Llama(self.model_cfg)
        model = parallelize(model, self.mesh, cfg)
        model.to_empty(device=self.device.torch_device)
        dtype = getattr(torch, t.dtype)
        if not uses_fsdp(cfg, self.mesh):
            model.to(dtype)
        with torch.no_grad():
            model.init_weights(cfg.job.seed)
        self.model = model
        self.model_parts = [model]  # pipeline stages held by this rank (one without PP)

        o = cfg.optimizer
        params = [p for part in self.model_parts for p in part.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=True)
        s = cfg.lr_scheduler
        self.scheduler = build_lr_scheduler(self.optimizer, s.warmup_steps, t.steps, s.decay_type, s.min_lr_ratio)
        self.step = 0
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
            document_ids=batch["document_ids"] if self.cfg.data.document_masking else None)

    def train_step(self, batches: list[dict]) -> tuple[float, float]:
        """One optimizer step over `grad_accum` micro-batches; returns (global mean loss, grad norm)."""
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        global_tokens = self.global_batch_size * self.cfg.training.seq_len
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
        for batch in batches:
            batch = {k: v.to(self.device.torch_device) for k, v in batch.items()}
            with self._cp_context(batch):
                logits = self.model(batch["input_ids"], batch["position_ids"])
                token_loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")
                (token_loss / global_tokens).backward()
            loss_sum += token_loss.detach()
        max_norm = self.cfg.training.max_norm
        params = [p for part in self.model_parts for p in part.parameters()]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.dims.world_size > 1:
            dist.all_reduce(loss_sum, group=self.mesh.loss.get_group())
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        return loss_sum.item() / global_tokens, float(grad_norm)

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
            if self.step % cfg.metrics.log_freq and self.step != t.steps:
                continue
            stats = torch.tensor([step_time, peak_memory_gib(self.device), data_time], dtype=torch.float64)
            if self.dims.world_size > 1:
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            step_time, memory, data_time = stats.tolist()
            tokens_per_sec = self.global_batch_size * t.seq_len / step_time
            mfu = self.flops_per_token * tokens_per_sec / (self.peak_flops * self.dims.world_size)
            self.logger.log(self.step, {
                "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
                "tokens_per_sec_per_rank": tokens_per_sec / self.dims.world_size, "mfu": mfu,
                "peak_flops_per_rank": self.peak_flops, "peak_source": self.peak_source,
                "seq_len": t.seq_len, "cp": self.dims.cp, "global_batch_size": self.global_batch_size,
                "tokens_seen": self.step * self.global_batch_size * t.seq_len, "memory": memory,
                "step_time": step_time, "data_time": data_time})

    def close(self) -> None:
        import torch.distributed as dist

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
        world = int(os.environ.get("WORLD_SIZE", os.environ.get("NPROC", "0")) or required_ranks(cfg))
        preflight(cfg, world)
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
