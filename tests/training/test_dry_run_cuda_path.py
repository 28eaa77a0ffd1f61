"""The dry run's CUDA-path numbers (training/planning/cuda_path_probe.py) on the debug model: the fields dry_run.json gets,
kernel calls within 4 x P on a documents row, no host sync in the attention path, and the GQA comparison's order
(the earlier path, K/V expanded before every flash call, never holds less)."""
import concurrent.futures
import os
import sys

from tests.distributed import fresh_process_context

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stage_numbers(overrides):
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    from config.recipe import load_config
    from training.planning.cuda_path_table import cuda_json, stage_cuda_path

    cfg = load_config(os.path.join(ROOT, "recipes", "debug.toml"), overrides)
    numbers = stage_cuda_path(cfg, cfg.parallelism.cp, cfg.parallelism.tp, None)
    return numbers, cuda_json(numbers, 1.0)


def _in_fresh_process(fn, *args, timeout=300):
    """The probe starts a fake process group and registers a no-op CUDA device guard: keep both out of pytest."""
    ctx = fresh_process_context()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result(timeout=timeout)


def test_documents_stage_counts_launches_syncs_and_both_gqa_peaks():
    cp = 4
    numbers, fields = _in_fresh_process(_stage_numbers, [
        "--parallelism.cp", str(cp), "--parallelism.dp_shard", "1", "--data.document_masking", "true",
        "--parallelism.cp_load_balancer", "documents", "--training.seq_len", "8192", "--training.dtype", "bfloat16",
        "--model.n_kv_heads", "2"])
    if "cuda_path" in numbers:  # no C++ compiler here: the dry run says so instead of failing
        assert numbers["cuda_path"].startswith("not measured")
        return
    assert numbers["count_row"] == "stated mix"  # the documents the prediction prices (workload.DOCUMENT_MIX)
    assert 0 < numbers["attention_kernel_calls_per_layer"] <= 4 * cp
    assert numbers["host_syncs_per_micro_step"] == 0 and numbers["aten_ops_per_layer"] > 0
    assert fields["peak_device_gib_per_rank_cuda_path"] >= 1.0
    assert fields["peak_device_gib_per_rank_cuda_path_gqa_expanded"] >= fields["peak_device_gib_per_rank_cuda_path"]
    assert numbers["attention_transient_gib_cuda_gqa_expanded"] > numbers["attention_transient_gib_cuda"]


def test_hopper_stages_run_cudnn_and_a100_stages_flash_on_the_dense_layouts():
    """The kernel the trainer would pick on the recipe's accelerator (auto: cuDNN from SM 9.0), counted on fake CUDA:
    on H100/H200 the dense ring makes no FlashAttention-2 call, on A100 no cuDNN call; an explicit choice wins."""
    base = ["--parallelism.cp", "4", "--parallelism.dp_shard", "1", "--training.seq_len", "4096",
            "--training.dtype", "bfloat16", "--model.n_kv_heads", "2"]
    cases = [("zigzag", "h100-sxm", "auto", "cudnn"), ("contiguous", "h200", "auto", "cudnn"),
             ("zigzag", "a100-80gb", "auto", "flash"), ("contiguous", "a100-40gb", "auto", "flash"),
             ("zigzag", "h100-sxm", "flash", "flash")]
    for layout, accel, asked, expected in cases:
        numbers, fields = _in_fresh_process(_stage_numbers, base + [
            "--parallelism.cp_load_balancer", layout, "--hardware.accelerator", accel,
            "--parallelism.attention_kernel", asked])
        if "cuda_path" in numbers:
            assert numbers["cuda_path"].startswith("not measured")
            return
        by_kernel = numbers["attention_calls_by_kernel"]
        assert fields["attention_kernel"] == numbers["attention_kernel"] == expected, (layout, accel, numbers)
        assert set(by_kernel) == {expected}, (layout, accel, by_kernel)
        assert by_kernel[expected] == numbers["attention_kernel_calls_per_layer"] > 0
