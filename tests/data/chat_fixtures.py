"""Chat test material built here, nothing downloaded: byte-level BPE tokenizers with Llama-3-style and ChatML-style
special tokens and chat templates (written for these tests, with and without `{% generation %}` markers), and seeded
conversations (multi-turn, system prompts, unicode)."""
from __future__ import annotations

import json
import os
import random

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}<|eot_id|>"
    "{% endgeneration %}{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

STYLES = {
    "llama3": (LLAMA3_SPECIALS, LLAMA3_TEMPLATE, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "chatml": (CHATML_SPECIALS, CHATML_TEMPLATE, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
}

WORDS = ("river stone quiet window ledger orbit maple copper signal harbor lantern meadow cipher velvet thunder "
         "Zürich café naïve 東京 привет ñandú 🙂 Δelta").split()


def without_generation_markers(template: str) -> str:
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def training_text() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(60)) + " 0123456789 The number is: ?!.,\n" for _ in range(200)]


def write_chat_tokenizer(folder: str, style: str, *, generation_markers: bool = True, vocab_size: int = 600,
                         template: bool = True) -> str:
    """A tokenizer folder (tokenizer.json + tokenizer_config.json with the style's chat template); returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials, chat_template, tokens = STYLES[style]
    os.makedirs(folder, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_text(), trainer)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = dict(tokens, add_bos_token=False, tokenizer_class="PreTrainedTokenizerFast")
    if template:
        config["chat_template"] = chat_template if generation_markers else without_generation_markers(chat_template)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def conversations(count: int, seed: int = 0) -> list[list[dict]]:
    """Multi-turn conversations, some with a system prompt, unicode text and edge spacing; each has an assistant."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        messages = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": "You are terse. " + " ".join(rng.sample(WORDS, 4))})
        for _ in range(1 + i % 4):
            user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
            reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
            if i % 5 == 1:
                user, reply = "  " + user + "\n", reply + " "
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        out.append(messages)
    return out


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def sized_conversations(count: int, low: int, high: int, seed: int = 0) -> list[list[dict]]:
    """Conversations of about `low`..`high` tokens (log-uniform) with the ChatML fixture tokenizer, whose every word
    of WORDS after a space is one token: a ChatML exchange costs its words plus about 14 tokens (markers, role, the
    first word's few pieces)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        target = int(round(low * (high / low) ** rng.random()))
        turns = max(1, min(1 + i % 4, target // 40))
        words = max(1, (target - 14 * turns) // (2 * turns))  # per message; the user gets 2/3 of an exchange's words
        messages = []
        for _ in range(turns):
            user = max(1, (words * 4) // 3) if words > 1 else 1
            messages += [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(user))},
                         {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(2 * words - user))
                          or rng.choice(WORDS)}]
        out.append(messages)
    return out
