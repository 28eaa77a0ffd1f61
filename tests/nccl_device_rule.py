"""A CPU stand-in for NCCL's device rule, group creation and reduce-op agreement, for real multi-process runs.

Device. Under NCCL the run's tensors live on the GPU; an NCCL group has no backend for a host tensor ("No backend
type associated with device type cpu"). On a CPU-only box the run's device IS the CPU, so a host tensor reaching a
collective is invisible. This module gives the host a separate identity again, without moving any data: `HostTensors`
(a TorchFunctionMode) keeps a weak set of the tensors that would be on the host under CUDA, and `CollectiveRules` (a
TorchDispatchMode that sees every `c10d` and `_c10d_functional` op, FSDP2's and DTensor's included) refuses them
with NCCL's message, wherever they were made. A tensor is on the host when it was

- made by `torch.from_numpy` / `torch.frombuffer`, or `torch.as_tensor` of a NumPy array without a device;
- moved there: `.cpu()`, `.to("cpu")` (any string naming the CPU);
- created with a string device naming the CPU (`device="cpu"`), or by the project's own code (not torch's) without
  a device (torch's default device is the host);
- computed only from host tensors (`host.view(-1)`, `host * 2`, `torch.stack(hosts)`); `.to(device)` with a
  `torch.device` brings it back to the run device.

On this box the run device and the host are both "cpu", so a `torch.device("cpu")` object (what `tensor.device`
returns for a run tensor, and the run device itself) counts as the run device, while the string "cpu" counts as the
host: the project writes the string only for host-side tensors. Data are real throughout, so correct code trains
exactly as without the double.

Groups. With a device bound (build.py binds it on CUDA), `new_group` splits the world communicator (ncclCommSplit):
every world rank must call its k-th `new_group` at that point, `use_local_synchronization=True` or not, and the
groups must partition consistently. `new_group` here meets the other ranks through the store first and raises,
naming the ranks that never came, instead of hanging.

Data movement. Inputs are copied at post and outputs poisoned until wait (tests/nccl_async_data.py).

Reduce ops. Every reducing collective (c10d all-reduce / reduce-scatter, their functional forms) on a communicator
compares its op with the other members' (through the store): SUM on one rank and MAX on another is an error, which
NCCL would compute silently with mismatched results.

Run a script under it with `python -m tests.nccl_device_rule SCRIPT [ARGS...]` (e.g. train.py under torchrun).
"""
from __future__ import annotations

import datetime
import json
import os
import runpy
import sys
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode

from tests.nccl_async_data import AsyncData

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
REDUCING = {"allreduce_", "allreduce_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
            "reduce_scatter_tensor_coalesced_", "reduce_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
            "all_reduce_coalesced_", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"}
RULE_TIMEOUT_S = 60


def from_project(frame, include_tests: bool = True) -> bool:
    path = os.path.abspath(frame.f_code.co_filename)
    if not path.startswith(ROOT) or os.sep + ".venv" + os.sep in path or "site-packages" in path:
        return False
    return include_tests or not path.startswith(TESTS + os.sep)


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


class HostTensors(TorchFunctionMode):
    """Tags the tensors that would be host tensors under CUDA (see the module docstring); `run_device_type` is the
    device type the run's buffers have here ("cpu" on this box, "cuda" for the thread double on a GPU). Only the
    project's own calls make host tensors (torch's internals choose their devices right on CUDA); results of host
    tensors are host tensors wherever they are computed."""

    def __init__(self, run_device_type: str | None = "cpu", tests_are_project: bool = True):
        """`tests_are_project=False`: a test's own constructors without a device are not host tensors (the thread
        double's tests build their inputs that way); its explicit host choices still are. `run_device_type=None`:
        the device type of the first buffer that reaches a collective."""
        super().__init__()
        self.run_device_type, self.tests_are_project = run_device_type, tests_are_project
        self.host: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> tensor (ids, not __eq__)

    def is_host(self, tensor: torch.Tensor) -> bool:
        return self.host.get(id(tensor)) is tensor or tensor.device.type != self.run_device_type

    def _tagged(self, tensor: torch.Tensor) -> bool:
        return self.host.get(id(tensor)) is tensor

    def _names_host(self, device) -> bool | None:
        """True: that device is the host; False: the run device (or another); None: no device given."""
        if device is None:
            return None
        return torch.device(device).type == "cpu" and (isinstance(device, str) or
                                                        self.run_device_type not in ("cpu", None))

    def _lands_on_host(self, func, args, kwargs, unnamed_is_host: bool) -> bool | None:
        """True / False when the call names where its result lives (host / run device), None when it does not."""
        name = getattr(func, "__name__", "")
        if func in (torch.from_numpy, torch.frombuffer):
            return True
        if func is torch.as_tensor and isinstance(args[0] if args else None, np.ndarray):
            return kwargs.get("device") is None or bool(self._names_host(kwargs.get("device")))
        if name in ("cpu", "cuda"):
            return name == "cpu"
        if name == "to":
            device = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
            return self._names_host(device)
        if func in _device_constructors():
            named = self._names_host(kwargs.get("device"))
            return (True if unnamed_is_host else None) if named is None else named
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        caller = sys._getframe(1)
        verdict = self._lands_on_host(func, args, kwargs, from_project(caller, self.tests_are_project)) \
            if from_project(caller) else None
        if verdict is not None and args and out is args[0] and self._tagged(out) != verdict:
            out = out.clone()  # `.cpu()` / `.to(device)` returned its input: under CUDA it is a copy elsewhere
        if verdict is None and len(self.host):  # in-place results keep their place
            inputs = list(_tensors((*args, *kwargs.values())))
            verdict = True if inputs and all(t is not out and self._tagged(t) for t in inputs) else None
        if verdict:
            self.host[id(out)] = out
        elif verdict is False and self._tagged(out):
            del self.host[id(out)]
        return out


def host_factories() -> dict:
    """`torch.from_numpy` and `torch.frombuffer` bypass torch-function modes: wrappers that tag their results for
    the HostTensors mode active in the calling thread (install them over torch's for the double's lifetime)."""
    def tagging(real):
        def make(*args, **kwargs):
            out = real(*args, **kwargs)
            if from_project(sys._getframe(1)):
                for mode in torch.overrides._get_current_function_mode_stack():
                    if isinstance(mode, HostTensors):
                        mode.host[id(out)] = out
            return out
        return make
    return {name: tagging(getattr(torch, name)) for name in ("from_numpy", "frombuffer")}


def refuse_off_device(hosts: HostTensors, where: str, tensors) -> None:
    for t in tensors:
        if hosts.run_device_type is None:
            hosts.run_device_type = t.device.type
        if hosts.is_host(t):
            kind = "a host tensor (made by from_numpy, .cpu(), device=\"cpu\" or without a device)" \
                if t.device.type == hosts.run_device_type else f"a {t.device.type} tensor"
            raise RuntimeError(f"No backend type associated with device type cpu (NCCL-rule emulation: {where} got "
                               f"{kind} of shape {tuple(t.shape)}; every buffer must live on the run's device)")


def _group_of(func, args):
    """(name, global ranks) of the communicator a c10d / functional op runs on."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in a._type().qualified_name():
            pg = dist.ProcessGroup.unbox(a)
            return pg.group_name, dist.get_process_group_ranks(pg)
    name = next(a for a in args if isinstance(a, str) and a not in ("sum", "avg", "max", "min", "product"))
    pg = dist.distributed_c10d._resolve_process_group(name)
    return name, dist.get_process_group_ranks(pg)


def _reduce_op_of(args) -> str:
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ReduceOp" in a._type().qualified_name():
            return str(dist.ReduceOp.RedOpType(a.op())).split(".")[-1].lower()
    return next(a for a in args if isinstance(a, str) and a.lower() in ("sum", "avg", "max", "min", "product",
                                                                           "premul_sum", "band", "bor", "bxor"))


class CollectiveRules(TorchDispatchMode):
    """Refuses host tensors in every collective and compares reduce ops across each communicator's members."""

    def __init__(self, hosts: HostTensors, timeout_s: float = RULE_TIMEOUT_S, data: AsyncData | None = None):
        super().__init__()
        self.hosts, self.timeout_s, self.reduce_counts, self.data = hosts, timeout_s, {}, data
        self.checked = 0  # collectives seen (a test can tell the rules ran)
        self.seen: dict[str, int] = {}  # per namespace: c10d (FSDP2, the project), _c10d_functional (DTensor / TP)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
            self.checked += 1
            self.seen[namespace] = self.seen.get(namespace, 0) + 1
            refuse_off_device(self.hosts, str(func), _tensors((*args, *kwargs.values())))
            if func._schema.name.split("::")[-1] in REDUCING:
                self._agree(func, args, _reduce_op_of(args))
        if self.data is not None and namespace == "c10d":
            return self.data.run_c10d(func, args, kwargs)
        if self.data is not None and namespace == "_c10d_functional":
            return self.data.run_functional(func, args, kwargs)
        return func(*args, **kwargs)

    def _agree(self, func, args, op: str) -> None:
        name, ranks = _group_of(func, args)
        count = self.reduce_counts.get(name, 0)
        self.reduce_counts[name] = count + 1
        store, me = dist.distributed_c10d._get_default_store(), dist.get_rank()
        prefix = f"nccl_double/reduce_op/{name}/{count}"
        store.set(f"{prefix}/{me}", op)
        store.wait([f"{prefix}/{r}" for r in ranks], datetime.timedelta(seconds=self.timeout_s))
        ops = {r: store.get(f"{prefix}/{r}").decode() for r in ranks}
        if len(set(ops.values())) > 1:
            raise RuntimeError(f"reduce ops differ in reduction #{count} on ranks {ranks} ({func}): {ops}; NCCL "
                               f"would combine them silently")


def world_new_group(real_new_group, timeout_s: float = RULE_TIMEOUT_S):
    """`new_group` as ncclCommSplit makes it with a bound device: a collective of every world rank (see above)."""
    calls = [0]

    def new_group(ranks=None, *args, **kwargs):
        store, me, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
        members = sorted(range(world) if ranks is None else ranks)
        prefix = f"nccl_double/new_group/{calls[0]}"
        calls[0] += 1
        store.set(f"{prefix}/{me}", json.dumps(members))
        try:
            store.wait([f"{prefix}/{r}" for r in range(world)], datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # the store's timeout: name who never came
            missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
            raise RuntimeError(f"new_group #{calls[0] - 1} (ranks {members}) splits the world communicator "
                               f"(ncclCommSplit, device bound): every world rank must call it, but ranks {missing} "
                               f"did not within {timeout_s:.0f} s") from e
        chosen = {r: json.loads(store.get(f"{prefix}/{r}")) for r in range(world)}
        for r, group in chosen.items():
            if r in group and any(chosen[m] != group for m in group):
                raise RuntimeError(f"new_group #{calls[0] - 1}: rank {r} creates {group}, but its members ask for "
                                   f"{ {m: chosen[m] for m in group} }")
        return real_new_group(ranks, *args, **kwargs)

    return new_group


def install(timeout_s: float = RULE_TIMEOUT_S) -> tuple:
    """Enters both modes for the rest of the process, makes `new_group` a world collective and collectives move
    data as NCCL does (tests/nccl_async_data.py); returns the modes."""
    hosts = HostTensors()
    rules = CollectiveRules(hosts, timeout_s, AsyncData())
    dist.new_group = world_new_group(dist.new_group, timeout_s)
    for name, make in host_factories().items():
        setattr(torch, name, make)
    hosts.__enter__()
    rules.__enter__()
    return hosts, rules


def _report(rules: CollectiveRules, folder: str) -> None:
    """What this rank's collectives went through the rules (NCCL_DOUBLE_REPORT names the folder)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump({"collectives": rules.checked, **rules.seen, "reductions_compared": sum(rules.reduce_counts.values()),
                   "buffers_delivered_at_wait": rules.data.delivered if rules.data else 0}, f)


def install_with_report() -> None:
    """install(), and with NCCL_DOUBLE_REPORT set the report written as the rank leaves: train.py (and a forked rank,
    harness/forked_launch.py) leaves through os._exit, past atexit, so the report is made on the way."""
    handles = install()
    if os.environ.get("NCCL_DOUBLE_REPORT"):
        def _exit_after_report(code, _real_exit=os._exit):
            _report(handles[1], os.environ["NCCL_DOUBLE_REPORT"])
            _real_exit(code)
        os._exit = _exit_after_report


if __name__ == "__main__":
    install_with_report()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
