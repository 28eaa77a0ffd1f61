"""The export's tokenizer and generation files, read back by transformers: a SentencePiece model trained the way a
run trains one (no tokenizer_path) and a bare tokenizer.json (no tokenizer_config.json beside it) must give the ids
our own tokenizers give, with the run's BOS/EOS."""
from __future__ import annotations

import json
import os

import pytest

from data.hf_tokenizer import HFTokenizer
from data.tokenizer import Tokenizer, train_model_proto
from tests.hf_folders import write_bpe_tokenizer
from training.hf_export import ExportExtras, write_export_extras

transformers = pytest.importorskip("transformers")

TEXTS = ["The with statement wraps a block.", "  two  spaces\nand a new line", "hello world", "x"]


def _documents() -> list[str]:
    from pydoc_data.topics import topics

    return list(topics.values())[:30]


def test_trained_sentencepiece_exports_as_a_llama_tokenizer(tmp_path):
    model = tmp_path / "spm.model"
    model.write_bytes(train_model_proto(_documents(), 400))
    ours = Tokenizer.from_file(str(model))
    extras = ExportExtras(bos_token_id=ours.bos_id, eos_token_id=ours.eos_id, max_position_embeddings=256,
                          add_bos=ours.add_bos, trained_tokenizer_model=str(model))
    out = tmp_path / "export"
    out.mkdir()
    write_export_extras(extras, str(out))
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        assert loaded(text)["input_ids"] == ours.encode(text), text
    assert (loaded.bos_token_id, loaded.eos_token_id) == (ours.bos_id, ours.eos_id)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (ours.bos_id, ours.eos_id)


def test_bare_tokenizer_json_gets_a_config_naming_its_special_tokens(tmp_path):
    source = write_bpe_tokenizer(str(tmp_path / "source"), _documents(), vocab_size=300)
    os.remove(os.path.join(source, "tokenizer_config.json"))  # a tokenizer.json alone
    ours = HFTokenizer(os.path.join(source, "tokenizer.json"))
    extras = ExportExtras(bos_token_id=ours.bos_id, eos_token_id=ours.eos_id, max_position_embeddings=128,
                          tokenizer_path=source)
    out = tmp_path / "export"
    out.mkdir()
    write_export_extras(extras, str(out))
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (loaded.bos_token_id, loaded.eos_token_id) == (0, 1) == (ours.bos_id, ours.eos_id)
    for text in TEXTS:
        assert loaded(text, add_special_tokens=False)["input_ids"] == ours.encode(text), text
    assert loaded.model_max_length == 128
