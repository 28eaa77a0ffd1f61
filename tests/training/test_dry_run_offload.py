"""The dry run with activation offload: host memory is reported apart from the device peak, and dry_run.json carries
both per stage. The offloaded bytes are checked against the closed form n_blocks x tokens x dim x bytes (full AC)."""
import json
import os

import pytest

from tests.training.test_dry_run import ROOT, _in_fresh_process, _run_train

LAYERS, SEQ, DIM = 4, 2048, 256  # debug width; a 32K vocabulary puts the peak at the loss, as at long context
SHAPE = ["--model.n_layers", str(LAYERS), "--training.seq_len", str(SEQ), "--training.local_batch_size", "1",
         "--model.vocab_size", "32768", "--parallelism.dp_shard", "1", "--activation_checkpoint.mode", "full"]


def _probe(offload: str) -> dict:
    import sys

    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    from config.recipe import load_config
    from training.planning.memory_probe import measure_rank

    cfg = load_config(os.path.join(ROOT, "recipes", "debug.toml"),
                      [*SHAPE, "--activation_checkpoint.offload", offload])
    return vars(measure_rank(cfg, 1))


def test_offload_moves_the_block_inputs_from_device_to_host():
    off = _in_fresh_process(_probe, "false")
    on = _in_fresh_process(_probe, "true")
    block_inputs = LAYERS * SEQ * DIM * 4  # fp32 hidden state kept by each fully checkpointed block
    assert off["host"] == 0
    assert on["host"] == block_inputs
    assert on["peak_forward_backward"] < off["peak_forward_backward"]
    # The peak is at the loss, before backward brings any input back: the device saves exactly what went to host.
    assert off["peak_forward_backward"] - on["peak_forward_backward"] == pytest.approx(block_inputs, rel=1e-3)
    assert on["params"] == off["params"] and on["optimizer"] == off["optimizer"]


@pytest.mark.parametrize("memory_gib, offload, exit_code, fits", [(80, "true", 0, True), (1.2, "false", 1, False)])
def test_dry_run_writes_json_with_device_and_host_per_stage(tmp_path, memory_gib, offload, exit_code, fits):
    done, _ = _run_train("--dry-run", "--job.dump_folder", str(tmp_path), "--hardware.device_memory_gib",
                         str(memory_gib), *SHAPE, "--activation_checkpoint.offload", offload)
    assert done.returncode == exit_code, done.stdout + done.stderr[-2000:]
    with open(tmp_path / "dry_run.json") as f:
        stages = json.load(f)["stages"]
    (stage,) = stages  # the recipe has no [[ramp]]: one stage
    assert {"name", "seq_len", "cp", "peak_device_gib_per_rank", "host_gib_per_rank", "fits"} <= set(stage)
    assert stage["seq_len"] == SEQ and stage["cp"] == 1 and stage["fits"] is fits
    host = LAYERS * SEQ * DIM * 4 / 2**30 if offload == "true" else 0.0
    assert stage["host_gib_per_rank"] == pytest.approx(host, rel=1e-9)
    # one exact-size arena per stage (parallelisms/host_arena.py): 8 MiB of block inputs pin 8 MiB, whole pages
    assert stage["host_pinned_gib_per_rank"] == pytest.approx(host, rel=1e-9)
    assert 0 < stage["peak_device_gib_per_rank"] < 2.0
    assert "host GiB" in done.stdout
