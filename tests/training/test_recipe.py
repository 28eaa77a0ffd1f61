"""Recipes, overrides and their one-line errors."""
import pytest

from config.recipe import load_config, parse_overrides, to_toml
from config import RecipeError


def write(tmp_path, text, name="r.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_debug_recipe_loads_with_typed_overrides():
    cfg = load_config("recipes/debug.toml", ["--training.steps", "7", "--training.dtype=bfloat16",
                                             "--data.document_masking", "true", "--optimizer.lr", "3e-4",
                                             "--data.corpus", "a.txt,b.jsonl"])
    assert cfg.training.steps == 7 and cfg.training.dtype == "bfloat16"
    assert cfg.data.document_masking is True and cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.data.corpus == ["a.txt", "b.jsonl"]


def test_print_config_round_trips(tmp_path):
    cfg = load_config("recipes/debug.toml", ["--training.seq_len", "256"])
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert to_toml(again) == to_toml(cfg)


@pytest.mark.parametrize("text, overrides, expect", [
    ("[traning]\nsteps = 3\n", [], "Did you mean 'training'"),
    ("[training]\nstep = 3\n", [], "Did you mean 'steps'"),
    ("[training]\nsteps = 'many'\n", [], "training.steps: expected an integer"),
    ("[training]\nseq_len = 1\n", [], "training.seq_len must be >= 2"),
    ("[parallelism]\ncp_load_balancer = 'zigzog'\n", [], "Did you mean 'zigzag'"),
    ("[training]\n", ["--training.compile", "maybe"], "is not one of auto, true, false"),
    ("[training]\ncompile = 1\n", [], "training.compile: expected true, false or a word ('auto')"),
    ("[training]\n", ["--training.steps"], "needs a value"),
    ("steps = 3\n", [], "must be a [section] table"),
    ("[training\n", [], "not valid TOML"),
    ("[data]\nplacement = 'work'\n", [], "data.placement = \"work\" moves document segments"),
    ("[data]\nplacement = 'segments'\n", [], "data.placement"),
    ("[training]\nloss_chunk_tokens = -2\n", [], "training.loss_chunk_tokens must be >= 0 (0 = off) or -1"),
])
def test_bad_recipes_give_one_line_errors(tmp_path, text, overrides, expect):
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as err:
        load_config(path, overrides)
    message = str(err.value)
    assert expect in message and "\n" not in message


def test_missing_recipe_names_the_file():
    with pytest.raises(RecipeError, match="'nope.toml' does not exist"):
        load_config("nope.toml")


def test_override_syntax():
    assert parse_overrides(["--a.b", "1", "--c.d=x"]) == [("a", "b", "1"), ("c", "d", "x")]
    with pytest.raises(RecipeError):
        parse_overrides(["steps=3"])


def test_print_config_round_trips_sources_and_ramp_source_weights(tmp_path):
    cfg = load_config(write(tmp_path, '[training]\nsteps = 4\n[[data.sources]]\nname = "a"\npath = "pydoc"\nweight = 2\n'
                                      '[[data.sources]]\nname = "b"\npath = ["pydoc"]\ntext_field = "body"\n'
                                      '[[ramp]]\nstart_step = 0\nseq_len = 128\nsource_weights = {a = 0.5}\n'))
    assert [(s.name, s.path, s.weight, s.text_field) for s in cfg.data.sources] == [
        ("a", ["pydoc"], 2.0, "text"), ("b", ["pydoc"], 1.0, "body")]
    assert cfg.ramp[0].source_weights == {"a": 0.5}
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert to_toml(again) == to_toml(cfg) and again.data.sources == cfg.data.sources


@pytest.mark.parametrize("setting, vocab, tile", [
    (-1, 128256, 2048),     # Llama 3: 2048-token tiles, as the recipes always had
    (-1, 151936, 2048),     # Qwen: never below 2048
    (-1, 32000, 8192),      # 2**28 // 32000 = 8388, in whole 2048s
    (-1, 2048, 131072),     # the bench shape: an 8K or 64K micro-batch in one tile
    (2048, 2048, 2048),     # an explicit tile is kept
    (0, 128256, 0),         # off
])
def test_automatic_loss_tiles(setting, vocab, tile):
    """training.loss_chunk_tokens = -1 tiles by a logits budget (1 GiB of float32 logits per tile), so a small
    vocabulary is not cut into tiles that save no memory worth their kernels (issue 36)."""
    from config.schema import TrainingConfig

    assert TrainingConfig(loss_chunk_tokens=setting).loss_tile_tokens(vocab) == tile
