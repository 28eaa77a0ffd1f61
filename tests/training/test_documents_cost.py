"""The price of packed documents at CP 1 (training/planning/documents_cost.py): rows cut from a document stream as
the packer cuts them, each piece at its own length's rate, times the kernel's measured overhead per call."""
import os

import numpy as np
import pytest

from training.planning.accelerators import ACCELERATORS
from training.planning.documents_cost import (PUBLISHED, PackedCall, _web_like_pieces, call_overhead,
                                              packed_attention_seconds, pieces_seconds, row_pieces)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _packed_rows_by_hand(lengths: list[int], seq_len: int, rows: int) -> list[list[int]]:
    """The reference: walk the documents (repeated) and fill rows token by token."""
    out, row, room, i = [], [], seq_len, 0
    while len(out) < rows:
        left = lengths[i % len(lengths)]
        i += 1
        while left and len(out) < rows:
            take = min(left, room)
            row.append(take)
            left, room = left - take, room - take
            if room == 0:
                out.append(row)
                row, room = [], seq_len
    return out


@pytest.mark.parametrize("lengths,seq_len", [([300, 50, 1000, 7], 256), ([5000], 1024), ([1, 2, 3], 16),
                                             ([1024, 1024], 1024)])
def test_row_pieces_are_the_packers_cuts_averaged_over_rows(lengths, seq_len):
    rows = 8
    expected: dict[int, float] = {}
    for row in _packed_rows_by_hand(lengths, seq_len, rows):
        for piece in row:
            expected[piece] = expected.get(piece, 0) + 1 / rows
    got = row_pieces(np.array(lengths), seq_len, rows)
    assert got.keys() == expected.keys() and all(got[k] == pytest.approx(expected[k]) for k in got), (got, expected)
    assert sum(k * v for k, v in got.items()) == pytest.approx(seq_len)


def test_an_empty_corpus_is_one_row_long_document():
    assert row_pieces(np.array([], dtype=np.int64), 4096) == {4096: 1.0}


def test_each_published_call_is_priced_at_its_measured_time():
    for call in PUBLISHED:
        pieces = dict(_web_like_pieces(call.tokens))
        seconds = packed_attention_seconds(ACCELERATORS[call.accelerator], call.kernel, pieces, call.heads,
                                           call.head_dim, forwards=1.0)
        assert seconds == pytest.approx(call.seconds, rel=1e-9), call


def test_the_overhead_is_interpolated_in_log_tokens_and_flat_beyond_the_measured_totals():
    low, high = call_overhead("flash_varlen", 8192), call_overhead("flash_varlen", 65536)
    assert call_overhead("flash_varlen", 2048) == low and call_overhead("flash_varlen", 1 << 20) == high
    assert call_overhead("flash_varlen", 8192 * 2 ** 1.5) == pytest.approx((low + high) / 2, rel=1e-9)
    assert call_overhead("per_document", 8192) == 1.0  # nothing measured: the per-piece price alone
    own = (PackedCall("cudnn_thd", 4096, 1.0, "h200"),)
    web_like = dict(_web_like_pieces(4096))
    assert call_overhead("cudnn_thd", 4096, own) == pytest.approx(
        1.0 / pieces_seconds(ACCELERATORS["h200"], "cudnn_thd", web_like, 16, 128))


def test_short_documents_cost_less_than_one_long_one_and_thd_less_than_varlen_at_64k():
    """The same 64K tokens: 64 documents of 1K tokens have 1/64 of one causal 64K document's pairs; the packed call
    over them must cost a small fraction of it, though more than 1/64 (short pieces run below the long one's rate)."""
    acc = ACCELERATORS["h200"]
    one = packed_attention_seconds(acc, "cudnn_thd", {65536: 1}, 16, 128, 1.0)
    many = packed_attention_seconds(acc, "cudnn_thd", {1024: 64}, 16, 128, 1.0)
    assert one / 64 < many < one / 16
    varlen = packed_attention_seconds(acc, "flash_varlen", {1024: 64}, 16, 128, 1.0)
    assert varlen > 1.3 * many


def test_packed_documents_at_cp1_are_one_call_per_layer_priced_piece_by_piece():
    """Issue 46: at CP 1 each layer runs one packed call per direction over the micro-batch's rows: priced on the
    row's document pieces at the stage's documents kernel (cuDNN THD where the run takes cuDNN, FA2 varlen on A100),
    not on the visible pairs at one block length; under CP the ring's blocks keep the pair pricing."""
    import dataclasses

    from config.recipe import load_config
    from models.llama import model_config
    from training.planning.accelerators import ACCELERATORS
    from training.planning.documents_cost import packed_attention_seconds
    from training.planning.price import predict_step
    from training.planning.workload import Layout, Workload, stage_documents_kernel

    m, acc = model_config("llama3_8b"), ACCELERATORS["h200"]
    pieces = ((1000, 60.0), (5536, 1.0))
    w = Workload(model=m, layout=Layout(1, 1, 1, 1, 1, 8), seq_len=65536, local_batch_size=2, grad_accum=3,
                 visible_pair_fraction=0.02, attention_length=2000.0, document_pieces=pieces,
                 documents_kernel="cudnn_thd")
    one_row = packed_attention_seconds(acc, "cudnn_thd", dict(pieces), m.n_heads, m.head_dim, 1.0)
    attention = predict_step(w, acc).parts["attention"]
    assert attention <= 2 * 3 * m.n_layers * one_row  # two rows in one call: its overhead read at 128K tokens
    assert attention == pytest.approx(3 * m.n_layers * packed_attention_seconds(
        acc, "cudnn_thd", dict(pieces), m.n_heads, m.head_dim, 1.0, rows=2), rel=1e-9)
    varlen = predict_step(dataclasses.replace(w, documents_kernel="flash_varlen"), acc).parts["attention"]
    assert varlen > 1.3 * attention
    ring = dataclasses.replace(w, layout=Layout(1, 1, 1, 2, 1, 8))
    assert predict_step(ring, acc).parts["attention"] == predict_step(
        dataclasses.replace(ring, document_pieces=None), acc).parts["attention"]

    def kernel(*overrides):
        return stage_documents_kernel(load_config(os.path.join(ROOT, "recipes", "debug.toml"), ["--data.document_masking", "true", *overrides]))
    assert kernel("--hardware.accelerator", "h100-sxm", "--training.dtype", "bfloat16") == "cudnn_thd"
    assert kernel("--hardware.accelerator", "a100-80gb", "--training.dtype", "bfloat16") == "flash_varlen"
    assert kernel("--hardware.accelerator", "h200", "--training.dtype", "bfloat16",
                  "--parallelism.attention_kernel", "flash") == "flash_varlen"
