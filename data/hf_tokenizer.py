"""Hugging Face `tokenizer.json` tokenizers (Llama 3's byte-level BPE, 128,256 ids), loaded with the `tokenizers` library.

Continuing training from Hugging Face Llama 3 weights needs the tokenizer they were trained with; any other one turns
the embeddings into noise. BOS and EOS come from `tokenizer_config.json` beside the file when it names them (as every
Hugging Face Llama folder does), else from the special tokens the file itself declares (`<|begin_of_text|>` /
`<|end_of_text|>`, `<s>` / `</s>`, `<|endoftext|>`). Documents are encoded without the post-processor's special tokens;
the data pipeline adds BOS (when the tokenizer config asks for it, as Llama 3's does) and EOS itself, once per document.
"""
from __future__ import annotations

import hashlib
import json
import os

from config import RecipeError

BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|startoftext|>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>")


class HFTokenizer:
    """The calls the data pipeline needs, over a `tokenizers.Tokenizer`."""

    def __init__(self, path: str, *, key: str = "data.tokenizer_path"):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tokenizer = RustTokenizer.from_file(path)
        except Exception as err:  # the Rust side raises a plain Exception subclass for malformed files
            raise RecipeError(f"{key}: '{path}' is not a Hugging Face tokenizer.json ({str(err).splitlines()[0]}); "
                              f"point it at the tokenizer.json of a Hugging Face model folder.") from None
        self.source = path
        config = _tokenizer_config(os.path.dirname(os.path.abspath(path)))
        self.bos_id = self._special_id(config.get("bos_token"), BOS_NAMES)
        eos = self._special_id(config.get("eos_token"), EOS_NAMES)
        if eos < 0:
            raise RecipeError(f"{key}: '{path}' defines no EOS token (looked for tokenizer_config.json's eos_token and "
                              f"{', '.join(EOS_NAMES)}); packing needs one to separate documents. Use the model's "
                              f"own tokenizer folder or add an EOS special token.")
        self.eos_id = eos
        self.add_bos = self.bos_id >= 0 and bool(config.get("add_bos_token", self._post_processor_adds_bos()))
        with open(path, "rb") as f:
            self.fingerprint = hashlib.sha256(f.read()).hexdigest()[:24]
        self.fingerprint += f"-bos{int(self.add_bos)}"

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return self.eos_id  # Llama 3 has no pad token; padded positions never reach the loss

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str):
        """The `tokenizers.Encoding` (ids, offsets, char_to_token) without special tokens added: chat rendering."""
        return self._tokenizer.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str], threads: int | None = None) -> list[list[int]]:
        """`threads` is set by the `tokenizers` library per process (RAYON_NUM_THREADS); the store's workers set 1."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def _special_id(self, configured, names: tuple[str, ...]) -> int:
        if isinstance(configured, dict):
            configured = configured.get("content")
        for name in ([configured] if configured else []) + list(names):
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        return -1

    def _post_processor_adds_bos(self) -> bool:
        if self.bos_id < 0:
            return False
        probe = self._tokenizer.encode("a", add_special_tokens=True).ids
        return bool(probe) and probe[0] == self.bos_id


def tokenizer_json_in(path: str) -> str | None:
    """`path` itself if it is a tokenizer.json, the tokenizer.json inside it if it is a folder holding one, else None."""
    if os.path.isdir(path):
        candidate = os.path.join(path, "tokenizer.json")
        return candidate if os.path.isfile(candidate) else None
    return path if path.endswith(".json") else None


def _tokenizer_config(folder: str) -> dict:
    config_path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return {}
    try:
        with open(config_path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RecipeError(f"data.tokenizer_path: '{config_path}' is not valid JSON ({err}); fix or remove it.") from None
