"""The export keeps the model it was given: the context length the source folder declares (training at 1K does not
shrink an 8K model) and the source folder's dtype (a float32 model does not come back rounded to bfloat16)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from tests.hf_folders import random_hf_model
from tests.trainer_runs import read_metrics, run_train
from training.hf_export import export_dtype, exported_context_length

transformers = pytest.importorskip("transformers")  # a pinned test requirement: conftest turns this skip into a failure


def _stages(*lengths):
    return [SimpleNamespace(cfg=SimpleNamespace(training=SimpleNamespace(seq_len=n))) for n in lengths]


@pytest.fixture(scope="module")
def folder_8k(tmp_path_factory):
    """A float32 Llama folder that declares 8,192 positions, vocabulary of the debug recipe's tokenizer (2048)."""
    path = str(tmp_path_factory.mktemp("hf8k") / "llama")
    random_hf_model("llama3_2_tied", vocab_size=2048, max_position_embeddings=8192).save_pretrained(path)
    return path


@pytest.mark.parametrize("trained, declared", [(1024, 8192), (16384, 16384)])
def test_exported_context_is_the_longer_of_source_and_trained(folder_8k, trained, declared):
    assert exported_context_length(folder_8k, _stages(512, trained)) == declared
    assert exported_context_length("", _stages(512, trained)) == trained  # from scratch: what was trained


def test_auto_dtype_is_the_source_folders_and_bfloat16_from_scratch(folder_8k, tmp_path):
    auto = SimpleNamespace(hf_export_dtype="auto", hf_load_path=folder_8k)
    assert export_dtype(auto) == torch.float32
    assert export_dtype(SimpleNamespace(hf_export_dtype="auto", hf_load_path="")) == torch.bfloat16
    assert export_dtype(SimpleNamespace(hf_export_dtype="float16", hf_load_path=folder_8k)) == torch.float16
    half = str(tmp_path / "bf16")
    random_hf_model("qwen2_5_bias", vocab_size=64).to(torch.bfloat16).save_pretrained(half)
    with open(os.path.join(half, "config.json")) as f:
        config = json.load(f)
    config.pop("dtype", None), config.pop("torch_dtype", None)  # unnamed: read from the safetensors header
    with open(os.path.join(half, "config.json"), "w") as f:
        json.dump(config, f)
    assert export_dtype(SimpleNamespace(hf_export_dtype="auto", hf_load_path=half)) == torch.bfloat16


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_float32_folder_trained_at_1k_exports_itself(folder_8k, tmp_path):
    """2 steps at lr 1e-30 change nothing representable: the default export (dtype auto) must give the source's
    logits within 1e-6 and still declare 8,192 positions (a bfloat16 export was 7e-3 away, and declared 1,024)."""
    out = str(tmp_path / "run")
    result = run_train("recipes/debug.toml", "--job.dump_folder", out, "--model.name", "hf",
                       "--checkpoint.hf_load_path", folder_8k, "--checkpoint.hf_export_folder", "hf",
                       "--training.steps", "2", "--training.seq_len", "1024", "--training.local_batch_size", "1",
                       "--optimizer.lr", "1e-30", "--parallelism.dp_shard", "1", "--metrics.enable_tensorboard",
                       "false", nproc=1, forked=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["seq_len"] for r in read_metrics(out)] == [1024, 1024]
    export = os.path.join(out, "hf", "step-2")
    exported = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    source = transformers.AutoModelForCausalLM.from_pretrained(folder_8k, dtype=torch.float32)
    assert exported.config.max_position_embeddings == 8192
    assert next(iter(exported.state_dict().values())).dtype == torch.float32
    tokens = torch.randint(0, 2048, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (exported(tokens).logits - source(tokens).logits).abs().max().item()
    print(f"export vs source logits: max |diff| {gap:.2e}")
    assert gap <= 1e-6
