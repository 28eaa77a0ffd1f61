"""One optimizer step under torch.profiler, its device time summed by class of work.

The dry run prices each class of work separately (training/planning/price.py: GEMMs and attention from their
FLOP rates, copy/cast and elementwise work from their bytes over bandwidth, the optimizer and the collectives from
their own rates), with the classes training/planning/fake/counter.py gives every aten op. A profiled step measures the
same classes on the device: each aten op's self device time (CUDA: the kernels it launched itself; CPU: its self CPU
time) goes to the kind that counter gives its name, so a prediction can be checked class by class instead of only as
one step time. `[metrics] profile_step = N` turns it on for step N (training/trainer.py); the step's metrics.jsonl
record says `profiled`, since the profiler slows the step it watches.
"""
from __future__ import annotations

import contextlib
import json
import os
import time

import torch

from training.planning.fake.counter import kind_of_name

TOP_OPS = 15
ATEN = "aten::"


class StepProfile:
    """What profiled_step yields: `summary` is the dict written to the JSON file once the step is done (None until
    then, or when it could not be written)."""

    def __init__(self, path: str):
        self.path = path
        self.summary: dict | None = None


def _is_view(name: str) -> bool:
    """Whether the aten op of this packet name returns a view (views launch no kernel: the dispatch counter's rule)."""
    packet = getattr(torch.ops.aten, name, None)
    overload = getattr(packet, "default", None) if packet is not None else None
    return bool(getattr(overload, "is_view", False))


def _self_device_us(evt, cuda: bool) -> float:
    if not cuda:
        return float(evt.self_cpu_time_total)
    if hasattr(evt, "self_device_time_total"):
        return float(evt.self_device_time_total)
    return float(evt.self_cuda_time_total)


def summarize(prof, step: int, rank: int, device_type: str, wall_s: float) -> dict:
    """The per-kind seconds of one profiled step (see the module docstring); times in seconds."""
    cuda = device_type == "cuda"
    events = list(prof.key_averages())
    by_kind: dict[str, float] = {}
    ops = []
    for evt in events:
        if not evt.key.startswith(ATEN):
            continue
        name = evt.key[len(ATEN):]
        seconds = _self_device_us(evt, cuda) / 1e6
        kind = kind_of_name("aten", name, _is_view(name))
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
        ops.append([evt.key, kind, seconds, int(evt.count)])
    if cuda:
        # Every kernel, memcpy and memset once, launched by an aten op or not (NCCL, Triton, ...): the device-side
        # events themselves. Summing the CPU-side events as well would count each kernel twice.
        device_side = [e for e in events if getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU]
        source = device_side or [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU]
        device_total = sum(_self_device_us(e, True) for e in source) / 1e6
    else:
        device_total = sum(by_kind.values())
    ops.sort(key=lambda op: op[2], reverse=True)
    by_kind = dict(sorted(by_kind.items(), key=lambda kv: kv[1], reverse=True))
    return {"step": step, "rank": rank, "device_type": device_type, "wall_s": wall_s, "by_kind": by_kind,
            "device_total_s": device_total, "unattributed_s": device_total - sum(by_kind.values()),
            "top_ops": ops[:TOP_OPS]}


@contextlib.contextmanager
def profiled_step(path: str, device_type: str, step: int, rank: int):
    """Runs the body under torch.profiler and writes its summary (summarize) as JSON at `path`; yields a StepProfile
    whose `.summary` holds it afterwards. A failure to summarise or write prints one warning and never stops
    training; an exception from the body itself propagates."""
    cuda = device_type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    holder = StepProfile(path)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        yield holder
        if cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    try:
        summary = summarize(prof, step, rank, device_type, wall_s)
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        holder.summary = summary
    except Exception as e:  # noqa: BLE001 - a summary must never end a training run
        print(f"warning: step profile not written ({type(e).__name__}: {e})", flush=True)


def profile_line(summary: dict, path: str = "") -> str:
    """One console line: the step's wall time, its device time and the seconds of each class of work."""
    kinds = ", ".join(f"{kind} {seconds:.3f}" for kind, seconds in summary["by_kind"].items() if seconds > 0)
    where = f" ({path})" if path else ""
    return (f"profile of step {summary['step']}: {summary['wall_s']:.4f} s wall; device "
            f"{summary['device_total_s']:.4f} s: {kinds}{where}")
