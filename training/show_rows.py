"""`./run_train.sh RECIPE --show-rows N [--json]`: the first N training rows of the first stage, as the model gets them.

Rows are the global rows 0..N-1 of the first stage's row stream (the rows the data-parallel ranks split among
themselves at step 0), built by the trainer's own data code, with no process group and no GPU. As text, each row lists
its documents in order, decoded, with the tokens the model learns to predict between ⟦ and ⟧ (every token of a text
source; the assistant turns of a chat source), and a chat row's padding as a line of its own. As JSON, one object per
row: source, input_ids, labels (-100 = no loss), position_ids, document_ids, padding (how many of the row's last
input tokens are padding: no labels, a document of their own; 0 for text rows).
"""
from __future__ import annotations

import json

import numpy as np

from config.schema import Config
from data.loader import GlobalRowStream, build_dataloader
from data.labels import IGNORE_INDEX
from data.sources import build_run_tokenizer, check_sources, open_stores, source_list, stage_rows
from training.ramp import resolve_stages

OPEN, CLOSE = "⟦", "⟧"


def first_rows(cfg: Config, count: int, vocab_size: int, world_size: int, log=print):
    """(tokenizer, [(source name, row fields, padding tokens)]) of global rows 0..count-1 of the first stage."""
    stage_cfg = resolve_stages(cfg, world_size)[0].cfg
    check_sources(stage_cfg)
    tokenizer = build_run_tokenizer(stage_cfg, vocab_size)
    t, dataset = stage_cfg.training, stage_cfg.data.dataset
    if dataset == "text":
        rows = stage_rows(stage_cfg, open_stores(stage_cfg, tokenizer, log=log))
        names = [s.name for s in source_list(stage_cfg)]
    else:  # synthetic rows (passkey, niah): the loader's own
        rows = build_dataloader(tokenizer, None, seq_len=t.seq_len, local_batch_size=1, dp_rank=0, dp_size=1,
                                seed=stage_cfg.job.seed, dataset=dataset).packed
        names = [dataset]
    stream = GlobalRowStream(rows, stage_cfg.job.seed)
    out = []
    for g in range(count):
        if hasattr(rows, "locate"):  # a mixture: the source and its packed row
            source, row = rows.locate(g)
            part = rows.sources[source]
        else:
            source, part, row = 0, rows, stream.row_of(g)
        padding = part.padding_of(row) if hasattr(part, "padding_of") else 0
        out.append((names[source], {k: v.numpy() for k, v in stream[g].items()}, padding))
    return tokenizer, out


def row_text(tokenizer, fields: dict, padding: int = 0) -> list[str]:
    """One line per document of the row: its decoded input tokens, those the model learns to predict marked; the
    row's last `padding` input tokens (a chat row's padding) as one line of their own."""
    if padding:
        seq_len = len(fields["input_ids"])
        kept = {k: v[:seq_len - padding] for k, v in fields.items()}
        positions = fields["position_ids"][seq_len - padding:]
        return row_text(tokenizer, kept) + [
            f"  padding ({padding} tokens, positions {int(positions[0])}..{int(positions[-1])}, no labels, a document "
            f"of its own)"]
    ids, labels, documents = fields["input_ids"], fields["labels"], fields["document_ids"]
    positions = fields["position_ids"]
    if labels[-1] != IGNORE_INDEX:  # the row's last target is no input: shown at the end of the last document
        ids, documents = np.append(ids, labels[-1]), np.append(documents, documents[-1])
        positions = np.append(positions, positions[-1] + 1)
    predicted = np.concatenate(([False], labels != IGNORE_INDEX))[:len(ids)]  # token t is the target of t - 1
    lines = []
    for doc in np.unique(documents):
        where = np.flatnonzero(documents == doc)
        pieces, start = [], where[0]
        for t in list(where[1:]) + [where[-1] + 1]:
            if t > where[-1] or predicted[t] != predicted[start]:
                text = tokenizer.decode(ids[start:t])
                pieces.append(f"{OPEN}{text}{CLOSE}" if predicted[start] else text)
                start = t
        lines.append(f"  document {int(doc)} ({len(where)} tokens, positions {int(positions[where[0]])}"
                     f"..{int(positions[where[-1]])}): {''.join(pieces)!r}")
    return lines


def show_rows(cfg: Config, count: int, as_json: bool, vocab_size: int, world_size: int, out=print, log=print) -> None:
    tokenizer, rows = first_rows(cfg, count, vocab_size, world_size, log=log)
    for index, (source, fields, padding) in enumerate(rows):
        if as_json:
            out(json.dumps({"row": index, "source": source, **{k: v.tolist() for k, v in fields.items()},
                            "padding": padding}))
            continue
        labelled = int((fields["labels"] != IGNORE_INDEX).sum())
        out(f"row {index} (source '{source}', {len(fields['input_ids'])} tokens, {labelled} with labels, {padding} "
            f"padding; {OPEN}...{CLOSE} = tokens the loss predicts):")
        for line in row_text(tokenizer, fields, padding):
            out(line)
