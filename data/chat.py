"""Chat conversations -> token ids and a label mask, rendered with the tokenizer folder's own chat template.

Rendering. The template is `chat_template` of tokenizer_config.json beside the tokenizer.json, rendered with the Jinja
environment transformers builds for `apply_chat_template` (sandboxed, trim_blocks and lstrip_blocks, loop controls, a
`tojson` filter that keeps non-ASCII text, `raise_exception`, `strftime_now`, and the `{% generation %}` tag), with the
special-token strings of tokenizer_config.json (bos_token, eos_token, ...) as variables. The text is then encoded
without adding special tokens, as transformers does, so the ids are what the model sees at inference.

Which tokens carry labels: every assistant turn's.
- Templates that mark generation (`{% generation %}...{% endgeneration %}`): the tokens covering those character
  spans, mapped to tokens exactly as transformers' `return_assistant_tokens_mask` does.
- Other templates, the prefix rule: for assistant message i, P = render(messages[:i], add_generation_prompt=True) and
  R = render(messages[:i + 1]); the labelled characters are R[len(P):] without its trailing whitespace (the reply and
  its end-of-turn token). The template must render prefixes as prefixes; one that does not is reported.

Turn starts (where `truncate = "turns"` may cut a conversation) are the first tokens of each message's rendering.
"""
from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from datetime import datetime

import numpy as np

from config import RecipeError

ROLES = ("system", "user", "assistant", "tool")
LABEL = 1  # bit of the store's per-token mask: the token is predicted (an assistant token)
TURN_START = 2  # bit of the store's per-token mask: the token starts a message
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def tokenizer_folder(tokenizer_path: str) -> str:
    return tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(os.path.abspath(tokenizer_path))


def load_chat_template(tokenizer_path: str, key: str) -> tuple[str, dict]:
    """(template source, special-token variables) of the tokenizer folder; a one-line error when it has none."""
    folder = tokenizer_folder(tokenizer_path) if tokenizer_path else ""
    config_path = os.path.join(folder, "tokenizer_config.json")
    config = {}
    if folder and os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not template and folder and os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
            template = f.read()
    if not isinstance(template, str) or not template:
        raise RecipeError(f"{key} has format = \"chat\" but the tokenizer ('{tokenizer_path or 'trained here'}') has no "
                          f"chat_template in tokenizer_config.json; set data.tokenizer_path to a Hugging Face folder "
                          f"whose tokenizer_config.json has one.")
    variables = {}
    for name in _SPECIAL_TOKEN_KEYS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            variables[name] = value
    return template, variables


def _generation_extension():
    """The `{% generation %}` tag: records the character span of each block it wraps while a render is tracked
    (built on first use: jinja2 is imported only by runs with chat sources)."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(track_generation=self.track)
            self._blocks = None
            self._spans = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            if self._blocks is not None:
                start = len("".join(self._blocks))
                self._spans.append((start, start + len(text)))
            return text

        @contextmanager
        def track(self, blocks, spans):
            self._blocks, self._spans = blocks, spans
            try:
                yield
            finally:
                self._blocks, self._spans = None, None

    return GenerationTag


def compile_template(source: str):
    """The template compiled in the Jinja environment transformers renders chat templates with."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def check_messages(messages, field: str, where: str) -> list[dict]:
    """The conversation's messages, or a one-line error for what a chat source cannot train on."""
    if not isinstance(messages, list):
        raise RecipeError(f"{where}: \"{field}\" must be a list of {{\"role\", \"content\"}} messages, got "
                          f"{type(messages).__name__}; set the source's messages_field to the list of turns.")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise RecipeError(f"{where}: message {i} of \"{field}\" must be an object with a string \"content\".")
        if message.get("role") not in ROLES:
            raise RecipeError(f"{where}: message {i} has unknown role {message.get('role')!r}; use one of "
                              f"{', '.join(ROLES)}.")
    if not any(m["role"] == "assistant" for m in messages):
        raise RecipeError(f"{where}: the conversation has no assistant turn, so nothing in it would be trained on; "
                          f"remove it or add the assistant's reply.")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


class ChatRenderer:
    """Renders conversations with one tokenizer folder's chat template into (ids, per-token mask bits)."""

    def __init__(self, template_source: str, variables: dict, encode_with_offsets):
        """`encode_with_offsets(text) -> tokenizers.Encoding` encodes without adding special tokens."""
        self.template = compile_template(template_source)
        self.marks_generation = bool(_GENERATION_TAG.search(template_source))
        self.variables = dict(variables)
        self._encode = encode_with_offsets

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                    documents=None, **self.variables)

    def render_tracked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text and the character spans of its `{% generation %}` blocks."""
        blocks, spans = [], []
        with self.template.environment.track_generation(blocks, spans):
            for block in self.template.generate(messages=messages, add_generation_prompt=False, tools=None,
                                                documents=None, **self.variables):
                blocks.append(block)
        return "".join(blocks), spans

    def assistant_spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]], list[int]]:
        """(text, labelled character spans, character offset of each message's start)."""
        if self.marks_generation:
            text, spans = self.render_tracked(messages)
        else:
            text, spans = self.render(messages), []
        starts = []
        for i, message in enumerate(messages):
            before = self.render(messages[:i]) if i else ""
            starts.append(len(before) if text.startswith(before) else -1)
            if message["role"] != "assistant" or self.marks_generation:
                continue
            prompt, upto = self.render(messages[:i], add_generation_prompt=True), self.render(messages[:i + 1])
            if not (upto.startswith(prompt) and text.startswith(upto)):
                raise RecipeError(f"{where}: the chat template does not render a conversation's prefixes as prefixes "
                                  f"of it, so assistant turns cannot be located; add {{% generation %}} markers "
                                  f"around the assistant turns of the template.")
            spans.append((len(prompt), len(prompt) + len(upto[len(prompt):].rstrip())))
        return text, spans, starts

    def encode(self, messages: list[dict], where: str) -> tuple[list[int], np.ndarray]:
        """(token ids, uint8 mask per token with the LABEL and TURN_START bits)."""
        text, spans, starts = self.assistant_spans(messages, where)
        encoding = self._encode(text)
        ids = list(encoding.ids)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for start, end in spans:  # as transformers' return_assistant_tokens_mask maps spans to tokens
            if end <= start:
                continue
            first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
            if first is None:
                break
            mask[first:last + 1 if last else len(ids)] |= LABEL
        for start in starts:
            token = encoding.char_to_token(start) if 0 <= start < len(text) else None
            if token is not None and (token == 0 or encoding.offsets[token][0] == start):
                mask[token] |= TURN_START
        return ids, mask


def build_renderer(tokenizer, key: str) -> ChatRenderer:
    """The renderer of a Hugging Face tokenizer (`data/hf_tokenizer.py`) whose folder holds a chat template."""
    source = getattr(tokenizer, "source", "")
    if not hasattr(tokenizer, "encode_with_offsets"):
        raise RecipeError(f"{key} has format = \"chat\" but the tokenizer is a SentencePiece model without a chat "
                          f"template; set data.tokenizer_path to a Hugging Face folder with a chat_template.")
    template, variables = load_chat_template(source, key)
    return ChatRenderer(template, variables, tokenizer.encode_with_offsets)
