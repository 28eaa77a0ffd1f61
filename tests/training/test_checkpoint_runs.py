"""Checkpointing in real multi-rank runs (slow tier; ranks forked by harness/forked_launch.py with torchrun's
environment): exact resume, resharding onto other meshes, starting from Hugging Face weights and exporting them.
The reference is always an uninterrupted run of the same recipe, or transformers itself for the HF weights.
The resume and reshard runs train a tiny model (tests/training/paced_runs.TINY: two blocks, dim 64, grouped-query
attention): exact resume and resharding show at any size, and the debug model's steps were most of their cost (a
4-rank, 10-step debug run ~60 CPU s on 2 cores)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.trainer_runs import ROOT, read_metrics, run_train
from tests.training.paced_runs import TINY, TINY_SHAPE

pytestmark = pytest.mark.slow

COMMON = ["--training.steps", "10", "--training.seq_len", "128", "--checkpoint.enable", "true",
          "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0", "--metrics.enable_tensorboard", "false",
          *TINY]
DEBUG_SHAPE = ("--model.n_layers", "0", "--model.dim", "0", "--model.n_heads", "0")  # 0: the debug model's own
MESHES = {
    "1 rank": (1, ["--parallelism.dp_shard", "1", "--training.local_batch_size", "4"]),
    "dp_shard4": (4, ["--parallelism.dp_shard", "4", "--training.local_batch_size", "1"]),
    "dp_replicate2 x dp_shard2": (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2",
                                      "--training.local_batch_size", "1"]),
    "dp_shard2 x cp2": (4, ["--parallelism.dp_shard", "2", "--parallelism.cp", "2", "--training.local_batch_size", "2"]),
    "tp2 x cp2": (4, ["--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--parallelism.cp", "2",
                      "--training.local_batch_size", "4"]),
}  # every mesh reads a global batch of 4 rows, so all of them train on the same data


def losses(folder: str) -> dict[int, float]:
    """step -> loss; a step logged twice (a restarted job repeats the steps after its checkpoint) keeps the last."""
    return {record["step"]: record["loss"] for record in read_metrics(folder)}


def train(folder: str, mesh: str, *extra: str, timeout: int = 300):
    nproc, args = MESHES[mesh]
    result = run_train(*COMMON, *args, "--job.dump_folder", folder, *extra, nproc=nproc, timeout=timeout, forked=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def resume_from_step5(source: str, folder: str, mesh: str, *extra: str):
    """A fresh run folder holding only the source's step-5 checkpoint: the job resumes it on its own."""
    os.makedirs(os.path.join(folder, "checkpoints"))
    shutil.copytree(os.path.join(source, "checkpoints", "step-5"), os.path.join(folder, "checkpoints", "step-5"))
    result = train(folder, mesh, *extra)
    assert "resumed from" in result.stdout and "(step 5)" in result.stdout
    return losses(folder)


def rows_consumed(checkpoint: str) -> int:
    import torch.distributed.checkpoint as dcp

    from models.hf import quiet_single_process_dcp

    state = {"dataloader": {"global_rows_consumed": 0}}
    with quiet_single_process_dcp():
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return state["dataloader"]["global_rows_consumed"]


@pytest.mark.timeout(1320)  # four runs allowed 300 s each
@pytest.mark.parametrize("mesh", ["1 rank", "dp_shard2 x cp2"])
def test_ten_steps_equal_five_stop_resume_five_bit_for_bit(tmp_path, mesh):
    """Acceptance 1: sync and async saving; per-step losses compared with ==."""
    straight = {}
    for mode in ("disabled", "async"):
        source = str(tmp_path / f"straight-{mode}")
        train(source, mesh, "--checkpoint.async_mode", mode)
        straight[mode] = losses(source)
        assert sorted(straight[mode]) == list(range(1, 11))
        resumed = resume_from_step5(source, str(tmp_path / f"resumed-{mode}"), mesh, "--checkpoint.async_mode", mode)
        assert sorted(resumed) == list(range(6, 11))
        assert all(resumed[s] == straight[mode][s] for s in resumed), (mode, straight[mode], resumed)
    assert straight["disabled"] == straight["async"]  # saving in the background does not perturb training


@pytest.fixture(scope="module")
def source_runs(tmp_path_factory):
    """Uninterrupted 10-step runs by mesh, each trained once for the module."""
    folders = {}

    def run(mesh: str) -> str:
        if mesh not in folders:
            folders[mesh] = str(tmp_path_factory.mktemp("source") / "run")
            train(folders[mesh], mesh)
        return folders[mesh]
    return run


@pytest.mark.timeout(720)  # two runs allowed 300 s each
@pytest.mark.parametrize("source_mesh, target", [
    ("dp_shard4", "dp_shard2 x cp2"), ("dp_shard4", "tp2 x cp2"),
    ("dp_shard4", "dp_replicate2 x dp_shard2"), ("dp_replicate2 x dp_shard2", "dp_shard4"),  # FSDP <-> HSDP
])
def test_save_on_one_mesh_resume_on_another(tmp_path, source_runs, source_mesh, target):
    """Acceptance 2: losses within 1e-5 relative of the uninterrupted source run; the data position continues
    (40 global rows after 10 steps of 4; tests/training/test_checkpoint.py shows row by row that none repeats)."""
    source = source_runs(source_mesh)
    reference = losses(source)
    resumed = resume_from_step5(source, str(tmp_path / "resumed"), target)
    worst = max(abs(resumed[s] - reference[s]) / abs(reference[s]) for s in range(6, 11))
    print(f"{source_mesh} -> {target}: max relative loss difference over steps 6-10: {worst:.2e}")
    assert worst <= 1e-5, (reference, resumed)
    assert rows_consumed(str(tmp_path / "resumed" / "checkpoints" / "step-10")) == 40
    assert rows_consumed(os.path.join(source, "checkpoints", "step-10")) == 40


def _debug_shaped_hf_model(seed: int = 0):
    """A random transformers Llama shaped like our debug model, with GQA and Llama 3.1 RoPE scaling."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=16,
        num_key_value_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    return transformers.LlamaForCausalLM(cfg).eval()


def _first_global_batch(global_batch: int, seq_len: int) -> dict:
    """The trainer's first global batch, rebuilt in this process (the tokenizer is cached by the run)."""
    from data.corpus import load_documents
    from data.loader import build_dataloader
    from data.tokenizer import build_tokenizer

    documents = load_documents(["pydoc"])
    tokenizer = build_tokenizer(None, documents, 2048, os.path.join(ROOT, ".cache"))
    loader = build_dataloader(tokenizer, documents, seq_len=seq_len, local_batch_size=global_batch, dp_rank=0,
                              dp_size=1, seed=0)
    return next(iter(loader))


def test_four_rank_run_from_hf_weights_has_the_single_process_first_loss(tmp_path):
    """Acceptance 3 (last part): dp_shard2 x cp2 starting from HF safetensors; the reference is transformers."""
    pytest.importorskip("transformers")
    reference = _debug_shaped_hf_model()
    reference.save_pretrained(str(tmp_path / "hf"))
    out = str(tmp_path / "run")
    result = train(out, "dp_shard2 x cp2", "--training.steps", "1", "--checkpoint.enable", "false",
                   "--checkpoint.hf_load_path", str(tmp_path / "hf"), "--model.n_kv_heads", "4",
                   "--model.rope_scaling_factor", "8", *DEBUG_SHAPE)
    assert "loaded Hugging Face weights" in result.stdout
    batch = _first_global_batch(4, 128)
    with torch.no_grad():
        logits = reference(batch["input_ids"], position_ids=batch["position_ids"]).logits
    want = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    got = losses(out)[1]
    print(f"first-step loss: 4 ranks {got!r}, transformers {want!r}, rel {abs(got - want) / want:.2e}")
    assert abs(got - want) <= 1e-5 * want


def test_exported_hf_weights_load_in_transformers_with_our_logits(tmp_path):
    """Acceptance 3 (middle part), the distributed export: 2-rank FSDP run, weights exported at the end. The tiny
    model (the export's mapping is the same at any size) on ranks forked from one interpreter (the export is the
    subject, not the launch)."""
    import transformers
    import torch.distributed.checkpoint as dcp

    from models.hf import quiet_single_process_dcp
    from models.llama import Llama, model_config

    out = str(tmp_path / "run")
    result = run_train("--training.steps", "3", "--training.seq_len", "128", "--job.dump_folder", out,
                       "--checkpoint.enable", "true", "--checkpoint.interval", "3", "--metrics.enable_tensorboard",
                       "false", "--checkpoint.hf_export_folder", "hf", "--checkpoint.hf_export_dtype", "float32",
                       *TINY, nproc=2, timeout=300, forked=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(os.path.join(out, "hf"))) == ["step-3"]
    with open(os.path.join(out, "hf", "step-3", "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "float32"
    model = Llama(model_config("debug", **TINY_SHAPE))  # the trained weights, from the run's own DCP checkpoint
    state = {"model": model.state_dict()}
    with quiet_single_process_dcp():
        dcp.load(state, checkpoint_id=os.path.join(out, "checkpoints", "step-3"), no_dist=True)
    model.load_state_dict(state["model"])
    exported = transformers.LlamaForCausalLM.from_pretrained(os.path.join(out, "hf", "step-3")).eval()
    tokens = torch.randint(0, 2048, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(tokens), exported(tokens).logits
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"exported debug model: transformers vs ours, max relative logits error {rel:.2e}")
    assert rel <= 1e-4
