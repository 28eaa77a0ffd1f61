"""data.packing against a brute-force, pure-Python reconstruction of the stream and of every row's four buffers."""
import numpy as np
import pytest

from data.packing import pack_documents, pack_token_documents
from config import RecipeError

EOS = 2


def _documents(lengths):
    """Document i holds tokens 1000*(i+1) + j, so every token names its document and place."""
    return [[1000 * (i + 1) + j for j in range(n)] for i, n in enumerate(lengths)]


def _recover_order(stream):
    """Which document each stretch of the stream came from, read off the token values themselves."""
    order, expect_new = [], True
    for token in stream:
        if token == EOS:
            expect_new = True
        elif expect_new:
            order.append(token // 1000 - 1)
            expect_new = False
    return order


def _brute_force_row(tokens, seq_len, masking, eos=EOS):
    inputs, labels = tokens[:seq_len], tokens[1:seq_len + 1]
    doc_ids, positions, doc, pos = [], [], 0, 0
    for token in inputs:
        doc_ids.append(doc)
        positions.append(pos if masking else len(positions))
        pos += 1
        if token == eos:  # the EOS belongs to the document it ends; the next token starts a new one
            doc, pos = doc + 1, 0
    return {"input_ids": inputs, "labels": labels, "document_ids": doc_ids, "position_ids": positions}


@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize("seq_len", [2, 7, 16, 33])
def test_rows_match_brute_force(seq_len, masking):
    docs = _documents([5, 0, 12, 1, 30, 3, 9, 17, 2])  # includes an empty document (EOS only)
    packed = pack_token_documents(docs, eos_id=EOS, seq_len=seq_len, seed=11, document_masking=masking)

    stream = packed.stream.tolist()
    order = _recover_order(stream)
    assert sorted(order) == [i for i, d in enumerate(docs) if d]  # every non-empty document exactly once
    expected_stream = []
    for i in _order_with_empty_docs(stream, docs):
        expected_stream += docs[i] + [EOS]
    assert stream == expected_stream
    total = sum(len(d) + 1 for d in docs)
    assert packed.corpus_tokens == len(stream) == total
    assert packed.num_rows == total // (seq_len + 1)  # the tail that does not fill a row is dropped

    for r in range(packed.num_rows):
        row_tokens = stream[r * (seq_len + 1):(r + 1) * (seq_len + 1)]
        expected = _brute_force_row(row_tokens, seq_len, masking)
        got = packed.row_fields(r)
        for name, values in expected.items():
            assert got[name].dtype == np.int64 and got[name].shape == (seq_len,)
            assert got[name].tolist() == values, (name, r)
        assert got["labels"][:-1].tolist() == got["input_ids"][1:].tolist()
        eos_positions = [t for t, tok in enumerate(row_tokens[:seq_len]) if tok == EOS]
        assert np.flatnonzero(got["input_ids"] == EOS).tolist() == eos_positions


def _order_with_empty_docs(stream, docs):
    """The full document order, empty documents included: an EOS right after an EOS (or at the start) is one."""
    empties = iter(i for i, d in enumerate(docs) if not d)
    nonempty = iter(_recover_order(stream))
    order, previous = [], EOS
    for token in stream:
        if token == EOS and previous == EOS:
            order.append(next(empties))
        elif token != EOS and previous == EOS:
            order.append(next(nonempty))
        previous = token
    return order


def test_rows_are_views_of_one_int32_stream():
    packed = pack_token_documents(_documents([40, 50, 60]), eos_id=EOS, seq_len=15, seed=0)
    assert packed.stream.dtype == np.int32
    assert np.shares_memory(packed.rows, packed.stream)
    assert packed.rows.base is not None


def test_seed_shuffles_document_order_deterministically():
    docs = _documents([3] * 30)
    orders = {seed: _recover_order(pack_token_documents(docs, eos_id=EOS, seq_len=8, seed=seed).stream.tolist())
              for seed in (0, 1)}
    assert orders[0] == _recover_order(pack_token_documents(docs, eos_id=EOS, seq_len=8, seed=0).stream.tolist())
    assert orders[0] != orders[1]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(30))


@pytest.mark.parametrize("masking", [False, True])
def test_corpus_shorter_than_a_row_is_repeated(masking):
    docs = _documents([3, 2])  # 7 tokens with EOS, far less than one row
    seq_len = 20
    packed = pack_token_documents(docs, eos_id=EOS, seq_len=seq_len, seed=3, document_masking=masking)
    assert packed.repeated and packed.corpus_tokens == 7 and packed.num_rows >= 1
    once = packed.stream[:7].tolist()
    cycled = [once[k % 7] for k in range(seq_len + 1)]
    expected = _brute_force_row(cycled, seq_len, masking)
    got = packed.row_fields(0)
    for name, values in expected.items():
        assert got[name].tolist() == values, name


def test_pack_documents_uses_tokenizer_and_appends_eos():
    class WordTokenizer:
        eos_id = 0

        def encode(self, text):
            return [len(word) for word in text.split()]

    packed = pack_documents(WordTokenizer(), ["a bb ccc", "dddd"], seq_len=3, seed=0)
    assert packed.stream.tolist() in ([1, 2, 3, 0, 4, 0], [4, 0, 1, 2, 3, 0])
    assert packed.num_rows == 1 and packed.tokens_per_epoch == 3


def test_seq_len_below_two_is_a_recipe_error():
    with pytest.raises(RecipeError, match="training.seq_len"):
        pack_token_documents(_documents([5]), eos_id=EOS, seq_len=1, seed=0)
