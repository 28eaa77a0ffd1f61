"""Rates measured on the device: one JSON file per accelerator (training/planning/rates/<accelerator>.json, written by
bench/bench_rates.py on that GPU), which the step model (price.py) uses in place of the published figures of
accelerators.py, component by component. Besides the device's name, torch and CUDA versions and the date, a file
holds rates, each with the shape it was measured at:
- `gemm` / `fp8_gemm`: bf16 / float8 GEMM FLOP/s of a block's linear layers, one row per model shape (`dim`, `ffn`):
  small GEMMs run further from the peak, so a model is priced at the row nearest its own shape;
- `attention`: FLOP/s of one causal call of a kernel family per phase at a block length and head dim (FLOPs as the
  step model counts them), priced at the row nearest the call's length and carried to its exact length and head dim
  by the shape of the FlashAttention-2 table;
- `packed_attention`: seconds of one packed call (CP 1 documents) per documents kernel at a total of tokens over
  web-like documents, in place of documents_cost.PUBLISHED;
- `hbm` / `optimizer`: achieved bytes/s of elementwise and copy kernels / of the AdamW step.
A rate the file lacks falls back to the published figure (`rates_source` says which is which). A file measured under
another torch, or on a device not of the accelerator, is still used, with a warning line.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from config.accelerators import accelerator_of
from config.errors import Refusal
from training.planning.documents_cost import PackedCall

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RATES_DIR = os.path.join(REPO, "training", "planning", "rates")
COMPONENTS = ("gemm", "attention", "hbm", "optimizer")


@dataclass(frozen=True)
class MeasuredRates:
    path: str
    accelerator: str
    device_name: str
    torch: str
    cuda: str
    date: str
    gemm_rows: tuple = ()
    """((dim, ffn, FLOP/s), ...) of bf16 GEMMs, one per measured model shape."""
    fp8_gemm_rows: tuple = ()
    """The same for float8 GEMMs."""
    hbm: float | None = None
    optimizer: float | None = None
    host_optimizer: float | None = None
    """bytes/s of torch's fused CPU AdamW on the node's host, every core (28 bytes per parameter; --host)."""
    host_copy: float | None = None
    """bytes/s of pinned host <-> device copies, the slower direction (--host)."""
    attention: dict = field(default_factory=dict)
    """{(kernel, phase): ((FLOP/s, block length, head dim), ...)} of causal calls, one per measured length."""
    packed_calls: tuple = ()
    """documents_cost.PackedCall per documents kernel and total tokens: one packed-sequence call forward + backward
    over web-like documents (bench_rates' packed_attention rows)."""

    def has(self, component: str, kernel: str | None = None) -> bool:
        if component == "attention":
            return any(k == kernel for k, _ in self.attention) if kernel else bool(self.attention)
        if component == "packed_attention":
            return any(c.kernel == kernel for c in self.packed_calls) if kernel else bool(self.packed_calls)
        if component in ("gemm", "fp8_gemm"):
            return bool(getattr(self, f"{component}_rows"))
        return getattr(self, component) is not None

    def gemm_rate(self, dim: int, ffn: int, float8: bool = False) -> float | None:
        """FLOP/s measured at the model shape nearest (dim, ffn) (log distance), or None when none was measured."""
        rows = self.fp8_gemm_rows if float8 else self.gemm_rows
        if not rows:
            return None
        return min(rows, key=lambda r: abs(math.log(r[0] / dim)) + abs(math.log(r[1] / ffn)))[2]

    def attention_rate(self, kernel: str, phase: str, length: float | None = None) -> tuple[float, float, int] | None:
        """(FLOP/s, length, head dim) of the row measured at the length nearest `length` (None: the first row)."""
        rows = self.attention.get((kernel, phase))
        if not rows:
            return None
        return rows[0] if length is None else min(rows, key=lambda r: abs(math.log(r[1] / length)))


def rates_path(accelerator: str, directory: str = RATES_DIR) -> str:
    return os.path.join(directory, f"{accelerator}.json")


def load_rates(accelerator: str, directory: str = RATES_DIR) -> MeasuredRates | None:
    """The accelerator's rates file, or None when there is none. A malformed file is an error naming the file."""
    path = rates_path(accelerator, directory)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        attention: dict = {}
        for r in data.get("attention", []):
            attention.setdefault((r["kernel"], r["phase"]), []).append(
                (float(r["flops_per_s"]), float(r["length"]), int(r["head_dim"])))
        single = {name: float(data[name]["value"]) for name in ("hbm", "optimizer", "host_optimizer", "host_copy")
                  if name in data}
        gemms = {name: tuple(_gemm_rows(data[name])) for name in ("gemm", "fp8_gemm") if name in data}
        packed = tuple(PackedCall(r["kernel"], int(r["tokens"]), float(r["seconds"]), data["accelerator"],
                                  int(r["heads"]), int(r["kv_heads"]), int(r["head_dim"]))
                       for r in data.get("packed_attention", []))
        return MeasuredRates(path, data["accelerator"], data["device_name"], data["torch"], data.get("cuda", ""),
                             data["date"], attention={k: tuple(v) for k, v in attention.items()},
                             packed_calls=packed, **{f"{k}_rows": v for k, v in gemms.items()}, **single)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Refusal(f"{path}: not a rates file ({type(e).__name__}: {e}); rewrite it with "
                         f"python bench/bench_rates.py or delete it to use the published rates") from None


def _gemm_rows(entry) -> list[tuple[int, int, float]]:
    """A file's GEMM rows: a list of {dim, ffn, value}, or one {value} (a file of one shape: it prices every model)."""
    if isinstance(entry, dict):
        return [(1, 1, float(entry["value"]))]
    return [(int(r["dim"]), int(r["ffn"]), float(r["value"])) for r in entry]


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def rates_warnings(rates: MeasuredRates | None, accelerator: str, torch_version: str) -> list[str]:
    """Lines for a file measured elsewhere: another torch (major.minor) or a device name not of this accelerator."""
    if rates is None:
        return []
    lines = []
    if _minor(rates.torch) != _minor(torch_version):
        lines.append(f"warning: {_shown(rates.path)} was measured with torch {rates.torch}, this is torch "
                     f"{torch_version}: kernel rates may differ; measure again with python bench/bench_rates.py on the "
                     f"GPU")
    measured_on = accelerator_of(rates.device_name) or ""  # the accelerator table's (config/accelerators.py)
    if measured_on.split("-")[0] != accelerator.split("-")[0] or rates.accelerator != accelerator:
        lines.append(f"warning: {_shown(rates.path)} was measured on {rates.device_name!r} ({rates.accelerator}), "
                     f"not on a {accelerator}: its rates are used as they are")
    return lines


def _shown(path: str) -> str:
    """The file's path from the repository's root when it lies inside it."""
    inside = os.path.abspath(path).startswith(REPO + os.sep)
    return os.path.relpath(path, REPO) if inside else path


def rates_source(rates: MeasuredRates | None, attention_kernel: str, float8: bool = False) -> str:
    """Which rates price a stage: measured components (with the file) and published ones (float8: its GEMMs too)."""
    if rates is None:
        return "published (training/planning/accelerators.py: data sheets and kernel papers)"
    components = COMPONENTS + (("fp8_gemm",) if float8 else ())
    measured = [c for c in components if rates.has(c, attention_kernel if c == "attention" else None)]
    published = [c for c in components if c not in measured]
    text = (f"measured on {rates.device_name} (torch {rates.torch}, {rates.date}; "
            f"{_shown(rates.path)}): {', '.join(measured) or 'nothing'}")
    if "attention" in measured:
        text = text.replace("attention", f"attention ({attention_kernel})", 1)
    return text + (f"; published: {', '.join(published)}" if published else "")
