"""Bad data input through the user's command: each case is one `error:` line naming the key or file, exit 2, and no
process group ever started (torchrun is never reached)."""
from __future__ import annotations

import json

import pytest

from tests.data.test_hf_tokenizer import write_llama3_style_tokenizer
from tests.trainer_runs import run_train

SOURCES = """
[[data.sources]]
name = "a"
path = "{a}"
weight = {wa}
text_field = "{field}"
[[data.sources]]
name = "b"
path = "{b}"
weight = {wb}
"""


def write_recipe(tmp_path, a=None, b=None, wa=1.0, wb=1.0, field="text", extra="") -> str:
    if a is None:
        a = tmp_path / "a.jsonl"
        a.write_text(json.dumps({"text": "first"}) + "\n" + json.dumps({"text": "second"}) + "\n")
    if b is None:
        b = tmp_path / "b.jsonl"
        b.write_text(json.dumps({"text": "other"}) + "\n")
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"[training]\nsteps = 1\nseq_len = 64\n[data]\ncache_dir = \"{tmp_path / 'cache'}\"\n{extra}\n"
                      + SOURCES.format(a=a, b=b, wa=wa, wb=wb, field=field))
    return str(recipe)


def assert_one_line_error(recipe: str, *needles: str, args=()):
    result = run_train(recipe, *args, nproc=2, timeout=300)
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "OMP_NUM_THREADS" not in result.stderr + result.stdout  # torchrun never started
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_a_source_path_that_does_not_exist(tmp_path):
    assert_one_line_error(write_recipe(tmp_path, a=tmp_path / "nope.jsonl"), "data.sources[0].path", "nope.jsonl",
                          "does not exist")


def test_a_parquet_file_without_the_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x", "y"]}), tmp_path / "a.parquet")
    assert_one_line_error(write_recipe(tmp_path, a=tmp_path / "a.parquet"), "a.parquet", "no column 'text'",
                          "text_field")


def test_a_jsonl_line_without_the_field(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"body": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    assert_one_line_error(write_recipe(tmp_path, a=path, field="body"), "a.jsonl", "line 2", "\"body\"")


@pytest.mark.slow
def test_a_store_whose_sources_changed(tmp_path):
    """Slow tier since issue 56 (the fast tier runs in minutes; CI runs both): three launches around a prepared store,
    28 s."""
    from data.corpus import load_documents
    from data.tokenizer import build_tokenizer

    model = tmp_path / "tok.model"  # a fixed tokenizer: a trained one would change with the data (a new store)
    model.write_bytes(build_tokenizer(None, load_documents(["pydoc"]), 2048, str(tmp_path)).model_proto)
    recipe = write_recipe(tmp_path, extra=f"tokenizer_path = \"{model}\"")
    prepared = run_train(recipe, "--prepare-data", timeout=300)
    assert prepared.returncode == 0 and "already prepared" not in prepared.stderr + prepared.stdout
    with open(tmp_path / "b.jsonl", "a") as f:
        f.write(json.dumps({"text": "added later"}) + "\n")
    assert_one_line_error(recipe, "'b'", "changed", "--prepare-data")
    again = run_train(recipe, "--prepare-data", timeout=300)
    assert again.returncode == 0 and "source 'a' is already prepared" in again.stdout, again.stdout + again.stderr


@pytest.mark.parametrize("weights", [(-1.0, 1.0), (0.0, 0.0)], ids=["negative", "all-zero"])
def test_weights_negative_or_all_zero(tmp_path, weights):
    assert_one_line_error(write_recipe(tmp_path, wa=weights[0], wb=weights[1]), "weight")


def test_a_tokenizer_json_without_eos_and_one_larger_than_the_model(tmp_path):
    no_eos = str(tmp_path / "no_eos")
    write_llama3_style_tokenizer(no_eos, vocab_size=300, with_eos=False)
    recipe = write_recipe(tmp_path, extra=f"tokenizer_path = \"{no_eos}\"")
    assert_one_line_error(recipe, "no EOS", "tokenizer.json")
    big = str(tmp_path / "big")
    write_llama3_style_tokenizer(big, vocab_size=1024)
    recipe = write_recipe(tmp_path, extra=f"tokenizer_path = \"{big}\"")
    assert_one_line_error(recipe, "1024", "model.vocab_size", args=("--model.vocab_size", "512"))
