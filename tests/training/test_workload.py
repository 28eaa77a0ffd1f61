"""training/planning/workload.py: the documents a step is priced on (issue 50: the recipe's own prepared stores
through open_store, its built-in pydoc corpus, else the stated mix), each against a closed form."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mix_closed_form(seq: int) -> float:
    """Visible pairs / S^2 of the stated mix: half the tokens in rows of one document (S (S + 1) / 2 pairs a row),
    half in documents of min(4,096, S) tokens."""
    doc = min(4096, seq)
    return 0.5 * (seq + 1) / (2 * seq) + 0.5 * (doc + 1) / (2 * seq)


def test_document_mix_pairs_are_the_closed_form():
    from training.planning.documents_cost import row_pieces
    from training.planning.workload import mix_lengths, pieces_pairs

    for seq in (2048, 8192, 65536):
        pieces = tuple(row_pieces(mix_lengths(seq), seq).items())
        fraction, length = pieces_pairs(pieces, seq)
        assert fraction == pytest.approx(_mix_closed_form(seq), rel=1e-12), seq
        assert min(4096, seq) <= length <= seq


def _pairs_closed_form(lengths_by_source: dict, weights: dict, seq: int, rows: int = 64) -> tuple[float, float]:
    """Visible pairs / S^2 and the pair-weighted piece length, document by document as the packer fills `rows` rows
    of S tokens (the documents in order, repeated; one crossing a row's end is cut there), per row."""
    fraction = weighted = 0.0
    total = sum(weights.values())
    for name, lengths in lengths_by_source.items():
        filled, at = 0, 0
        while filled < rows * seq:
            left = lengths[at % len(lengths)]
            at += 1
            while left and filled < rows * seq:
                piece = min(left, seq - filled % seq)
                fraction += weights[name] / total / rows / seq ** 2 * piece * (piece + 1) / 2
                weighted += weights[name] / total / rows / seq ** 2 * piece * (piece + 1) / 2 * piece
                filled, left = filled + piece, left - piece
    return fraction, weighted / fraction


def test_visible_pairs_from_prepared_stores_read_only_the_recipes_own_stores(tmp_path):
    """Issue 50, bug 2: two sources at weights 1:3, prepared with the recipe's tokenizer; beside them under the same
    cache, a store of a source whose name starts with 'web' and a stale 'web' store of another tokenizer. The pairs
    are those of the recipe's own documents (their token counts: the tokenizer's encoding), nothing pooled from the
    others; a source with no store of its own means the stated mix."""
    import numpy as np

    from config.recipe import load_config
    from data.prepare import prepare_store
    from data.sources import build_run_tokenizer, store_specs
    from data.tokenizer import build_tokenizer
    from training.planning.workload import document_row_pieces, pieces_pairs

    words = "river mill stone wall bird hill quiet long day walk back again the a of to and in".split()
    rng = np.random.default_rng(0)
    docs = {"books": [" ".join(rng.choice(words, 3000))], "web": [" ".join(rng.choice(words, rng.integers(20, 90)))
                                                                  for _ in range(40)]}
    for name, texts in docs.items():
        (tmp_path / name).mkdir()
        for i, text in enumerate(texts):
            (tmp_path / name / f"{i:03d}.txt").write_text(text)
    spm = build_tokenizer(None, [t for texts in docs.values() for t in texts], 320, str(tmp_path / "spm"))
    (tmp_path / "tok.model").write_bytes(spm.model_proto)
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[model]\nname = "debug"\n[data]\ncache_dir = "{tmp_path / "cache"}"\n'
                      f'tokenizer_path = "{tmp_path / "tok.model"}"\ndocument_masking = true\n'
                      f'[[data.sources]]\nname = "books"\npath = ["{tmp_path / "books"}"]\nweight = 1.0\n'
                      f'[[data.sources]]\nname = "web"\npath = ["{tmp_path / "web"}"]\nweight = 3.0\n')
    cfg = load_config(str(recipe))
    tokenizer = build_run_tokenizer(cfg, 2048)
    for spec in store_specs(cfg):
        prepare_store(spec, tokenizer, workers=1, progress=False, log=lambda *_: None)
    for other in ("web-extra-0123456789abcdef", "web-ffffffffffffffff"):  # another source, another tokenizer
        folder = tmp_path / "cache" / "stores" / other
        folder.mkdir()
        np.full(500, 7, dtype=np.uint32).tofile(folder / "shard-00000.lengths")
    seq = 128
    lengths = {name: [len(ids) for ids in tokenizer.encode_batch(texts)] for name, texts in docs.items()}
    assert lengths["books"][0] > 2 * seq  # one document over several rows
    expected = _pairs_closed_form(lengths, {"books": 1.0, "web": 3.0}, seq)
    assert pieces_pairs(document_row_pieces(cfg, seq), seq) == pytest.approx(expected, rel=1e-12)
    cfg.data.sources[1].name = "unprepared"
    assert pieces_pairs(document_row_pieces(cfg, seq), seq)[0] == pytest.approx(_mix_closed_form(seq), rel=1e-12)


def test_a_recipe_on_the_builtin_pydoc_corpus_is_priced_on_its_own_documents(tmp_path):
    """Issue 46 item 4 / issue 50: without prepared stores, a recipe whose only source is Python's pydoc corpus has
    its visible pairs counted on those documents, tokenized with the recipe's tokenizer, not on the stated mix."""
    from config.recipe import load_config
    from data.corpus import pydoc_documents
    from data.sources import build_run_tokenizer
    from models.llama import recipe_model_config
    from training.planning.workload import document_row_pieces, pieces_pairs

    cfg = load_config(os.path.join(ROOT, "recipes", "debug.toml"),
                      ["--data.document_masking", "true", "--data.cache_dir", str(tmp_path)])
    tokenizer = build_run_tokenizer(cfg, recipe_model_config(cfg).vocab_size)
    lengths = [len(ids) for ids in tokenizer.encode_batch(pydoc_documents())]
    seq = 4096
    expected = _pairs_closed_form({"corpus": lengths}, {"corpus": 1.0}, seq)
    got = pieces_pairs(document_row_pieces(cfg, seq), seq)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[0] < _mix_closed_form(seq)  # pydoc's ~1.9K-token documents
