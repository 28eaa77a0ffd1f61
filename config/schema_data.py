"""The recipe schema's data-side sections: `[data]` with its `[[data.sources]]` tables, and `[eval]` (they are re-exported
by config/schema.py, where the other sections and the allowed values live)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Dataset = Literal["text", "passkey", "niah"]
Placement = Literal["auto", "work", "loader"]
SourceFormat = Literal["text", "chat"]
ChatTruncation = Literal["drop", "turns"]


@dataclass
class SourceConfig:
    """One `[[data.sources]]` table: a named source of documents and how much of the mixture it is."""
    name: str = ""
    """Name in metrics (source_tokens) and in ramp stages' source_weights."""
    path: list[str] = field(default_factory=list)
    """Files, folders or glob patterns (.txt, .jsonl, .jsonl.gz, .parquet), or "pydoc"; a string is one entry."""
    weight: float = 1.0
    """This source's share of the tokens seen (weights are normalised over the sources)."""
    text_field: str = "text"
    """The JSON field (.jsonl) or column (.parquet) that holds the text."""
    min_doc_tokens: int = 0
    """Drop documents shorter than this many tokens."""
    long_doc_tokens: int = 0
    """Documents of at least this many tokens are upsampled by long_doc_upsample (0 = no upsampling)."""
    long_doc_upsample: float = 1.0
    """How many times as often long documents are seen, within the source (Fu et al. 2024)."""
    format: SourceFormat = "text"
    """text: documents in text_field | chat: conversations in messages_field, rendered with the tokenizer's
    chat_template, labels on the assistant turns only (data/chat.py)."""
    messages_field: str = "messages"
    """chat: the JSON field (.jsonl) or column (.parquet) holding the list of {role, content} messages."""
    truncate: ChatTruncation = "drop"
    """chat: a conversation longer than seq_len is dropped (and counted) | cut after its last whole turn that fits."""
    pack_window: int = 10_000
    """chat: rows hold whole conversations, packed by best-fit decreasing over windows of this many conversations
    (a larger window fills rows better and takes longer at start-up; docs/chat_packing.md)."""


@dataclass
class DataConfig:
    corpus: list[str] = field(default_factory=lambda: ["pydoc"])
    """Documents when no [[data.sources]] are given: "pydoc" (English docs shipped with every Python), local files
    (.txt, .jsonl, .jsonl.gz, .parquet), folders or glob patterns; one source named "corpus"."""
    sources: list[SourceConfig] = field(default_factory=list)
    """[[data.sources]] tables: a weighted mixture of named sources (replaces corpus)."""
    tokenizer_path: str = ""
    """A SentencePiece .model, a Hugging Face tokenizer.json, or a folder holding one (e.g. the checkpoint's
    hf_load_path); empty = train a SentencePiece model on the sources (cached in cache_dir)."""
    cache_dir: str = ".cache"
    """Where trained tokenizers and the tokenized stores (cache_dir/stores/) live; shared by all ranks of a node."""
    prepare_workers: int = 0
    """Worker processes that tokenize sources into the store (0 = every core)."""
    document_masking: bool = False
    """Attention stays inside each packed document and positions restart per document."""
    num_workers: int = 0
    """Data-loader worker processes per rank; the trainer uses at least 1 (each step is placed and its CP plan made
    there, one step ahead: training/batch_plans.py)."""
    dataset: Dataset = "text"
    """text: packed documents of `corpus`; passkey: synthetic passkey retrieval rows with `corpus` as filler text;
    niah: synthetic needle-in-a-haystack rows (data/niah.py) at random depths, what the NIAH evaluation asks."""
    placement: Placement = "auto"
    """How an optimizer step's rows reach the data-parallel ranks. work: every rank reads the whole step and its
    document segments are re-packed across ranks and micro-steps by attention work (data/placement.py; needs
    document_masking and text); loader: the loader's order; auto: work with document masking on text, else loader."""

    def places_by_work(self) -> bool:
        """Whether the step's rows are re-packed by attention work."""
        return self.placement == "work" or (self.placement == "auto" and self.document_masking
                                              and self.dataset == "text")


@dataclass
class EvalConfig:
    passkey: bool = False
    """After training, evaluate passkey retrieval and print accuracy by key depth x context length."""
    passkey_lengths: list[int] = field(default_factory=list)
    """Context lengths to evaluate (empty = the last stage's seq_len); each must split over the CP ranks."""
    passkey_depths: int = 5
    """Number of evenly spaced key depths from 0 (start of the context) to 1 (just before the question)."""
    passkey_samples: int = 20
    """Rows per (length, depth) cell."""
    passkey_interval: int = 0
    """Also evaluate every this many steps of the last ramp stage (the context the run trains for; 0 = only at the
    end)."""
    passkey_stop_at: float = 0.0
    """With passkey_interval: end the run (its checkpoint saved, as at the last step) at the first of those
    evaluations where every (length, depth) cell reaches this accuracy; 0 = no floor per cell."""
    passkey_stop_mean: float = 0.0
    """With passkey_interval: the mean over the cells that ends the run, together with passkey_stop_at's floor per
    cell (both must hold; 0 = no condition on the mean). Both 0 = train to training.steps."""
    long_doc_loss: bool = False
    """Loss by position bucket (0-1K, 1K-4K, ... up to seq_len) on held-out documents of the data stores, on the
    training mesh: whether longer context is being used (metrics.jsonl and TensorBoard: long_doc_loss)."""
    long_doc_heldout: float = 0.01
    """With long_doc_loss: the fraction of each source's documents held out of training for it."""
    long_doc_interval: int = 0
    """With long_doc_loss: evaluate every this many steps as well as at the end (0 = only at the end)."""
    long_doc_rows: int = 8
    """With long_doc_loss: held-out rows evaluated (longest documents first), split over the data-parallel ranks."""
    niah: bool = False
    """Needle in a haystack (data/niah.py) by depth x context length on the training mesh: niah_eval.json, a PNG
    heatmap and a TensorBoard image, every niah_interval steps and at the end. Haystacks come from held-out documents
    (long_doc_heldout of each text source; the passkey filler when the run has no stores)."""
    niah_lengths: list[int] = field(default_factory=list)
    """Context lengths; each evaluation takes those up to its stage's seq_len (empty or none: the stage's seq_len).
    Each must split over the CP ranks."""
    niah_depths: int = 5
    """Number of evenly spaced needle depths from 0 (start of the context) to 1 (just before the question)."""
    niah_samples: int = 10
    """Rows per (length, depth) cell."""
    niah_interval: int = 0
    """Evaluate every this many steps as well as at the end (0 = only at the end)."""
    niah_keys: int = 1
    """Needles for different words (RULER multi-key): the others are distractors."""
    niah_values: int = 1
    """Needles for the asked word (RULER multi-value): the answer is every value, in order."""
