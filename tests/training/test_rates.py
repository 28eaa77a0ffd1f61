"""Measured rates (training/planning/rates.py) in the step model, with canned rates files: each measured component
prices its work at the file's rate (the expected seconds recomputed here from FLOPs and bytes), a missing one falls
back to the published figure and `rates_source` says which is which, a file from another torch or device is used
with a warning, a malformed one is refused naming the file, and bench/bench_rates.py writes what load_rates reads."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from harness.launch_env import child_env
from models.llama import model_config
from training.planning.accelerators import ACCELERATORS
from training.planning.rates import load_rates, rates_source, rates_warnings
from training.planning.price import predict_step
from training.planning.workload import Layout, Workload, parameter_count

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GEMM, HBM, OPTIMIZER, ATTN_FWD, ATTN_BWD = 4.0e14, 2.5e12, 1.5e12, 5.0e14, 4.0e14
SEQ = 8192


def _write(folder, **fields) -> str:
    data = {"accelerator": "h100-sxm", "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130",
            "cuda": "13.0", "date": "2026-11-27", **fields}
    path = os.path.join(folder, "h100-sxm.json")
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def _attention(kernel="cudnn"):
    return [{"kernel": kernel, "phase": phase, "causal": True, "length": SEQ, "head_dim": 128, "flops_per_s": rate}
            for phase, rate in (("fwd", ATTN_FWD), ("bwd", ATTN_BWD))]


def _workload(**changes):
    m = model_config("llama3_8b")
    return dataclasses.replace(Workload(model=m, layout=Layout(1, 1, 1, 1, 1, 8), seq_len=SEQ,
                                        local_batch_size=1, grad_accum=1, attention_kernel="cudnn"), **changes)


def test_every_measured_component_is_priced_at_its_rate(tmp_path):
    _write(tmp_path, gemm={"value": GEMM}, hbm={"value": HBM}, optimizer={"value": OPTIMIZER},
           attention=_attention())
    rates, acc, w = load_rates("h100-sxm", str(tmp_path)), ACCELERATORS["h100-sxm"], _workload()
    measured, published = predict_step(w, acc, rates), predict_step(w, acc)
    m = w.model
    block = 2.0 * m.dim * m.head_dim * (2 * m.n_heads + 2 * m.num_kv_heads) + 6.0 * m.dim * m.ffn_hidden_dim
    gemm_flops = SEQ * (m.n_layers * block * 3 + 2.0 * m.dim * m.vocab_size * 3)  # forward + 2x backward, no AC
    assert measured.parts["gemm"] == pytest.approx(gemm_flops / GEMM, rel=1e-9)
    forward = 4.0 * SEQ * (SEQ + 1) / 2 * m.n_heads * m.head_dim * m.n_layers  # causal pairs, at the measured length
    assert measured.parts["attention"] == pytest.approx(forward / ATTN_FWD + 2.5 * forward / ATTN_BWD, rel=1e-9)
    assert measured.parts["optimizer"] == pytest.approx(parameter_count(m) * 32 / OPTIMIZER, rel=1e-9)
    hbm_mid = acc.hbm_bytes_per_s * sum(acc.hbm_fraction) / 2  # the published middle the default prices at
    assert measured.parts["elementwise"] == pytest.approx(published.parts["elementwise"] * hbm_mid / HBM, rel=1e-9)
    assert measured.band == (measured.step_s, measured.step_s)  # one GPU, every class measured: no spread left
    assert rates_source(rates, "cudnn").endswith("gemm, attention (cudnn), hbm, optimizer")


def test_a_missing_rate_falls_back_to_the_published_one_and_says_so(tmp_path):
    _write(tmp_path, attention=_attention("flash"))
    rates, acc = load_rates("h100-sxm", str(tmp_path)), ACCELERATORS["h100-sxm"]
    measured, published = predict_step(_workload(), acc, rates), predict_step(_workload(), acc)
    for part in ("gemm", "attention", "elementwise", "optimizer"):  # no cudnn rate in the file either
        assert measured.parts[part] == published.parts[part]
    assert rates_source(rates, "cudnn").endswith(": nothing; published: gemm, attention, hbm, optimizer")
    assert "attention (flash)" in rates_source(rates, "flash")
    assert rates_source(None, "cudnn").startswith("published")
    assert load_rates("a100-80gb", str(tmp_path)) is None


def test_an_attention_rate_moves_to_other_lengths_with_the_tables_shape(tmp_path):
    _write(tmp_path, attention=_attention())
    rates, acc = load_rates("h100-sxm", str(tmp_path)), ACCELERATORS["h100-sxm"]
    at = {seq: predict_step(_workload(seq_len=seq), acc, rates).parts["attention"] for seq in (SEQ, 4 * SEQ)}
    # 4x the tokens: 16x the pairs at the table's (nearly flat) rate from 16K on
    assert 15 < at[4 * SEQ] / at[SEQ] < 16.5


def test_a_file_from_another_torch_or_device_warns(tmp_path):
    _write(tmp_path, attention=_attention())
    rates = load_rates("h100-sxm", str(tmp_path))
    assert rates_warnings(rates, "h100-sxm", "2.11.0+cu130") == []
    (line,) = rates_warnings(rates, "h100-sxm", "2.13.0+cu130")
    assert "measured with torch 2.11.0+cu130" in line and "bench_rates.py" in line
    (line,) = rates_warnings(rates, "h200", "2.11.1")
    assert "not on a h200" in line


def test_a_malformed_file_is_refused_naming_it(tmp_path):
    (tmp_path / "h100-sxm.json").write_text('{"accelerator": "h100-sxm"}')
    with pytest.raises(ValueError, match="h100-sxm.json: not a rates file"):
        load_rates("h100-sxm", str(tmp_path))


def test_the_shipped_h100_file_loads_with_its_attention_rates():
    rates = load_rates("h100-sxm")
    assert rates is not None and rates.device_name.startswith("NVIDIA H100")
    fwd, length, head_dim = rates.attention_rate("cudnn", "fwd")
    assert (length, head_dim) == (8192, 128) and 5e14 < fwd < 6.5e14  # 0.48 ms for 275 GFLOP
    assert rates.attention_rate("flash", "bwd")[0] < rates.attention_rate("cudnn", "bwd")[0]


def test_bench_rates_writes_what_load_rates_reads(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join("bench", "bench_rates.py"), "--accelerator", "h100-sxm", "--device", "cpu",
         "--gemm-shapes", "64x128,128x256", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--tokens", "64",
         "--lengths", "64,128", "--packed-lengths", "256", "--copy-bytes", "65536", "--optimizer-params", "1000",
         "--reps", "1",
         "--host", "--host-optimizer-params", "1000", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=child_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    rates = load_rates("h100-sxm", str(tmp_path))
    assert rates.device_name == "cpu" and min(rates.hbm, rates.optimizer, rates.host_optimizer) > 0
    assert rates.host_copy is None  # pinned copies need a GPU
    assert [row[:2] for row in rates.gemm_rows] == [row[:2] for row in rates.fp8_gemm_rows] == [(64, 128), (128, 256)]
    assert min(row[2] for row in rates.gemm_rows + rates.fp8_gemm_rows) > 0
    assert set(rates.attention) == {("flash", "fwd"), ("flash", "bwd")}
    assert [row[1] for row in rates.attention["flash", "fwd"]] == [64, 128]
    (packed,) = rates.packed_calls  # the CPU's per-document calls, at the packed total asked
    assert (packed.kernel, packed.tokens, packed.heads, packed.head_dim) == ("per_document", 256, 4, 16)
    assert packed.seconds > 0 and rates.has("packed_attention", "per_document")


def test_a_model_is_priced_at_the_gemm_row_and_attention_length_nearest_its_own(tmp_path):
    """Small GEMMs run further from the peak than large ones, and attention's rate grows with the call's length: a
    file with several rows prices each stage at the nearest (the bench shape's rows must not price an 8B model)."""
    small, large = 3.0e14, 6.0e14
    _write(tmp_path, gemm=[{"dim": 2048, "ffn": 5632, "value": small}, {"dim": 4096, "ffn": 14336, "value": large}],
           fp8_gemm=[{"dim": 4096, "ffn": 14336, "value": 2 * large}],
           attention=_attention() + [{**row, "length": 8 * SEQ, "flops_per_s": 2 * row["flops_per_s"]}
                                     for row in _attention()])
    rates, acc = load_rates("h100-sxm", str(tmp_path)), ACCELERATORS["h100-sxm"]
    assert rates.gemm_rate(2048, 5632) == small and rates.gemm_rate(4096, 14336) == large
    assert rates.gemm_rate(4096, 11008) == large and rates.gemm_rate(4096, 14336, float8=True) == 2 * large
    w = _workload()
    m = w.model
    block = 2.0 * m.dim * m.head_dim * (2 * m.n_heads + 2 * m.num_kv_heads) + 6.0 * m.dim * m.ffn_hidden_dim
    gemm_flops = SEQ * (m.n_layers * block * 3 + 2.0 * m.dim * m.vocab_size * 3)
    assert predict_step(w, acc, rates).parts["gemm"] == pytest.approx(gemm_flops / large, rel=1e-9)
    assert rates.attention_rate("cudnn", "fwd", SEQ)[1] == SEQ
    assert rates.attention_rate("cudnn", "fwd", 6 * SEQ)[1] == 8 * SEQ
    long = predict_step(_workload(seq_len=8 * SEQ), acc, rates).parts["attention"]
    forward = 4.0 * 8 * SEQ * (8 * SEQ + 1) / 2 * m.n_heads * m.head_dim * m.n_layers
    assert long == pytest.approx(forward / (2 * ATTN_FWD) + 2.5 * forward / (2 * ATTN_BWD), rel=1e-9)
    assert "fp8_gemm" in rates_source(rates, "cudnn", float8=True) and "fp8" not in rates_source(rates, "cudnn")
