"""Issue 50: one accelerator table (config/accelerators.py) behind every GPU name: the schema's choices and memory
defaults, the dry run's specs, MFU's peak, the benches and the GPU report agree; and one predicted peak (the dry
run's `predicted_peak_gib_per_rank`) is what every report holds a measured peak against. Beside the other bench
tests because it runs bench/bench_gpu.py and bench/bench_predictions.py (the package folders' tests import no bench)."""
import argparse

import pytest
import torch

from bench import bench_gpu, bench_predictions
from config.accelerators import DATA_SHEETS, accelerator_of

DEVICE_NAMES = {  # torch.cuda.get_device_name() -> hardware.accelerator (None: no data sheet: MFU only)
    "NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200", "NVIDIA A100-SXM4-80GB": "a100-80gb", "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA L4": None, "NVIDIA GeForce RTX 4090": None,
}
PEAKS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
         "NVIDIA A100-SXM4-40GB": 312e12}
"""Dense bf16 data-sheet peaks (TorchTitan's MFU uses the same 989 / 756 / 835 for H100 SXM / PCIe / NVL)."""


def test_every_reader_maps_a_device_name_to_the_same_accelerator():
    for name, expected in DEVICE_NAMES.items():
        assert accelerator_of(name) == expected, name
        assert bench_gpu.accelerator_of(name) == bench_predictions.accelerator_of(name) == expected
    assert accelerator_of("NVIDIA A100 PCIe", memory_gib=79.2) == "a100-80gb"  # the size by memory, name silent
    assert accelerator_of("NVIDIA A100 PCIe", memory_gib=39.4) == "a100-40gb"


def test_the_schema_the_dry_run_and_the_table_hold_the_same_accelerators():
    from config.schema import ACCELERATOR_MEMORY_GIB, AcceleratorName, choices
    from training.planning.accelerators import ACCELERATORS

    assert set(choices(AcceleratorName)) == set(ACCELERATORS) == set(DATA_SHEETS) == set(ACCELERATOR_MEMORY_GIB)
    for name, spec in ACCELERATORS.items():
        assert (spec.bf16_flops, spec.memory_gib) == (DATA_SHEETS[name].bf16_flops, DATA_SHEETS[name].memory_gib)
    assert [ACCELERATORS[f"h100-{p}"].bf16_flops for p in ("sxm", "pcie", "nvl")] == [989e12, 756e12, 835e12]


@pytest.mark.parametrize("name", sorted(PEAKS))
def test_mfu_counts_each_part_at_its_own_peak(monkeypatch, name):
    from training.hardware import Device, peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    peak, source = peak_flops(Device("cuda", "nccl", torch.device("cuda", 0)), torch.bfloat16)
    assert peak == PEAKS[name] and source.startswith("table:"), (name, peak, source)
    assert peak_flops(Device("cuda", "nccl", torch.device("cuda", 0)), torch.float32)[0] == PEAKS[name] / 2


def test_every_report_compares_the_one_predicted_peak(monkeypatch):
    """A stage with both peaks: the benches take `predicted_peak_gib_per_rank` (the CUDA path's, as the dry run
    writes it: tests/training/test_price.py's test_dry_run_json_carries_the_prediction...), never the CPU kernels'
    peak."""
    stage = {"predicted_step_s": 1.0, "peak_device_gib_per_rank": 10.0, "peak_device_gib_per_rank_cuda_path": 12.0,
             "predicted_peak_gib_per_rank": 12.0}
    monkeypatch.setattr(bench_gpu, "dry_run_stage", lambda *a, **k: stage)
    monkeypatch.setattr(bench_predictions, "dry_run_stage", lambda *a, **k: stage)
    args = argparse.Namespace(timeout=1)
    assert bench_gpu.predicted(args, False, "h100-sxm")[1] == 12.0
    assert bench_predictions.predict({"seq": 8192}, "h100-sxm", 1)["peak_gib"] == 12.0
