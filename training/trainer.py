"""The training loop: builds a run (training/build.py), then steps it through its ramp stages, logging, saving
checkpoints and, at the end, evaluating. Each optimizer step runs `grad_accum_steps` micro-steps of training/step.py.
"""
from __future__ import annotations

import contextlib
import math
import os
import time

import torch
import torch.distributed as dist

from config.schema import Config
from data.sources import describe_chat_rows, labels_every_token, packing_efficiency
from models.cpu_half_gemm import reroute_half_gemms
from parallelisms.context_parallel import CommStats
from parallelisms.float8 import describe_float8, precompute_float8_scales
from parallelisms.parallelize import compile_counters, compile_surprises, uses_loss_parallel
from parallelisms.stage_meshes import release_stage
from parallelisms.cp.flash_impls import activate_flash_implementation
from parallelisms.cp.kernel_blocks import family_on
from parallelisms.cp.kernel_cudnn_thd import documents_kernel_name
from training import step
from training.batch_plans import stage_step_loader
from training.build import (build_model, build_optimizer, build_run_meshes, build_shared_tokenizer, build_stage_data,
                            build_stores, flight_recorder_folder, init_distributed)
from training.checkpoint import Checkpointer
from training.hf_export import export_extras
from training.evaluation.passkey import passkey_stop_reached, passkey_stop_rule, run_long_doc_eval, run_passkey_eval
from training.hardware import peak_flops
from training.evaluation.niah import run_niah_eval
from training.loss import global_label_tokens
from training.metrics import MetricsLogger, StepMetrics, visible_pairs
from training.launch_checks.preflight import preflight_stages
from training.preemption import StopSignals, ignore_stop_signals, start_compile_workers_deaf_to
from training.rank_positions import RankPositions, hang_line, newest_checkpoint, write_details
from training.ramp import RampStage, model_build_config, source_tokens_seen, stage_at, tokens_seen
from training.step import StepSetup, clip_grad_norm_
from training.step_profile import profile_line, profiled_step
from training.stragglers import StragglerWatch
from training.timeouts import CollectiveTimeouts


class Trainer:
    def __init__(self, cfg: Config):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.stages = preflight_stages(cfg, world)
        # First: a signal from here on stops the run after a step, with a checkpoint of it (training/preemption.py).
        self.stop_signals = StopSignals(cfg.checkpoint.save_on_signal if cfg.checkpoint.enable else [])
        # The model is built on the first stage's mesh; later stages only trade dp_shard for cp, so its FSDP, TP and
        # PP groups hold the same ranks in every stage.
        first = self.stage = self.stages[0]
        cfg = first.cfg
        self.dist = init_distributed(cfg)
        self.device = self.dist.device
        self.rank = self.dist.rank
        # where this rank is, in the launch's store: who never arrived, when a collective times out (hang_report)
        self.positions = RankPositions(dist.distributed_c10d._get_default_store() if dist.is_initialized() else None,
                                       self.rank, dist.get_world_size() if dist.is_initialized() else 1)
        # bf16 GEMMs on a CPU without native ones: float32 kernels (models/cpu_half_gemm.py), or 31x slower; only for
        # runs that have half-precision GEMMs (a float32 run's matmuls keep torch's own kernels, without a Python call)
        halves = any(s.cfg.training.dtype != "float32" or s.cfg.training.float8 != "off" for s in self.stages)
        self.half_gemms = reroute_half_gemms(self.device.type) if halves else None
        if self.half_gemms is not None and self.rank == 0 and cfg.training.dtype == "bfloat16":
            print("bf16 GEMMs run as float32 GEMMs rounded to bf16: this CPU's torch has no native bf16 GEMM "
                  "(AVX-512 or AMX), and its portable one is ~30x slower", flush=True)
        self.attention_kernel = family_on(cfg.parallelism.attention_kernel, self.device.torch_device)
        activate_flash_implementation(self.attention_kernel)  # FA3/FA4: torch's flash ops switched, on every rank
        self.documents_kernel = documents_kernel_name(
            cfg.parallelism.attention_kernel, self.device.torch_device, getattr(torch, cfg.training.dtype),
            first.model.head_dim) if cfg.data.document_masking else None
        self.meshes = build_run_meshes(self.stages, self.device.type)  # every process group, made once, here
        self.mesh = self.meshes[0]
        self.timeouts = CollectiveTimeouts(  # long until each stage's warm-up steps ran, then the step timeout
            cfg.job.init_timeout_s, cfg.job.step_timeout_s, log=(lambda line: print(line, flush=True)) if self.rank == 0 else None)
        self.timeouts.start_stage(self.mesh)
        torch.manual_seed(cfg.job.seed)
        self.tokenizer = build_shared_tokenizer(cfg, first.model.vocab_size, self.rank)
        self.stores = build_stores(cfg, self.tokenizer, self.rank)  # memory-mapped: no rank holds the corpus
        # One build for every stage: with the activation offloader when any stage offloads (switched per stage).
        built = build_model(model_build_config(self.stages), first.model, self.mesh, self.device.torch_device)
        self.model_parts, self.pipeline = built.parts, built.pipeline
        self.model = self.model_parts[0]
        self.offloaders = [part.activation_offloader for part in self.model_parts
                           if hasattr(part, "activation_offloader")]
        self.optimizer, self.scheduler = build_optimizer(cfg, self.model_parts, self.device.type)
        self.comm_stats = CommStats()
        self.compiled = cfg.training.compiles(self.device.type)
        if self.stop_signals.names and any(s.cfg.training.compiles(self.device.type) for s in self.stages):
            start_compile_workers_deaf_to(self.stop_signals.names)  # before any compile: a signal must not kill them
        self.float8 = cfg.training.float8 != "off"
        """Float8 linear layers (parallelisms/float8.py): their weights' scales follow every optimizer step."""
        self.compile_first_step_s: float | None = None
        """The first training step's time in this process when compiled (graphs built in it), in metrics.jsonl."""
        self.compile_warned: set[str] = set()
        self.whole_row_steps = 0
        """Steps placed by work that fell back to whole-row moves (metrics.jsonl: placement_whole_row_steps)."""
        self.step_pairs: list[torch.Tensor] = []
        """This rank's visible attention pairs in each micro-step of the last step (training/metrics.py)."""
        self.dataloader = self._enter_stage(first)
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.job.dump_folder, self.model_parts, self.optimizer,
                                         self.scheduler, self.dataloader, first.model, vars(first.dims),
                                         export_extras(cfg, self.stages, self.tokenizer))
        self.step = self.checkpointer.load()  # 0, or the step of the checkpoint resumed
        resumed = stage_at(self.stages, self.step)
        if resumed is not self.stage:  # the data position carries over only inside the stage that saved it
            same_stage = self.step > 0 and stage_at(self.stages, self.step - 1) is resumed
            self._switch_stage(resumed, self.dataloader.global_rows_consumed if same_stage else 0)
        if self.float8:  # the first step's weight scales too, from the weights it starts from (fresh or resumed)
            precompute_float8_scales(self.model_parts)
        dist.barrier()  # every rank measures its peak at the same time, sharing the cores as in training
        self.peak_flops, self.peak_source = peak_flops(self.device, getattr(torch, cfg.training.dtype),
                                                         cfg.data.cache_dir)
        self.metrics = StepMetrics(self.dist.comm, self.comm_stats, self.device, self.peak_flops, self.peak_source,
                                   self.step, self.attention_kernel, self.documents_kernel)
        self.stragglers = StragglerWatch.start(  # who the others wait for (training/stragglers.py)
            cfg.metrics, self.dist.comm, self.rank, dist.get_world_size() if dist.is_initialized() else 1)
        self.logger = MetricsLogger(cfg.job.dump_folder, cfg.training.steps, cfg.metrics.enable_tensorboard,
                                    is_writer=self.rank == 0, start_step=self.step)

    @property
    def cfg(self) -> Config:
        return self.stage.cfg

    def _enter_stage(self, stage: RampStage, rows_consumed: int = 0):
        """Switches to a ramp stage: its mesh (cp traded against dp_shard), its step setup and RoPE; returns the
        data loader at its sequence length (continuing at `rows_consumed` of that stage's row stream)."""
        index = next(i for i, s in enumerate(self.stages) if s is stage)
        if self.meshes[index] is not self.mesh:  # made at setup; the old stage's own groups are destroyed
            release_stage(self.mesh, self.meshes[index:])
            self.mesh = self.meshes[index]
        self.stage, cfg = stage, stage.cfg
        self.setup = StepSetup(self.model, self.mesh, cfg.parallelism, cfg.data.document_masking,
                               uses_loss_parallel(cfg, self.mesh), self.comm_stats, self.pipeline,
                               cfg.training.loss_tile_tokens(stage.model.vocab_size),
                               sparse_labels=not labels_every_token(cfg), float8=cfg.training.float8)
        m = stage.model
        for part in self.model_parts:
            part.set_rope_from(m)
        for offloader in self.offloaders:  # the old stage's host arena is unpinned and freed (host_arena.py)
            offloader.release_arena()
            ac = cfg.activation_checkpoint
            offloader.follow(ac)
        self.places_by_work = cfg.data.places_by_work()
        micro_loader = build_stage_data(cfg, self.tokenizer, self.stores, self.mesh, rows_consumed)
        # whole steps with their host plans, made in the loader's workers (training/batch_plans.py)
        return stage_step_loader(cfg, self.setup, micro_loader, stage.grad_accum_steps, self.device.type,
                                 pin_memory=self.device.type == "cuda",
                                 worker_init_fn=ignore_stop_signals if self.stop_signals.names else None)

    def _switch_stage(self, stage: RampStage, rows_consumed: int = 0) -> None:
        self.dataloader = self.checkpointer.dataloader = self._enter_stage(stage, rows_consumed)
        self.timeouts.start_stage(self.mesh)

    def train_step(self, batches: list[dict]) -> tuple[float, float]:
        """One optimizer step over `grad_accum_steps` micro-batches; returns (global mean loss, grad norm).

        The loss is the true global mean: local token sums / global token count, summed over the loss mesh
        (dp x cp; TP ranks already hold the same value) and, under PP, taken from the rank holding the last stage.
        """
        cfg, device = self.cfg, self.device.torch_device
        global_tokens = global_label_tokens(
            batches, every_token_labelled=labels_every_token(cfg), rows_per_step=self.stage.global_batch_rows,
            seq_len=cfg.training.seq_len, comm=self.dist.comm, data_group=self.mesh.data.get_group())
        loss = torch.zeros((), dtype=torch.float32, device=device)
        pairs = []
        for micro, batch in enumerate(batches):
            self.positions.post(self.step + 1, "forward/backward", micro)
            local = step.move_batch(batch, device)
            loss += step.micro_step(self.setup, local, global_tokens)
            pairs.append(visible_pairs(local["position_ids"]))  # after the step: this rank's CP shard
        self.step_pairs = pairs
        self.positions.post(self.step + 1, "optimizer")
        pp_group = self.mesh.pp_mesh.get_group() if self.stage.dims.pp > 1 else None
        params = [p for part in self.model_parts for p in part.parameters()]
        grad_norm = clip_grad_norm_(params, cfg.training.max_norm, pp_group)
        step.optimizer_step(self.optimizer, self.scheduler, self.model_parts, self.float8)
        if self.stage.dims.world_size > 1:
            self.dist.comm.all_reduce_(loss, group=self.mesh.loss.get_group())
        if pp_group is not None:  # only the ranks holding the last stage have a non-zero loss
            self.dist.comm.all_reduce_(loss, group=pp_group)
        return loss.item(), float(grad_norm)

    def run(self) -> str | None:
        """Trains to the last step and evaluates; returns None, or the signal the run stopped on after saving a
        checkpoint of the step it was in (training/preemption.py)."""
        self._announce()
        data_iter = iter(self.dataloader)
        resumed_at = self.step
        while self.step < self.cfg.training.steps:
            stage = stage_at(self.stages, self.step)
            if stage is not self.stage:
                if self.cfg.checkpoint.enable and self.step % self.cfg.checkpoint.interval:
                    with self._long_phase("checkpoint"):
                        self.checkpointer.save(self.step)  # a stage boundary is always a checkpoint
                self._switch_stage(stage)
                self._announce()
                data_iter = iter(self.dataloader)
            start = time.perf_counter()
            self.positions.post(self.step + 1, "data")
            batches = self._step_batches(data_iter)
            data_time = time.perf_counter() - start
            lr = self.scheduler.get_last_lr()[0]
            profiled = self.cfg.metrics.profile_step == self.step + 1  # [metrics] profile_step: under torch.profiler
            # the split leaves out this process's first step (lazy set-up and allocations, not a rank's pace)
            split = self.stragglers.split if self.stragglers and self.step > resumed_at else None
            with split.step() if split else contextlib.nullcontext(), \
                    self._profiled() if profiled else contextlib.nullcontext() as profile:
                loss, grad_norm = self.train_step(batches)
            if split:
                split.add_data(data_time)
            if profiled and profile.summary is not None and self.rank == 0:
                print(profile_line(profile.summary, profile.path), flush=True)
            self.step += 1
            step_time = time.perf_counter() - start
            self.timeouts.step_done(step_time)
            if self.compiled:
                self._report_compile(step_time)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {self.step}; lower optimizer.lr or check data.")
            last = self.step == self.cfg.training.steps
            evaluation = {}
            if self._passkey_due(last):  # may make this step the run's last (eval.passkey_stop_at)
                with self._long_phase("evaluation"):
                    evaluation, last = self._passkey_eval()
            if self._long_doc_eval_due(last):
                with self._long_phase("evaluation"):
                    evaluation.update(self._long_doc_eval())
            if self._niah_due(last):
                with self._long_phase("evaluation"):
                    run_niah_eval(self.cfg, self.setup, self.tokenizer, self.stores, self.device.torch_device,
                                  self.rank == 0, self.step, self.dist.comm)
            if self.step % self.cfg.metrics.log_freq == 0 or last or evaluation:
                record = self.metrics.record(
                    self.stage, self.step, loss=loss, lr=lr, grad_norm=grad_norm, step_time=step_time,
                    data_time=data_time, tokens_seen=tokens_seen(self.stages, self.step),
                    visible_pairs=torch.stack(self.step_pairs).tolist())
                if profiled:  # the profiler slowed this step: step-time medians leave it out
                    record["profiled"] = True
                if "compile" in record:
                    record["compile"]["first_step_s"] = self.compile_first_step_s
                if self.stores:
                    record["source_tokens"] = source_tokens_seen(self.stages, self.step)
                    if efficiency := packing_efficiency(self.cfg, self.dataloader.packed):  # chat sources' rows
                        record["packing_efficiency"] = efficiency
                if self.places_by_work:  # steps of this process that moved whole rows (no exact fill)
                    record["placement_whole_row_steps"] = self.whole_row_steps
                if self.offloaders:  # this rank's offloaded block inputs at their most since the last record
                    record["offload_host_peak_bytes"] = sum(o.peak_host_bytes for o in self.offloaders)
                    record["offload_pinned_bytes"] = sum(o.pinned_bytes for o in self.offloaders)  # 0 on CPU
                    record["offload_arena_bytes"] = sum(o.arena_bytes for o in self.offloaders)
                    for offloader in self.offloaders:
                        offloader.reset_peak()
                note = self.stragglers.compare(record, self._hosts) if self.stragglers else ""
                self.logger.log(self.step, {**record, **evaluation}, note)
            # The step's record is written before its checkpoint: a run killed between the two resumes from the
            # checkpoint before and logs the step again, where the other order lost the step's record for good.
            if self.checkpointer.due(self.step, last):
                with self._long_phase("checkpoint"):
                    self.checkpointer.maybe_save(self.step, last=last)
            stop = self.stop_signals.agreed(self.dist.comm, self.device.torch_device)
            if stop and not last:  # at the last step the run ends as usual, its checkpoint saved above
                self._save_and_stop(stop)
                return stop
            if last:  # training.steps, or an early stop on the passkey accuracy
                break
        self.timeouts.start_stage(self.mesh)  # the end-of-run evaluations: the long timeout
        self.positions.post(self.step, "evaluation")
        if self.cfg.eval.niah and self.step == resumed_at:
            # resumed at the last step (nothing to train): evaluate the checkpoint, e.g. on another mesh
            run_niah_eval(self.cfg, self.setup, self.tokenizer, self.stores, self.device.torch_device,
                          self.rank == 0, self.step, self.dist.comm)
        if self.cfg.eval.passkey and self.step == self.cfg.training.steps:  # else its stop's evaluation was the last
            run_passkey_eval(self.cfg, self.setup, self.tokenizer, self.device.torch_device, self.rank == 0,
                             self.dist.comm)
        return None

    def _passkey_due(self, last: bool) -> bool:
        """eval.passkey_interval: an evaluation during the last ramp stage (the one at the end runs after the loop)."""
        e = self.cfg.eval
        return (e.passkey and e.passkey_interval > 0 and not last and self.stage is self.stages[-1]
                and self.step % e.passkey_interval == 0)

    def _passkey_eval(self) -> tuple[dict, bool]:
        """The passkey table now ({"passkey_accuracy": mean} for the step's record) and whether it ends the run: every
        cell at eval.passkey_stop_at or better and the mean at eval.passkey_stop_mean or better, where set (the
        accuracies are reduced over ranks, so every rank agrees)."""
        results = run_passkey_eval(self.cfg, self.setup, self.tokenizer, self.device.torch_device, self.rank == 0,
                                   self.dist.comm)
        reached = passkey_stop_reached(self.cfg.eval, results)
        if reached and self.rank == 0:
            print(f"passkey accuracy {passkey_stop_rule(self.cfg.eval)} at step {self.step}: the run ends here "
                  f"(eval.passkey_stop_at/_mean), its checkpoint saved as at the last step", flush=True)
        return {"passkey_accuracy": sum(results.values()) / len(results)}, reached

    def _hosts(self) -> dict[int, str]:
        return {r: post.host for r, (post, _) in self.positions.read().items() if post}

    def _save_and_stop(self, name: str) -> None:
        """Every rank, after the same step: a synchronous checkpoint of it (unless this step's interval save is it),
        published before the line that says so."""
        with self._long_phase("checkpoint"):
            if self.checkpointer.saved_step != self.step:
                self.checkpointer.save(self.step)
            self.checkpointer.wait()  # an async save (this one or the one in flight) is published first
        self.stop_signals.report(name, self.step, self.rank)

    @contextlib.contextmanager
    def _long_phase(self, name: str):
        """A checkpoint save or an evaluation after the current step: posted as this rank's position and run under
        the long collective timeout."""
        self.positions.post(self.step, name)
        with self.timeouts.phase():
            yield

    def _profiled(self):
        """The step about to run under torch.profiler (training/step_profile.py), its summary per rank in the dump
        folder."""
        n = self.step + 1
        path = os.path.join(self.cfg.job.dump_folder, f"profile_step{n}_rank{self.rank}.json")
        return profiled_step(path, self.device.type, n, self.rank)

    def _report_compile(self, step_time: float) -> None:
        """Rank 0: the first step's time (when torch.compile builds the blocks' graphs) once, and a warning line for
        every new reason dynamo broke a graph or gave up on a frame (parallelize.compile_surprises)."""
        if self.compile_first_step_s is None:
            self.compile_first_step_s = step_time
            if self.rank == 0:
                counters = compile_counters()
                print(f"torch.compile: the first step took {step_time:.1f}s (graphs built: "
                      f"{counters['unique_graphs']}, graph breaks: {sum(counters['graph_breaks'].values())})",
                      flush=True)
        for line in compile_surprises(compile_counters()):
            if line not in self.compile_warned:
                self.compile_warned.add(line)
                if self.rank == 0:
                    print(f"warning: torch.compile: {line}", flush=True)

    def _step_batches(self, data_iter) -> list[dict]:
        """This rank's micro-batches of the next optimizer step (placed by work and planned in the workers)."""
        planned = next(data_iter)
        self.whole_row_steps += planned["whole_rows"]
        return planned["micro_batches"]

    def _niah_due(self, last: bool) -> bool:
        e = self.cfg.eval
        return e.niah and (last or (e.niah_interval > 0 and self.step % e.niah_interval == 0))

    def _long_doc_eval_due(self, last: bool) -> bool:
        e = self.cfg.eval
        return e.long_doc_loss and (last or (e.long_doc_interval > 0 and self.step % e.long_doc_interval == 0))

    def _long_doc_eval(self) -> dict:
        return run_long_doc_eval(self.cfg, self.setup, self.stores, self.device.torch_device, self.dist.comm,
                                 self.rank == 0)

    def _announce(self) -> None:
        if self.rank != 0:
            return
        s, d, m = self.stage, self.stage.dims, self.stage.model
        where = f"{s.name} from step {s.start_step}: " if s.index >= 0 else ""
        family = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[m.family]
        print(f"{where}training {m.n_layers}-layer dim-{m.dim} {family}{' (tied)' if m.tie_embeddings else ''} on "
              f"{d.world_size} rank(s) "
              f"({self.device.type}/{self.device.backend}); mesh pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard "
              f"{d.dp_shard} x cp {d.cp} x tp {d.tp}; seq {s.cfg.training.seq_len}, global batch "
              f"{s.global_batch_rows} ({s.grad_accum_steps} micro-step(s)), attention kernel {self.attention_kernel}"
              f"{f' (documents: {self.documents_kernel})' if self.documents_kernel else ''}, rope "
              f"theta {m.rope_theta:g}"
              f"{f' {m.rope_type} x{m.rope_scaling_factor:g}' if m.rope_scaling_factor else ''}, peak "
              f"{self.peak_flops / 1e9:.0f} GFLOP/s per rank ({self.peak_source})", flush=True)
        if self.float8:
            print(describe_float8(self.model_parts, s.cfg, self.device.type), flush=True)
        if self.stores:
            for line in describe_chat_rows(s.cfg, self.dataloader.packed):
                print(line, flush=True)

    def hang_report(self, details: str) -> str:
        """After this rank's collective timed out: `details` (the tracebacks) in the dump folder's hang/ and the one
        line naming who never arrived (training/rank_positions.py)."""
        folder = write_details(self.cfg.job.dump_folder, self.rank, details)
        return hang_line(self.rank, self.positions.read(), time.time(), self.timeouts.current_s,
                         newest_checkpoint(self.checkpointer.folder) if self.cfg.checkpoint.enable else None, folder,
                         flight_recorder_folder(self.cfg, self.device.backend))

    def close(self, hung: bool = False) -> None:
        """`hung`: a collective timed out; the barrier and an async save in flight would wait for the rank that
        never arrived, so neither is waited for."""
        self.stop_signals.close()
        self.positions.close()
        if self.stragglers:
            self.stragglers.close()
        if not hung:
            self.checkpointer.close()  # waits for an async save in flight
        self.logger.close()
        if dist.is_initialized():
            if not hung:
                dist.barrier()
            dist.destroy_process_group()
