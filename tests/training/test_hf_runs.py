"""Bring your own checkpoint, end to end: `[model] name = "hf"` runs of tiny tied Qwen3 / Llama 3.2 folders made with
transformers, against a single-process run of the same folder (tests/loss_reference.py's reference, loaded by
models.hf.load_hf); the export read by transformers' Auto classes and pipeline; unsupported folders refused in one
line before torchrun."""
from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch

from tests.loss_reference import max_relative_error, reference_run, trainer_run
from tests.hf_folders import random_hf_model, write_bpe_tokenizer
from tests.trainer_runs import ROOT, read_metrics, run_train

transformers = pytest.importorskip("transformers")

STEPS, SEQ_LEN = 3, 192  # 192: several pydoc documents per row, and splits into 2 x cp chunks and over cp x tp
MESHES = {"cp2 x tp2": dict(cp=2, tp=2, dp_shard=1), "dp_shard2 x cp2 + documents": dict(dp_shard=2, cp=2)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny folders (two tied, Qwen2.5 untied with biases) with the debug recipe's vocabulary (2048), so the run's
    trained tokenizer fits them."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in ("qwen3_qk_norm", "llama3_2_tied", "qwen2_5_bias"):
        random_hf_model(kind, vocab_size=2048).save_pretrained(root / kind)
        out[kind] = str(root / kind)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, mesh", [(kind, mesh) for kind in ("qwen3_qk_norm", "llama3_2_tied") for mesh in MESHES]
                         + [("qwen2_5_bias", "cp2 x tp2")])
def test_hf_model_trains_like_one_process(tmp_path, folders, kind, mesh):
    """3 steps, fp32, with full activation checkpointing and the chunked loss on; the reference has neither. The
    export at the end, written from the TP / FSDP shards, holds a tied embedding once, whole."""
    documents = mesh.endswith("documents")
    reference = reference_run(STEPS, SEQ_LEN, hf_load_path=folders[kind], document_masking=documents)
    extra = ["--model.name", "hf", "--checkpoint.hf_load_path", folders[kind], "--activation_checkpoint.mode", "full",
             "--training.loss_chunk_tokens", "48", "--data.document_masking", str(documents).lower(),
             "--checkpoint.hf_export_folder", str(tmp_path / "export"), "--checkpoint.hf_export_dtype", "float32"]
    records = trainer_run(MESHES[mesh], STEPS, SEQ_LEN, extra=extra, timeout=300)
    errors = {key: max_relative_error(reference, records, key) for key in ("loss", "grad_norm")}
    print(f"{kind} on {mesh}: max relative error vs the single process: {errors}")
    if documents:
        assert sum(r["documents"] for r in reference) >= 4 * STEPS + 3  # rows really hold several documents
    assert errors["loss"] <= 1e-5 and errors["grad_norm"] <= 1e-5, (records, reference)
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export" / f"step-{STEPS}"))
    source = transformers.AutoModelForCausalLM.from_pretrained(folders[kind])
    tied = source.config.tie_word_embeddings
    assert exported.config.tie_word_embeddings == tied and type(exported) is type(source)
    assert (exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()) == tied
    assert exported.model.embed_tokens.weight.shape == source.model.embed_tokens.weight.shape
    assert not torch.equal(exported.model.embed_tokens.weight, source.model.embed_tokens.weight)  # trained


RAMP_RECIPE = """
[job]
seed = 0
[model]
name = "hf"
[training]
steps = 2
seq_len = 64
local_batch_size = 2
[data]
corpus = ["pydoc"]
[parallelism]
dp_shard = 1
[metrics]
enable_tensorboard = false
[checkpoint]
hf_export_folder = "hf"
hf_export_dtype = "float32"
[[ramp]]
start_step = 0
seq_len = 64
[[ramp]]
start_step = 1
seq_len = 128
rope_type = "yarn"
rope_scaling_factor = 4.0
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_of_an_hf_run_loads_in_transformers_and_generates(tmp_path):
    """A Qwen3 folder with its own BPE tokenizer, a two-stage ramp whose second stage switches YaRN on, exported at
    the end: tokenizer, model and pipeline load from the export alone, and config.json says what was trained."""
    from pydoc_data.topics import topics

    source = str(tmp_path / "source")
    write_bpe_tokenizer(source, list(topics.values()), vocab_size=320)
    random_hf_model("qwen3_qk_norm", vocab_size=320, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
                    ).save_pretrained(source)
    recipe = tmp_path / "ramp.toml"
    recipe.write_text(textwrap.dedent(RAMP_RECIPE))
    out = str(tmp_path / "run")
    result = run_train(str(recipe), "--job.dump_folder", out, "--checkpoint.hf_load_path", source,
                       "--data.tokenizer_path", source, "--data.cache_dir", str(tmp_path / "cache"), nproc=1,
                       forked=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["seq_len"] for r in read_metrics(out)] == [64, 128]
    export = os.path.join(out, "hf", "step-2")
    with open(os.path.join(export, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)  # <|begin_of_text|>, <|end_of_text|>
    assert config["max_position_embeddings"] == 128  # the longest stage trained
    rope = config["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 128)
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_theta"] == 1e6  # transformers 4.x layout

    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    source_tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    text = "The with statement wraps a block with methods defined by a context manager."
    assert tokenizer(text)["input_ids"] == source_tokenizer(text)["input_ids"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied: one tensor
    assert model.config.rope_parameters["rope_type"] == "yarn"
    from safetensors import safe_open

    with safe_open(os.path.join(export, "model-00001-of-00001.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # the output layer is the embedding, written once
    generate = transformers.pipeline("text-generation", model=export, dtype=torch.float32)
    generated = generate("The with statement", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert generated.startswith("The with statement") and len(generated) > len("The with statement")


def _check(*args: str, launcher: bool = False) -> tuple[int, str]:
    """train.py --check in this process (the code path run_train.sh runs before torchrun), or the launcher itself."""
    if launcher:
        result = run_train(*args, "--check", timeout=120)
        return result.returncode, result.stderr.strip()
    import contextlib
    import io

    import train

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = train.main([os.path.join(ROOT, "recipes", "debug.toml"), *args, "--check"])
    return code, err.getvalue().strip()


UNSUPPORTED = {
    "sliding window": ({"use_sliding_window": True, "sliding_window": 32}, "sliding-window attention"),
    "mixture of experts": ({"num_experts": 8, "moe_intermediate_size": 32}, "mixture of experts"),
    "another rope type": ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6}}, "rope_type 'longrope'"),
    "another model_type": ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    "o_proj bias": ({"attention_bias": True}, "attention_bias = true is not supported"),
}


def test_unsupported_configs_and_pp_with_tied_are_one_line_errors_before_torchrun(tmp_path, folders):
    base = json.loads(open(os.path.join(folders["qwen3_qk_norm"], "config.json")).read())
    for i, (label, (change, message)) in enumerate(UNSUPPORTED.items()):
        folder = tmp_path / label.replace(" ", "_")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**base, **change}))
        code, err = _check("--model.name", "hf", "--checkpoint.hf_load_path", str(folder), launcher=i == 0)
        assert code == 2 and message in err and len(err.splitlines()) == 1, (label, err)
        assert "config.json" in err, err
    code, err = _check("--model.name", "hf", "--checkpoint.hf_load_path", folders["qwen3_qk_norm"],
                       "--parallelism.pp", "2", "--parallelism.dp_shard", "1")
    assert code == 2 and "tie_embeddings untied" in err and len(err.splitlines()) == 1, err
    code, err = _check("--model.name", "hf")
    assert code == 2 and "needs checkpoint.hf_load_path" in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tied_model_resumes_from_its_checkpoint_exactly(tmp_path, folders):
    """A tied model's DCP checkpoint holds the one weight under both names; resuming at step 2 of 3 gives the
    uninterrupted run's step 3."""
    common = ["--model.name", "hf", "--checkpoint.hf_load_path", folders["qwen3_qk_norm"], "--training.seq_len", "128",
              "--parallelism.dp_shard", "2", "--metrics.enable_tensorboard", "false"]
    whole = str(tmp_path / "whole")
    assert run_train(*common, "--training.steps", "3", "--job.dump_folder", whole, nproc=2, forked=True,
                     timeout=300).returncode == 0
    resumed = str(tmp_path / "resumed")
    for steps in ("2", "3"):
        result = run_train(*common, "--training.steps", steps, "--job.dump_folder", resumed, "--checkpoint.enable",
                           "true", "--checkpoint.interval", "1", nproc=2, forked=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    last = read_metrics(resumed)[-1]
    reference = read_metrics(whole)[-1]
    assert last["step"] == 3 and (last["loss"], last["grad_norm"]) == (reference["loss"], reference["grad_norm"])
