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

from training.config import Config
from training.errors import RecipeError
from training.preflight import model_overrides, preflight, preflight_stages, required_ranks
from training.ramp import stage_at
from training.recipe import default_recipe, load_config, to_toml


def parse_cli(argv: list[str]) -> tuple[str, list[str], set[str]]:
    flags = {a for a in argv if a in ("--print-config", "--check", "--dry-run", "--prepare-data")}
    rest = [a for a in argv if a not in flags]
    recipe = default_recipe()
    if rest and not rest[0].startswith("--"):
        recipe, rest = rest[0], rest[1:]
    return recipe, rest, flags


class Trainer:
    def __init__(self, cfg: Config):
        import torch
        import torch.distributed as dist

        from data.sources import build_run_tokenizer, describe_stores, open_stores
        from models.llama import Llama, model_config
        from parallelisms.comm import Collectives
        from parallelisms.context_parallel import CommStats
        from parallelisms.parallelize import materialize, parallelize, uses_loss_parallel
        from parallelisms.pipeline_parallel import build_pipeline, plan_pipeline
        from training.hardware import peak_flops, pick_device
        from training.checkpoint import Checkpointer
        from training.lr_schedule import build_lr_scheduler
        from training.metrics import MetricsLogger

        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.stages = preflight_stages(cfg, world)
        self.stage = self.stages[0]
        # The model is built on the first stage's mesh; later stages only trade dp_shard for cp, so its FSDP, TP and
        # PP groups hold the same ranks in every stage.
        cfg = self.cfg = self.stage.cfg
        self.dims = preflight(cfg, world)
        self.device = pick_device(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        timeout = datetime.timedelta(seconds=cfg.job.collective_timeout_s)
        # NCCL binds the communicator to this rank's GPU up front (and barriers use it); gloo needs no device.
        dist.init_process_group(self.device.backend, timeout=timeout,
                                device_id=self.device.torch_device if self.device.type == "cuda" else None)
        self.comm = Collectives(self.device.torch_device)  # bookkeeping collectives on the run's device
        self.rank = dist.get_rank()
        self.mesh = self.dims.build_mesh(self.device.type)
        torch.manual_seed(cfg.job.seed)

        # Data: rank 0 trains (or loads) the tokenizer first so the others hit its cache; the stores are memory-mapped
        # (a missing one is prepared once, under a file lock, while the other ranks wait).
        if self.rank == 0:
            build_run_tokenizer(cfg, self._vocab_size())
        dist.barrier()
        self.tokenizer = build_run_tokenizer(cfg, self._vocab_size())
        self.stores = open_stores(cfg, self.tokenizer) if cfg.data.dataset == "text" else {}
        if self.rank == 0 and self.stores:
            print(describe_stores(self.stores), flush=True)
        t = cfg.training

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
        self.comm_stats = CommStats()
        self._enter_stage(self.stage)
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.job.dump_folder, self.model_parts, self.optimizer,
                                         self.scheduler, self.dataloader, self.model_cfg, vars(self.dims))
        self.step = self.checkpointer.load()  # 0, or the step of the checkpoint resumed
        resumed = stage_at(self.stages, self.step)
        if resumed is not self.stage:  # the data position carries over only inside the stage that saved it
            same_stage = self.step > 0 and stage_at(self.stages, self.step - 1) is resumed
            self._enter_stage(resumed, self.dataloader.global_rows_consumed if same_stage else 0)
        dist.barrier()  # every rank measures its peak at the same time, sharing the cores as in training
        self.peak_flops, self.peak_source = peak_flops(self.device, dtype)
        self.logger = MetricsLogger(cfg.job.dump_folder, t.steps, cfg.metrics.enable_tensorboard,
                                    is_writer=self.rank == 0, start_step=self.step)

    def _enter_stage(self, stage, rows_consumed: int = 0) -> None:
        """Switches to a ramp stage: its mesh (cp traded against dp_shard), batch split, data at its sequence length
        (continuing at `rows_consumed` of that stage's row stream) and its RoPE."""
        from data.loader import build_dataloader
        from data.sources import stage_rows
        from models.llama import flops_per_token, model_config
        from parallelisms.parallel_dims import ParallelDims

        self.stage, cfg = stage, stage.cfg
        self.cfg = cfg
        p, t = cfg.parallelism, cfg.training
        dims = ParallelDims.resolve(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, self.dims.world_size)
        if dims != self.dims:
            self.dims, self.mesh = dims, dims.build_mesh(self.device.type)
        self.grad_accum = 1 if t.global_batch_size == -1 else t.global_batch_size // (t.local_batch_size * dims.dp)
        self.global_batch_size = t.local_batch_size * dims.dp * self.grad_accum
        self.dataloader = build_dataloader(
            self.tokenizer, None, seq_len=t.seq_len, local_batch_size=t.local_batch_size,
            dp_rank=self.mesh.dp_rank, dp_size=dims.dp, seed=cfg.job.seed, document_masking=cfg.data.document_masking,
            num_workers=cfg.data.num_workers, dataset=cfg.data.dataset,
            rows=stage_rows(cfg, self.stores) if self.stores else None)
        if rows_consumed:
            self.dataloader.load_state_dict({"global_rows_consumed": rows_consumed})
        if hasattr(self, "checkpointer"):
            self.checkpointer.dataloader = self.dataloader
        m = self.model_cfg = model_config(cfg.model.name, **model_overrides(cfg))
        for part in self.model_parts:
            part.set_rope(m.rope_theta, m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
                          m.rope_original_max_position)
        self.flops_per_token = flops_per_token(m, t.seq_len, causal=True)

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
            no_restore_buffers={batch[n] for n in names}, load_balancer=p.cp_load_balancer, cp_impl=p.cp_impl,
            document_ids=batch["document_ids"] if self.cfg.data.document_masking else None, stats=self.comm_stats)

    def _global_tokens(self) -> int:
        """Label tokens in this optimizer step over all ranks: every loss is a local sum divided by this."""
        return self._step_tokens

    def _count_label_tokens(self, batches: list[dict]) -> int:
        """Every label counts for text; passkey rows label only the answer, so count those over the dp ranks
        (CP and TP ranks of one dp rank hold the same rows)."""
        from data.passkey import IGNORE_INDEX

        if self.cfg.data.dataset == "text":
            return self.global_batch_size * self.cfg.training.seq_len
        local = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        return int(self.comm.reduce_values([local], group=self.mesh.data.get_group())[0])

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

        from parallelisms.parallelize import clip_grad_norm_
        from parallelisms.tensor_parallel import loss_context, token_loss_sum

        self._step_tokens = self._count_label_tokens(batches)
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
            self.comm.all_reduce_(loss, group=self.mesh.loss.get_group())
        if pp_group is not None:  # only the ranks holding the last stage have a non-zero loss
            self.comm.all_reduce_(loss, group=pp_group)
        return loss.item(), float(grad_norm)

    def run(self) -> None:
        from training.ramp import source_tokens_seen, tokens_seen

        self._announce()
        self._logged = (self.comm_stats.kv_bytes_sent + self.comm_stats.backward_bytes_sent, self.step)
        data_iter = iter(self.dataloader)
        while self.step < self.cfg.training.steps:
            stage = stage_at(self.stages, self.step)
            if stage is not self.stage:
                if self.cfg.checkpoint.enable and self.step % self.cfg.checkpoint.interval:
                    self.checkpointer.save(self.step)  # a stage boundary is always a checkpoint
                self._enter_stage(stage)
                self._announce()
                data_iter = iter(self.dataloader)
            start = time.perf_counter()
            batches = [next(data_iter) for _ in range(self.grad_accum)]
            data_time = time.perf_counter() - start
            lr = self.scheduler.get_last_lr()[0]
            loss, grad_norm = self.train_step(batches)
            self.step += 1
            step_time = time.perf_counter() - start
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {self.step}; lower optimizer.lr or check data.")
            last = self.step == self.cfg.training.steps
            self.checkpointer.maybe_save(self.step, last=last)
            evaluation = self._long_doc_eval() if self._long_doc_eval_due(last) else {}
            if self.step % self.cfg.metrics.log_freq == 0 or last or evaluation:
                self._log_step(loss, lr, grad_norm, step_time, data_time, tokens_seen(self.stages, self.step),
                               source_tokens_seen(self.stages, self.step) if self.stores else {}, evaluation)
        if self.cfg.eval.passkey:
            self.evaluate_passkey()

    def _long_doc_eval_due(self, last: bool) -> bool:
        e = self.cfg.eval
        return e.long_doc_loss and (last or (e.long_doc_interval > 0 and self.step % e.long_doc_interval == 0))

    def _long_doc_eval(self) -> dict:
        """Loss by position bucket on held-out documents, on the training mesh; logged with this step."""
        from data.sources import heldout_rows
        from training.evaluation import long_document_loss

        p = self.cfg.parallelism
        masked_or_cp = p.cp > 1 or self.cfg.data.document_masking
        result = long_document_loss(
            self.model, heldout_rows(self.cfg, self.stores), self.cfg.eval.long_doc_rows,
            device=self.device.torch_device, dp_rank=self.mesh.dp_rank, dp_size=self.dims.dp,
            reduce_sums=lambda values: self.comm.reduce_values(values, group=self.mesh.data.get_group()),
            cp_context=self._cp_context if masked_or_cp else None, cp_mesh=self.mesh.cp_mesh, cp_size=p.cp,
            load_balancer=p.cp_load_balancer)
        if self.rank == 0:
            print("long-document loss by position: " + "  ".join(f"{k} {v:.3f}" for k, v in result.items()),
                  flush=True)
        return {"long_doc_loss": result}

    def _announce(self) -> None:
        if self.rank != 0:
            return
        t, d, m = self.cfg.training, self.dims, self.model_cfg
        where = f"{self.stage.name} from step {self.stage.start_step}: " if self.stage.index >= 0 else ""
        print(f"{where}training {m.n_layers}-layer dim-{m.dim} Llama on {d.world_size} rank(s) "
              f"({self.device.type}/{self.device.backend}); mesh pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard "
              f"{d.dp_shard} x cp {d.cp} x tp {d.tp}; seq {t.seq_len}, global batch {self.global_batch_size} "
              f"({self.grad_accum} micro-step(s)), rope theta {m.rope_theta:g}, peak {self.peak_flops / 1e9:.0f} "
              f"GFLOP/s per rank ({self.peak_source})", flush=True)

    def _log_step(self, loss: float, lr: float, grad_norm: float, step_time: float, data_time: float,
                  tokens: int, source_tokens: dict[str, int], evaluation: dict) -> None:
        from training.hardware import peak_memory_gib
        from parallelisms.parallelize import compile_counters
        from training.roofline import Layout, fsdp_bytes_per_step

        t, d = self.cfg.training, self.dims
        ring_bytes = self.comm_stats.kv_bytes_sent + self.comm_stats.backward_bytes_sent
        ring_per_step = (ring_bytes - self._logged[0]) / max(1, self.step - self._logged[1])
        self._logged = (ring_bytes, self.step)
        reshard = self.cfg.parallelism.fsdp_reshard_after_forward in ("always", "default" if d.pp == 1 else "")
        layout = Layout(d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp, 1)
        fsdp_bytes = sum(fsdp_bytes_per_step(self.model_cfg, layout, t.dtype, self.grad_accum, reshard))
        # Maxima over ranks: step_time is the slowest rank's; -step_time gives the fastest rank's.
        step_time, memory, data_time, ring_per_step, fastest = self.comm.reduce_values(
            [step_time, peak_memory_gib(self.device), data_time, ring_per_step, -step_time], op="max")
        tokens_per_sec = self.global_batch_size * t.seq_len / step_time
        mfu = self.flops_per_token * tokens_per_sec / (self.peak_flops * d.world_size)
        self.logger.log(self.step, {
            "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_rank": tokens_per_sec / d.world_size, "mfu": mfu,
            "peak_flops_per_rank": self.peak_flops, "peak_source": self.peak_source,
            "seq_len": t.seq_len, "cp": d.cp, "global_batch_size": self.global_batch_size,
            "tokens_per_step": self.global_batch_size * t.seq_len, "rope_theta": self.model_cfg.rope_theta,
            "stage": max(0, self.stage.index), "tokens_seen": tokens, "memory": memory,
            "step_time": step_time, "data_time": data_time, "step_time_fastest_rank": -fastest,
            "cp_comm_bytes": ring_per_step, "fsdp_comm_bytes": fsdp_bytes, "cp_attention_calls": self.comm_stats.calls,
            "source_tokens": source_tokens, **evaluation,
            **({"compile": compile_counters()} if t.compile else {})})

    def evaluate_passkey(self) -> None:
        """Passkey retrieval by depth x context length on the training mesh; table printed and saved as JSON."""
        import json

        from training.evaluation import evaluate_passkey, format_passkey_table

        e, p = self.cfg.eval, self.cfg.parallelism
        depths = [i / max(1, e.passkey_depths - 1) for i in range(e.passkey_depths)]
        results = evaluate_passkey(
            self.model, self.tokenizer, None, context_lengths=e.passkey_lengths or [self.cfg.training.seq_len],
            depths=depths, samples=e.passkey_samples, seed=self.cfg.job.seed, device=self.device.torch_device,
            cp_context=self._cp_context if (p.cp > 1 or self.cfg.data.document_masking) else None,
            cp_mesh=self.mesh.cp_mesh, cp_size=p.cp, load_balancer=p.cp_load_balancer)
        if self.rank == 0:
            print(format_passkey_table(results), flush=True)
            with open(os.path.join(self.cfg.job.dump_folder, "passkey_eval.json"), "w") as f:
                json.dump([{"context_length": n, "depth": d, "accuracy": a} for (n, d), a in results.items()], f)

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
        preflight_stages(cfg, world, check_data=False)
        from data.sources import check_sources
        from models.llama import model_config
        vocab_size = model_config(cfg.model.name, **model_overrides(cfg)).vocab_size
        if "--prepare-data" in flags:  # one process, any machine (a login node too): tokenize every source, stop
            from data.sources import prepare_data
            check_sources(cfg)
            prepare_data(cfg, vocab_size)
            return 0
        from training.device_check import check_gpus
        check_gpus(cfg, world)  # a GPU-sized recipe without GPUs stops here, in one line
        check_sources(cfg)  # data paths (after the GPU check: on a laptop the GPU count is the news)
        from training.checkpoint import preflight_checkpoint
        preflight_checkpoint(cfg, model_config(cfg.model.name, **model_overrides(cfg)))
        if "--check" in flags:
            if cfg.data.dataset == "text":  # before any process group: tokenizer and data errors, stale stores, and a
                from data.sources import build_run_tokenizer, open_stores  # missing store prepared here, once
                open_stores(cfg, build_run_tokenizer(cfg, vocab_size), log=lambda line: print(line, file=sys.stderr))
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
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and the process group is gone; skip interpreter teardown, where a c10d/gloo thread still
    # alive at static destruction now and then aborts a run that succeeded ("terminate called without an active
    # exception", seen once in ~300 CI launches).
    os._exit(exit_code)
