"""Where a step's transient memory goes: every tensor the step creates, labelled by the code that made it.

The dry run (training/planning/memory_probe.py) says how much a step peaks at; this says what is live at that peak. A dispatch
mode sees every op of the step (forward, checkpoint recomputation, backward, FSDP and ring-attention buffers) on fake
tensors; each new storage is labelled by the innermost frame of this repository's code on the stack (e.g.
`models/rope.py:apply_rotary`) or, for autograd's own backward kernels, by the module whose backward runs. At the
moment the live bytes peak the labels are summed into categories (`CATEGORY_RULES`). Storages that existed before
the step (parameters, the batch) are never counted: views of them share their storage.
"""
from __future__ import annotations

import os
import sys
from collections import defaultdict

import torch
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the repository root
# Frames that only drive the step: ops under them (autograd's own backward kernels) are labelled by module instead.
_SKIP_FILES = (os.path.join("harness", "memory_breakdown.py"), os.path.join("training", "step.py"))

# (category, substrings of a label), first match wins; labels are "file:qualname" or "backward <module>: <op>".
CATEGORY_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("offload staging (block input brought back)", ("activation_offload",)),
    ("ring attention (K/V in flight, accumulators)", ("parallelisms/cp/", "ring_", "context_parallel", "cp_")),
    ("rope (q/k rotation)", ("rope",)),
    ("MLP gate/up/down (tiled)", ("tiled_mlp",)),
    ("MLP gate/up/down", ("FeedForward", "feed_forward")),
    ("norms", ("RMSNorm", "norm")),
    ("loss (chunked output projection)", ("chunked_loss", ".output")),
    ("checkpoint recompute", ("activation_checkpoint",)),
    ("FSDP all-gather / reduce-scatter", ("fsdp", "data_parallel")),
    ("q projection", ("wq",)),
    ("k/v projections", ("wk", "wv")),
    ("attention output projection", ("wo",)),
    ("attention in/out (SDPA, reshapes)", ("Attention", "attention")),
    ("residual adds", ("TransformerBlock", "layers.")),
    ("embedding", ("tok_embeddings",)),
)


def category_of(label: str) -> str:
    return next((category for category, needles in CATEGORY_RULES if any(n in label for n in needles)), "other")


def _repo_frame_label() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        passes_through = frame.f_code.co_name in ("__torch_function__", "__torch_dispatch__")
        if path.endswith(_SKIP_FILES[1:]):
            return None
        ours = path.startswith(_REPO) and "site-packages" not in path  # a virtualenv may live in the checkout
        if ours and not path.endswith(_SKIP_FILES) and not passes_through and "tests" + os.sep not in path[len(_REPO):]:
            return f"{path[len(_REPO):]}:{frame.f_code.co_qualname}"
        if "fsdp" in path and "torch" in path:
            return "torch fsdp"
        frame = frame.f_back
    return None


class BreakdownMode(TorchDispatchMode):
    """Tracks live storages created under it and remembers the labelled bytes at the moment they peak."""

    def __init__(self, modules: ModTracker):
        super().__init__()
        self.modules = modules
        self.live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.peak_bytes = 0
        self.at_peak: dict[str, int] = {}

    def _module_label(self, func) -> str:
        parents = [p for p in self.modules.parents if p != "Global"]
        leaf = max(parents, key=len) if parents else "(no module)"
        phase = "backward" if self.modules.is_bw else "forward"
        return f"{phase} {leaf}: {func.__name__}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        label = None
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if id(storage) in seen or storage in self.live:
                continue
            if label is None:
                label = _repo_frame_label() or self._module_label(func)
                if label.startswith("torch fsdp"):
                    label = f"fsdp {func.__name__}"
            self.live[storage] = label
        self._update_peak()
        return out

    def _update_peak(self) -> None:
        sizes = [(label, storage.nbytes()) for storage, label in self.live.items()]
        total = sum(n for _, n in sizes)
        if total > self.peak_bytes:
            self.peak_bytes = total
            by_label: dict[str, int] = defaultdict(int)
            for label, n in sizes:
                by_label[label] += n
            self.at_peak = dict(by_label)

    def categories(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for label, n in self.at_peak.items():
            out[category_of(label)] += n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def format_breakdown(mode: BreakdownMode, tokens: int, top_labels: int = 12) -> str:
    """Categories and the largest raw labels at the peak, in MiB and bytes per token."""
    lines = [f"transient peak {mode.peak_bytes / 2**20:,.1f} MiB = {mode.peak_bytes / tokens / 1024:,.1f} KiB per token"
             f" ({tokens:,} tokens per rank)", f"{'category':<48} {'MiB':>12} {'KiB/token':>10}"]
    for category, n in mode.categories().items():
        lines.append(f"{category:<48} {n / 2**20:>12,.1f} {n / tokens / 1024:>10,.2f}")
    lines.append("largest labels at the peak:")
    for label, n in sorted(mode.at_peak.items(), key=lambda kv: -kv[1])[:top_labels]:
        lines.append(f"  {label[:90]:<90} {n / tokens / 1024:>8,.2f} KiB/token")
    return "\n".join(lines)
