"""What makes an HF export folder self-contained beyond the weights: the tokenizer files of `data.tokenizer_path`,
generation_config.json, and the config.json fields only the run knows (bos/eos ids from its tokenizer, the longest
context length as `max_position_embeddings`: the longer of the source folder's and the longest sequence trained,
so a model pretrained for 8K and fine-tuned at 1K still serves 8K), so `AutoTokenizer`, `AutoModelForCausalLM` and
`pipeline("text-generation", folder)` take the folder as it is.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import torch

from data.hf_tokenizer import tokenizer_json_in
from models.hf_config import hf_weights_dtype, read_hf_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")


@dataclass
class ExportExtras:
    """Filled once by the trainer, written into every export by rank 0."""
    bos_token_id: int | None
    eos_token_id: int | None
    max_position_embeddings: int
    add_bos: bool = False
    """Whether the run's data put BOS before each document (what the exported tokenizer should do too)."""
    tokenizer_path: str = ""
    """data.tokenizer_path: a tokenizer.json, a folder holding one, or a SentencePiece .model (empty: trained by the
    run, in `trained_tokenizer_model`)."""
    trained_tokenizer_model: str = ""
    generation_config_from: str = ""
    """checkpoint.hf_load_path, whose generation_config.json (sampling defaults) is kept when it has one."""
    model_config_fields: dict = field(init=False)

    def __post_init__(self):
        self.model_config_fields = dict(bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
                                        max_position_embeddings=self.max_position_embeddings)


def export_dtype(checkpoint_cfg) -> torch.dtype:
    """`checkpoint.hf_export_dtype`, with "auto" read as the source folder's dtype (bfloat16 without a source): an
    export should hold the model it was given, not a rounded copy of it."""
    name = checkpoint_cfg.hf_export_dtype
    if name == "auto":
        source = checkpoint_cfg.hf_load_path
        name = (hf_weights_dtype(source) if source else None) or "bfloat16"
    return getattr(torch, name)


def exported_context_length(hf_load_path: str, stages) -> int:
    """max(the source folder's max_position_embeddings, the longest sequence trained): training at 1K must not
    shrink what the model was pretrained to serve."""
    trained = max(s.cfg.training.seq_len for s in stages)
    source = int(read_hf_config(hf_load_path).get("max_position_embeddings") or 0) if hf_load_path else 0
    return max(trained, source)


def export_extras(cfg, stages, tokenizer) -> ExportExtras:
    """The run's extras: ids from its tokenizer, the context length to declare, where its tokenizer files are."""
    bos = getattr(tokenizer, "bos_id", -1)
    eos = getattr(tokenizer, "eos_id", -1)
    source = getattr(tokenizer, "source", "")
    return ExportExtras(bos_token_id=bos if bos is not None and bos >= 0 else None,
                        eos_token_id=eos if eos is not None and eos >= 0 else None,
                        max_position_embeddings=exported_context_length(cfg.checkpoint.hf_load_path, stages),
                        add_bos=bool(getattr(tokenizer, "add_bos", False)),
                        tokenizer_path=cfg.data.tokenizer_path,
                        trained_tokenizer_model="" if cfg.data.tokenizer_path else str(source),
                        generation_config_from=cfg.checkpoint.hf_load_path)


def write_export_extras(extras: ExportExtras, folder: str) -> None:
    """Tokenizer files and generation_config.json into an export `folder` (config.json is written by save_hf)."""
    _write_tokenizer(extras, folder)
    generation = _read_json(os.path.join(extras.generation_config_from, "generation_config.json")
                            ) if extras.generation_config_from else {}
    generation.update(bos_token_id=extras.bos_token_id, eos_token_id=generation.get("eos_token_id")
                      if _same_eos(generation.get("eos_token_id"), extras.eos_token_id) else extras.eos_token_id)
    generation.setdefault("pad_token_id", extras.eos_token_id)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)


def _same_eos(configured, eos: int | None) -> bool:
    """A source generation config may list several stop ids (Llama 3 Instruct: end_of_text and eot): keep them when
    they include the tokenizer's EOS."""
    return configured == eos or (isinstance(configured, list) and eos in configured)


def _write_tokenizer(extras: ExportExtras, folder: str) -> None:
    """A tokenizer.json with the files beside it (its tokenizer_config.json completed with what it lacks), or a
    SentencePiece model with a tokenizer_config.json for transformers' LlamaTokenizer."""
    path = extras.tokenizer_path
    tokenizer_json = tokenizer_json_in(path) if path else None
    if tokenizer_json:
        source_folder = os.path.dirname(os.path.abspath(tokenizer_json))
        shutil.copyfile(tokenizer_json, os.path.join(folder, "tokenizer.json"))
        for name in TOKENIZER_FILES[1:]:
            if name != "tokenizer.model" and os.path.isfile(os.path.join(source_folder, name)):
                shutil.copyfile(os.path.join(source_folder, name), os.path.join(folder, name))
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  **_read_json(os.path.join(folder, "tokenizer_config.json"))}
        for key, value in _special_token_names(folder, extras).items():
            config.setdefault(key, value)
    else:  # a SentencePiece model: given (a file, or a folder holding tokenizer.model), or trained by the run
        model = os.path.join(path, "tokenizer.model") if path and os.path.isdir(path) else path
        model = model or extras.trained_tokenizer_model
        if not model or not os.path.isfile(model):
            return
        shutil.copyfile(model, os.path.join(folder, "tokenizer.model"))
        config = {"tokenizer_class": "LlamaTokenizer", **_sentencepiece_settings(model, extras.add_bos)}
    config["model_max_length"] = extras.max_position_embeddings
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _sentencepiece_settings(model: str, add_bos: bool) -> dict:
    """tokenizer_config.json keys that make transformers' LlamaTokenizer encode like the SentencePiece model itself:
    its dummy-prefix setting (ours train without one) and BOS as the run's data had it, no EOS."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=model)
    prefix = processor.id_to_piece(processor.encode("a")[0]).startswith("\u2581")
    return {"add_prefix_space": prefix, "legacy": False, "add_bos_token": add_bos, "add_eos_token": False,
            "bos_token": processor.id_to_piece(processor.bos_id()) if processor.bos_id() >= 0 else None,
            "eos_token": processor.id_to_piece(processor.eos_id()) if processor.eos_id() >= 0 else None}


def _special_token_names(folder: str, extras: ExportExtras) -> dict:
    """bos_token / eos_token strings of the exported tokenizer (from its own vocabulary), for a config lacking them."""
    tokenizer_json = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        return {}
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_json)
    out = {}
    for key, token_id in (("bos_token", extras.bos_token_id), ("eos_token", extras.eos_token_id)):
        if token_id is not None:
            out[key] = tokenizer.id_to_token(token_id)
    return out
