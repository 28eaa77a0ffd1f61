"""bench/bench_step_kernels.py counts both steps (ours and the transformers loop) at a tiny shape on fake CUDA, its
buckets add up, and its GEMM bucket equals a count derived by hand from the architecture, so a broken counter fails
here. At the bench's own shape: our step's elementwise bytes at most the plain transformers loop's, and its kernel
count within the measured gap (docs/gpu_step.md). The fake-CPU count runs too.

GEMMs of one step, by hand. Each block has 7 linear layers (q, k, v, o; w1/gate, w3/up, w2/down) and the model one
output projection. Forward: one GEMM per linear. Backward: two per linear, the input gradient and the weight
gradient; none is skipped, not even the first block's q/k/v input gradient, since the embedding table trains and
needs it. So a step is 3 * (7 * layers + 1) GEMMs. Our trainer computes the loss `loss_chunk_tokens` tokens at a
time (models/chunked_loss.py), which runs the output projection once per chunk: 3 * (7 * layers + chunks).
Attention is one fused SDPA op per block forward and one backward: 2 * layers.
"""
import math

import pytest

from bench import bench_step_kernels as bench

DIM, LAYERS, SEQ = 256, 2, 512


def hand_gemms(layers: int, output_chunks: int = 1) -> int:
    return 3 * (7 * layers + output_chunks)


def _needs_fake_cuda():
    from training.planning.step_sync_probe import fake_cuda_runtime
    try:
        fake_cuda_runtime()
    except Exception as e:  # noqa: BLE001 - no compiler or headers
        pytest.skip(f"cannot build the fake CUDA runtime ({type(e).__name__})")


@pytest.fixture(scope="module")
def counts():
    _needs_fake_cuda()
    return bench.run(seq=SEQ, layers=LAYERS, dim=DIM, n_heads=16, n_kv_heads=8,
                     overrides=["--training.loss_chunk_tokens", "128"])


def test_both_sides_run_and_buckets_add_up(counts):
    for side in ("ours", "transformers"):
        c = counts[side]
        assert c["total_ops"] > 0 and c["total_bytes"] > 0
        assert set(c["ops"]) == set(bench.KINDS)
        assert sum(c["ops"].values()) == c["total_ops"] == sum(c["per_op"].values())
        assert sum(c["bytes"].values()) == c["total_bytes"]
    assert "kind" in bench.table(counts)


def test_the_fake_cpu_count_runs_in_this_process():
    result = bench.run(seq=SEQ, layers=LAYERS, dim=DIM, n_heads=16, n_kv_heads=8, device="cpu")
    assert result["shape"]["device"] == "fake cpu"
    assert result["ours"]["ops"]["gemm"] > 0 and result["transformers"]["ops"]["attention"] == 2 * LAYERS


def test_gemm_counts_match_the_architecture(counts):
    chunks = math.ceil(SEQ / counts["shape"]["loss_chunk_tokens"])
    assert chunks == 4
    assert counts["transformers"]["ops"]["gemm"] == hand_gemms(LAYERS)
    assert counts["ours"]["ops"]["gemm"] == hand_gemms(LAYERS, chunks)


def test_attention_is_one_fused_op_each_way_per_block(counts):
    for side in ("ours", "transformers"):
        assert counts[side]["ops"]["attention"] == 2 * LAYERS


def test_optimizer_paths(counts):
    """Both fused AdamW, one op for every parameter: the peer's, and build_optimizer's for a CUDA rank (the fake rank
    stands for one), with no foreach AdamW op left on our side."""
    for side in ("ours", "transformers"):
        assert counts[side]["per_op"].get("aten._fused_adamw_.default") == 1, side
    assert not any(n.startswith("aten._foreach_div") or n.startswith("aten._foreach_lerp")
                   for n in counts["ours"]["per_op"])
    assert counts["ours"]["ops"]["optimizer"] == counts["transformers"]["ops"]["optimizer"]


def test_one_gpu_step_against_the_transformers_loop_on_fake_cuda():
    """Issue 36's count at the bench's own shape (docs/gpu_step.md's table), both steps on fake CUDA as an H100 runs
    them: our eager elementwise bytes per optimizer step are at most the plain transformers loop's. Our kernel count
    is not yet at most theirs (1,225 vs 1,168: float32 RoPE's casts, the chunked loss's per-chunk kernels and the
    norms' weight casts, docs/gpu_step.md); the gap must not grow past the measured 5%."""
    _needs_fake_cuda()
    result = bench.run()
    assert result["shape"]["device"] == "fake cuda"
    ours, theirs = result["ours"], result["transformers"]
    kernels = {side: c["total_ops"] - c["ops"]["no kernel"] for side, c in result.items() if side != "shape"}
    assert kernels["ours"] <= 1.05 * kernels["transformers"], kernels
    assert ours["bytes"]["elementwise/other"] <= theirs["bytes"]["elementwise/other"], (ours["bytes"], theirs["bytes"])
    for side in (ours, theirs):  # SDPA as on an H100: cuDNN, one op each way per block
        assert side["per_op"].get("aten._scaled_dot_product_cudnn_attention.default") == 8
