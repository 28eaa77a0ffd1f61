"""Synthetic long conversations for the SFT recipe (recipes/debug_sft_cp2.toml) and its learning test: nothing to
download. Each conversation states a code word (one of 20, each one token, never in the filler) early in a long user
turn of 20-60 filler words, and asks for it at the end; the assistant's answer is the code. Only assistant turns carry labels, so what the model learns is
to find a value far back in the user's text.

    python -m data.synthetic_chat OUT_DIR [--train 4000] [--heldout 200]

writes OUT_DIR/tokenizer/ (a byte-level BPE, one token per code word, and a Llama-3-style chat template with
`{% generation %}` markers), OUT_DIR/train.jsonl and OUT_DIR/heldout.jsonl ({"messages": [...]} per line).
"""
from __future__ import annotations

import argparse
import json
import os
import random

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}<|eot_id|>"
    "{% endgeneration %}{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CODES = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango").split()
FILLER = ("the river runs past the old mill and birds rest on the stone wall while the day stays long and quiet "
          "we walk to the hill and come back again").split()
CODE_INTRO = "Note this, the code is:"
QUESTION = "Now, what is the code?"


def conversation(rng: random.Random, filler_words: int) -> tuple[list[dict], str]:
    """(messages, the code): the code early in a long user turn, filler after it, the question at the end."""
    code = rng.choice(CODES)
    before = " ".join(rng.choice(FILLER) for _ in range(rng.randint(0, 4)))
    after = " ".join(rng.choice(FILLER) for _ in range(filler_words))
    messages = [{"role": "user", "content": f"{before} {CODE_INTRO}\n{code}\n{after}. {QUESTION}".strip()},
                {"role": "assistant", "content": code}]
    if rng.random() < 0.5:  # a second exchange first: every assistant turn is labelled, not only the last
        messages = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hello."}] + messages
    return messages, code


def conversations(count: int, seed: int, filler_words: tuple[int, int] = (20, 60)) -> list[tuple[list[dict], str]]:
    rng = random.Random(seed)
    return [conversation(rng, rng.randint(*filler_words)) for _ in range(count)]


def write_tokenizer(folder: str, vocab_size: int = 512) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(folder, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [" ".join(FILLER), CODE_INTRO, QUESTION, "Hello there. Hello. 0123456789 user assistant system",
            "\n".join(CODES)]
    tokenizer.train_from_iterator(text * 20, trainer)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "add_bos_token": False,
                   "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE}, f)
    return folder


def write_dataset(out: str, train: int = 4000, heldout: int = 200, seed: int = 0) -> None:
    write_tokenizer(os.path.join(out, "tokenizer"))
    for name, count, split_seed in (("train", train, seed), ("heldout", heldout, seed + 1)):
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            for messages, _ in conversations(count, split_seed):
                f.write(json.dumps({"messages": messages}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--heldout", type=int, default=200)
    args = parser.parse_args()
    write_dataset(args.out, args.train, args.heldout)
    print(f"wrote {args.out}/tokenizer, train.jsonl ({args.train}), heldout.jsonl ({args.heldout})")


if __name__ == "__main__":
    main()
