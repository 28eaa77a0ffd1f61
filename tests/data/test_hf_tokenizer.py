"""Hugging Face tokenizer.json support against transformers itself: a Llama 3 style byte-level BPE built here with the
`tokenizers` library (nothing downloaded) gives the ids of `PreTrainedTokenizerFast` on the same file, round-trips
text, trains the debug model, and an HF folder with weights and tokenizer feeds one run from one path, whose first
loss equals transformers' loss on the same rows."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from data.corpus import load_documents
from data.hf_tokenizer import HFTokenizer
from data.tokenizer import build_tokenizer
from tests.trainer_runs import read_metrics, run_train
from config import RecipeError

transformers = pytest.importorskip("transformers")

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TEXTS = ["Hello, world!", "  leading spaces and ünïcode 🙂\n\ttabs", "def f(x):\n    return x ** 2  # 12345",
         ""]


def write_llama3_style_tokenizer(folder, vocab_size: int = 1024, with_eos: bool = True, config: bool = True) -> str:
    """Byte-level BPE trained on pydoc with Llama 3's special tokens and its BOS post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    os.makedirs(folder, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [BOS, EOS] if with_eos else [BOS]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(load_documents(["pydoc"]), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[
        (BOS, tokenizer.token_to_id(BOS))])
    path = os.path.join(folder, "tokenizer.json")
    tokenizer.save(path)
    if config:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": BOS, "eos_token": EOS if with_eos else None, "add_bos_token": True}, f)
    return path


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf_tok"))
    write_llama3_style_tokenizer(folder)
    return folder


def test_ids_equal_transformers_fast_tokenizer_and_text_round_trips(tokenizer_folder):
    ours = HFTokenizer(os.path.join(tokenizer_folder, "tokenizer.json"))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(tokenizer_folder, "tokenizer.json"),
                                                     bos_token=BOS, eos_token=EOS)
    documents = load_documents(["pydoc"])[:20] + TEXTS
    for text in documents:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == text
    assert ours.encode_batch(documents) == [reference.encode(t, add_special_tokens=False) for t in documents]
    assert (ours.bos_id, ours.eos_id) == (reference.bos_token_id, reference.eos_token_id)
    assert ours.add_bos and ours.vocab_size == len(reference)


def test_a_folder_or_the_file_loads_and_bad_tokenizers_are_one_line_errors(tmp_path, tokenizer_folder):
    for path in (tokenizer_folder, os.path.join(tokenizer_folder, "tokenizer.json")):
        assert isinstance(build_tokenizer(path, [], 2048, str(tmp_path)), HFTokenizer)
    with pytest.raises(RecipeError) as info:
        build_tokenizer(tokenizer_folder, [], 512, str(tmp_path))
    assert "\n" not in str(info.value) and "model.vocab_size" in str(info.value) and "1024" in str(info.value)
    no_eos = str(tmp_path / "no_eos")
    write_llama3_style_tokenizer(no_eos, vocab_size=300, with_eos=False)
    with pytest.raises(RecipeError) as info:
        build_tokenizer(no_eos, [], 2048, str(tmp_path))
    assert "\n" not in str(info.value) and "no EOS" in str(info.value) and "tokenizer.json" in str(info.value)


@pytest.mark.slow
def test_the_debug_model_trains_with_a_tokenizer_json(tmp_path, tokenizer_folder):
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): trainer launches, 35 s."""
    out = str(tmp_path / "run")
    result = run_train("--job.dump_folder", out, "--training.steps", "3", "--training.seq_len", "128",
                       "--data.tokenizer_path", tokenizer_folder, "--data.cache_dir", str(tmp_path / "cache"),
                       "--metrics.enable_tensorboard", "false", "--parallelism.dp_shard", "1", nproc=1,
                       forked=True)  # what the tokenizer gives the trainer, not the launch
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    manifest_paths = list((tmp_path / "cache" / "stores").glob("*/manifest.json"))
    manifest = json.loads(manifest_paths[0].read_text())
    assert manifest["bos_added"] and manifest["eos_id"] == HFTokenizer(
        os.path.join(tokenizer_folder, "tokenizer.json")).eos_id


@pytest.mark.slow
def test_an_hf_folder_gives_weights_and_tokenizer_from_one_path(tmp_path):
    """The run's first loss equals transformers' loss of the same weights on the same rows. Slow tier since issue 56
    (the fast tier runs in minutes; CI runs both): a trainer launch beside transformers, 24 s."""
    from data.loader import GlobalRowStream
    from data.prepare import StoreSpec, open_store
    from data.store_rows import StoreRows

    folder = str(tmp_path / "hf")
    write_llama3_style_tokenizer(folder, vocab_size=512)
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      rope_theta=500000.0, max_position_embeddings=256, tie_word_embeddings=False)
    reference = transformers.LlamaForCausalLM(hf_cfg).eval()
    reference.save_pretrained(folder)
    out, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    result = run_train("--job.dump_folder", out, "--training.steps", "1", "--training.seq_len", "64",
                       "--training.local_batch_size", "2", "--model.dim", "64", "--model.n_layers", "2",
                       "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.vocab_size", "512",
                       "--checkpoint.hf_load_path", folder, "--data.tokenizer_path", folder,
                       "--data.cache_dir", cache, "--metrics.enable_tensorboard", "false", "--parallelism.dp_shard", "1",
                       nproc=1, forked=True)  # the loaded weights' loss, not the launch
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    first_loss = read_metrics(out)[0]["loss"]

    tokenizer = HFTokenizer(os.path.join(folder, "tokenizer.json"))
    store = open_store(StoreSpec("corpus", ("pydoc",), "text", cache), tokenizer)
    rows = GlobalRowStream(StoreRows(store, seq_len=64, seed=0), seed=0)
    batch = [rows[g] for g in range(2)]
    input_ids = torch.stack([b["input_ids"] for b in batch])
    labels = torch.stack([b["labels"] for b in batch])
    with torch.no_grad():
        logits = reference(input_ids=input_ids).logits.float()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), labels.reshape(-1)).item()
    assert abs(first_loss - want) / want < 1e-5, (first_loss, want)
    assert np.isfinite(want)
