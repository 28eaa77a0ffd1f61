"""The CPU GEMM peak behind the MFU column is measured once per machine and kept (training/hardware.py): every rank
of every run measured it again at start-up, 0.6 s of a busy core each (seconds in bf16 on a CPU without bf16 GEMM
units), which across the test suite's runs was minutes of CPU for the same number."""
import json

import torch

from training import hardware
from training.hardware import CpuPeakCache, Device, peak_flops

CPU = Device("cpu", "gloo", torch.device("cpu"))


def _counting(monkeypatch, value=1e9):
    calls = []

    def measure(dtype, device, size=1024, seconds=0.6):
        calls.append(dtype)
        return value * (len(calls))

    monkeypatch.setattr(hardware, "measure_gemm_peak", measure)
    return calls


def test_the_second_run_reads_what_the_first_measured(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    first = peak_flops(CPU, torch.float32, str(tmp_path))
    second = peak_flops(CPU, torch.float32, str(tmp_path))
    assert calls == [torch.float32] and first == second == (1e9, "measured-cpu-gemm:float32")
    with open(tmp_path / CpuPeakCache.FILE) as f:
        table = json.load(f)
    assert table == {CpuPeakCache.key(torch.float32): 1e9}
    assert f"threads {torch.get_num_threads()}" in next(iter(table)) and torch.__version__ in next(iter(table))


def test_another_dtype_thread_count_or_a_broken_file_measures_again(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    peak_flops(CPU, torch.float32, str(tmp_path))
    assert peak_flops(CPU, torch.bfloat16, str(tmp_path))[0] == 2e9  # bf16 has its own entry, float32 keeps its own
    assert peak_flops(CPU, torch.float32, str(tmp_path))[0] == 1e9
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    assert peak_flops(CPU, torch.float32, str(tmp_path))[0] == 3e9
    (tmp_path / CpuPeakCache.FILE).write_text("{not json")
    assert peak_flops(CPU, torch.float32, str(tmp_path))[0] == 4e9
    assert len(calls) == 4
    assert peak_flops(CPU, torch.float32, None)[0] == 5e9  # no cache folder: measured every time, as before


def test_the_measurement_itself_is_a_real_gemm_rate():
    rate = hardware.measure_gemm_peak(torch.float32, torch.device("cpu"), size=128, seconds=0.05)
    assert 1e8 < rate < 1e13  # FLOP/s of a CPU core or a few: a wrong unit is off by 1e3 or more
