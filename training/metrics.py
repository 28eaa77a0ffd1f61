"""One logged step: its numbers (throughput, MFU against the measured peak, communication bytes: `StepMetrics`), and
the three places they go (`MetricsLogger`): a console progress line, <dump>/metrics.jsonl and TensorBoard
(<dump>/tb). Every rank computes the record (the reductions over ranks are collectives); only the first one writes.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.utils.tensorboard import SummaryWriter

from config import RecipeError
from models.llama import flops_per_token
from parallelisms.comm import Collectives
from parallelisms.context_parallel import CommStats
from parallelisms.parallelize import compile_counters
from training.hardware import Device, peak_host_gib, peak_memory_gib
from training.ramp import RampStage
from training.planning.workload import Layout, float8_gathered_params, fsdp_bytes_per_step


def format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def read_metrics(folder: str) -> list[dict]:
    """Every record of <folder>/metrics.jsonl in order: the one reader of the benches, the GPU report and the tests
    (a torn last line is left out, a damaged one elsewhere is a RecipeError naming it, as on a resume)."""
    return [record for _, record in _records(os.path.join(folder, "metrics.jsonl"))]


def _records(path: str) -> list[tuple[str, dict]]:
    """(line, record) of each record of `path`. A run killed while writing a record leaves a torn last line: it is
    dropped with a warning (the step it held is replayed after the checkpoint anyway). A damaged line elsewhere is
    not a torn write but an edited or corrupted file: a one-line error naming the line."""
    with open(path) as f:
        lines = f.readlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError:
            if number == len(lines):
                print(f"warning: {path}: dropped its torn last line {number} (the run was killed while writing it; "
                      f"that step is logged again after the resume)", file=sys.stderr, flush=True)
                continue
            raise RecipeError(f"{path} line {number} is not a JSON record; repair or remove that line (or move the "
                              f"file away) and resume.") from None
    return out


def _drop_records_after(path: str, step: int) -> None:
    """Keeps the records of steps <= `step` (all of them when starting fresh at step 0 in a new folder); a torn last
    line goes, a damaged one stops the run (`_records`). The file is rewritten through a temporary file and a
    rename, so a kill during this rewrite leaves the old file or the new one, never half."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line if line.endswith("\n") else line + "\n" for line, record in _records(path)
            if record.get("step", 0) <= step]
    if kept != lines:
        temporary = path + ".tmp"
        with open(temporary, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)


class MetricsLogger:
    def __init__(self, dump_folder: str, total_steps: int, enable_tensorboard: bool, is_writer: bool,
                 start_step: int = 0):
        self.total_steps = total_steps
        self.is_writer = is_writer
        self.start_time = time.perf_counter()
        self.start_step = start_step
        self.jsonl = None
        self.tb = None
        if not is_writer:
            return
        os.makedirs(dump_folder, exist_ok=True)
        path = os.path.join(dump_folder, "metrics.jsonl")
        _drop_records_after(path, start_step)  # a resumed run replays the steps after its checkpoint
        self.jsonl = open(path, "a", buffering=1)
        if enable_tensorboard:
            self.tb = SummaryWriter(os.path.join(dump_folder, "tb"), purge_step=start_step + 1 if start_step else None)

    def log(self, step: int, record: dict, line_note: str = "") -> None:
        """`record` holds the CONTRACT fields (loss, lr, grad_norm, tokens_per_sec, mfu, seq_len, cp,
        global_batch_size, memory, ...); every number also becomes a TensorBoard scalar. `line_note` ends the
        console line (a straggler named, training/stragglers.py)."""
        if not self.is_writer:
            return
        record = {"step": step, **record}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, step)
                elif isinstance(value, dict):  # e.g. source_tokens: one curve per source (numbers only)
                    for name, item in value.items():
                        if isinstance(item, (int, float)):
                            self.tb.add_scalar(f"{key}/{name}", item, step)
        done = step - self.start_step
        elapsed = time.perf_counter() - self.start_time
        eta = elapsed / max(1, done) * (self.total_steps - step)
        print(f"step {step:>5}/{self.total_steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
              f"gnorm {record['grad_norm']:.3f}  tok/s {record['tokens_per_sec']:,.0f}  mfu {100 * record['mfu']:.1f}%  "
              f"mem {record['memory']:.2f}GiB  eta {format_eta(eta)}{line_note}", flush=True)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


class StepMetrics:
    """Turns a step's timings into the logged record: the slowest rank's times, tokens/s, MFU against the measured
    per-rank peak, and the bytes CP attention and FSDP sent per step."""

    def __init__(self, comm: Collectives, comm_stats: CommStats, device: Device, peak_flops: float, peak_source: str,
                 step: int, attention_kernel: str = "flash", documents_kernel: str | None = None):
        self.comm, self.comm_stats, self.device = comm, comm_stats, device
        self.attention_kernel = attention_kernel  # the CP attention's kernel family (cp/kernel_blocks.py)
        self.documents_kernel = documents_kernel  # packed documents' kernel (cp/kernel_cudnn_thd.py), when masking
        self.peak_flops, self.peak_source = peak_flops, peak_source
        self._cp_bytes_at = (comm_stats.bytes_sent, step)  # (bytes sent, step) when last logged

    def _documents_record(self) -> dict:
        return _documents_record_of(self.documents_kernel, self.device)

    def _cp_bytes_per_step(self, step: int) -> float:
        sent, since = self.comm_stats.bytes_sent, self._cp_bytes_at
        self._cp_bytes_at = (sent, step)
        return (sent - since[0]) / max(1, step - since[1])

    def record(self, stage: RampStage, step: int, *, loss: float, lr: float, grad_norm: float, step_time: float,
               data_time: float, tokens_seen: int, visible_pairs: list[int]) -> dict:
        """`visible_pairs`: this rank's attention pairs in each micro-step of the step (`visible_pairs` below)."""
        t, d, m = stage.cfg.training, stage.dims, stage.model
        layout = Layout(d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp, 1)
        float8 = float8_gathered_params(m, t.float8, stage.cfg.model.mlp_chunk_tokens > 0)
        fsdp_bytes = sum(fsdp_bytes_per_step(m, layout, t.dtype, stage.grad_accum_steps,
                                             stage.cfg.parallelism.reshard_after_forward, float8))
        # Maxima over ranks: step_time is the slowest rank's; -step_time gives the fastest rank's; the largest peak
        # resident set; then each micro-step's busiest rank's pairs.
        step_time, memory, data_time, cp_bytes, fastest, host_memory, *busiest = self.comm.reduce_values(
            [step_time, peak_memory_gib(self.device), data_time, self._cp_bytes_per_step(step), -step_time,
             peak_host_gib(), *visible_pairs], op="max")
        all_pairs = self.comm.reduce_values([sum(visible_pairs)], op="sum")[0]
        tokens_per_sec = stage.tokens_per_step / step_time
        # dp x cp ranks hold distinct tokens; TP and PP ranks repeat their dp x cp rank's pairs.
        step_pairs = all_pairs / (d.tp * d.pp)
        dense = flops_per_token(m, 0)
        per_pair = flops_per_token(m, 1, causal=False) - dense  # the attention term counts seq_len keys per token
        mfu = (dense * stage.tokens_per_step + per_pair * step_pairs) / step_time / (self.peak_flops * d.world_size)
        mfu_causal = flops_per_token(m, t.seq_len) * tokens_per_sec / (self.peak_flops * d.world_size)
        return {
            "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_rank": tokens_per_sec / d.world_size, "mfu": mfu, "mfu_causal": mfu_causal,
            "attention_balance": attention_balance(busiest, all_pairs, d.world_size),
            "attention_pairs": step_pairs,
            "peak_flops_per_rank": self.peak_flops, "peak_source": self.peak_source,
            "seq_len": t.seq_len, "cp": d.cp, "global_batch_size": stage.global_batch_rows,
            "tokens_per_step": stage.tokens_per_step, "rope_theta": m.rope_theta,
            "stage": max(0, stage.index), "tokens_seen": tokens_seen, "memory": memory,
            "host_memory": host_memory,  # the busiest rank's peak resident set, GiB (on CPU the same as memory)
            "step_time": step_time, "data_time": data_time, "step_time_fastest_rank": -fastest,
            "cp_comm_bytes": cp_bytes, "fsdp_comm_bytes": fsdp_bytes, "cp_attention_calls": self.comm_stats.calls,
            "attention_kernel": self.attention_kernel, **self._documents_record(),
            **({"compile": compile_counters()} if t.compiles(self.device.type) else {})}


def _documents_record_of(documents_kernel: str | None, device) -> dict:
    """The documents' kernel and, on cuDNN THD, how many graphs it has built per direction (its shape buckets)."""
    if documents_kernel is None:
        return {}
    record = {"documents_kernel": documents_kernel}
    if documents_kernel == "cudnn_thd":
        from parallelisms.cp.kernel_cudnn_thd import graphs_for

        record["cudnn_thd_graphs"] = graphs_for(device.torch_device).built
    return record


def visible_pairs(position_ids: torch.Tensor) -> torch.Tensor:
    """The causal (query, key) pairs attention computes for these tokens (a device scalar, no host sync).

    A token at position p sees p + 1 keys: with document masking positions restart at every document (and row)
    start, so p + 1 is exactly its document's earlier tokens and itself; without, positions run 0..S-1 along the
    row. It holds for any subset of a row's tokens, so a CP rank counts its own shard, whatever the layout."""
    return (position_ids + 1).sum()


def attention_balance(busiest: list[float], all_pairs: float, ranks: int) -> float:
    """Sum over micro-steps of the busiest rank's pairs / the mean rank's pairs of the step: the attention time the
    step waits for over the time with perfectly even work (1.0 = even; 2.0 = half of it spent waiting)."""
    mean = all_pairs / ranks
    return sum(busiest) / mean if mean else 1.0
