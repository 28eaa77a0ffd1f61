"""Tiny Hugging Face folders built in the test process (nothing downloaded): random transformers models of the Llama
3.2 / Qwen2.5 / Qwen3 kinds, every weight random (norms and biases too, so a mapping mistake cannot hide behind ones
and zeros), and a byte-level BPE tokenizer.json trained with the `tokenizers` library."""
from __future__ import annotations

import json
import os

import torch

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32}


def hf_config(kind: str, vocab_size: int = 96, **overrides):
    """A transformers config of one of the three kinds (tiny: hidden 64, 2 layers, GQA 4 / 2 heads or 8 / 2)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  rms_norm_eps=1e-6, max_position_embeddings=128)
    if kind == "llama3_2_tied":
        cfg = transformers.LlamaConfig(**common, num_attention_heads=8, num_key_value_heads=2,
                                       tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE))
    elif kind == "qwen2_5_bias":
        cfg = transformers.Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif kind == "qwen3_qk_norm":
        cfg = transformers.Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                       tie_word_embeddings=True, rope_parameters=dict(YARN_ROPE))
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


KINDS = ("llama3_2_tied", "qwen2_5_bias", "qwen3_qk_norm")


def random_hf_model(kind: str, seed: int = 0, **config):
    """A transformers model with every parameter random: matrices N(0, 0.05), norms 1 + N(0, 0.2), biases N(0, 0.2)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write_bpe_tokenizer(folder: str, texts: list[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json (+ tokenizer_config.json naming BOS/EOS, as a hub folder has) of exactly
    `vocab_size` ids, trained on `texts`; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                   "add_bos_token": True}, f)
    return folder
