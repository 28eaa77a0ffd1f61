"""NCCL's asynchronous data movement on real gloo ranks: send buffers read at post, receive buffers written by wait().

NCCL reads a collective's input and writes its output on its own stream, any time between the post and the
`wait()` that orders the caller after it. Reading an output before `wait()`, or writing an input after posting, is
a race that gloo (with its own buffers and threads) rarely loses on a small CPU test. Here every c10d and functional
collective runs on private copies: the inputs are copied at post (later writes change nothing sent), the caller's
output buffers hold poison (NaN, -1 for integers) until `wait()` on the op's work (c10d) or `wait_tensor` on its
result (functional collectives: DTensor, TP) delivers the data. Used by tests/nccl_device_rule.py's dispatch mode.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

Work = torch._C._distributed_c10d.Work

# c10d ops whose first argument is written (the caller's receive buffers); every other tensor argument is only read
NO_OUTPUT = {"send", "barrier", "monitored_barrier_"}


def poison(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else (True if t.dtype == torch.bool else -1))


def _copy_tree(value):
    """The same structure with every tensor cloned (snapshots of inputs, private buffers for outputs)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_tree(v) for v in value)
    return value


def _pairs(user, private):
    if isinstance(user, torch.Tensor):
        yield user, private
    elif isinstance(user, (list, tuple)):
        for u, p in zip(user, private):
            yield from _pairs(u, p)


class AsyncData:
    """Runs collectives on private copies and delivers their outputs at wait (see the module docstring)."""

    def __init__(self):
        self.pending: dict[int, tuple] = {}  # id(work) -> (work, [(caller's buffer, private buffer)])
        # storage of the tensor handed to the caller -> (that tensor, the real result); by storage, because an
        # AsyncCollectiveTensor waits on views of it (its view ops re-wrap without waiting)
        self.shown: dict[int, tuple] = {}
        self.delivered = 0  # buffers filled at wait (a test can tell the rule ran)
        real_wait = Work.wait

        def wait(work, *args, **kwargs):
            done = real_wait(work, *args, **kwargs)
            self._deliver(work)
            return done

        Work.wait = wait  # one Work class for every backend; patched for the life of the process
        real_wait_tensor = funcol.wait_tensor
        # AsyncCollectiveTensor waits through this module function, from inside its own dispatch (past any mode)
        funcol.wait_tensor = lambda tensor: self._wait_tensor(real_wait_tensor, tensor)

    def _deliver(self, work) -> None:
        _, deliveries = self.pending.pop(id(work), (None, []))
        with torch.no_grad():
            for user, private in deliveries:
                user.copy_(private)
                self.delivered += 1

    def run_c10d(self, func, args, kwargs):
        name = func._schema.name.split("::")[-1]
        private = _copy_tree(list(args))
        out = func(*private, **kwargs)
        handle = out[-1] if isinstance(out, tuple) else out
        if name in NO_OUTPUT or not isinstance(handle, torch.ScriptObject):
            return out
        work = Work.unbox(handle)
        deliveries = list(_pairs(args[0], private[0]))
        for user, _ in deliveries:
            poison(user)
        self.pending[id(work)] = (work, deliveries)  # keeps the Python Work alive: the caller gets this same object
        return out

    def run_functional(self, func, args, kwargs):
        name = func._schema.name.split("::")[-1]
        if name == "wait_tensor":
            return self._wait_tensor(func, args[0])
        if name == "_wrap_tensor_autograd":  # the AsyncCollectiveTensor around a pending result waits on its elem
            return func(*args, **kwargs)
        real = func(*_copy_tree(list(args)), **kwargs)
        if not isinstance(real, torch.Tensor):
            return real
        shown = args[0] if name.endswith("_") else torch.empty_like(real)
        if shown.numel():
            poison(shown)
            self.shown[shown.untyped_storage().data_ptr()] = (shown, real)
        return shown if shown.numel() else real

    def _wait_tensor(self, func, tensor):
        entry = self.shown.pop(tensor.untyped_storage().data_ptr(), None) if tensor.numel() else None
        if entry is None:
            return func(tensor)
        shown, real = entry
        func(real)
        with torch.no_grad():
            shown.copy_(real)
        self.delivered += 1
        return tensor
