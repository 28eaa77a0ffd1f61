"""The RoPE types and the RoPE "unset" are written once (config/rope.py, from its `RopeScaling` alias).

Every place that checks a RoPE type is asked about the same candidates and must accept exactly the schema's scaling
types (plus Hugging Face's "default" where plain RoPE is a type, plus the ramp's "keep"); no module but
config/schema.py and config/rope.py spells the type list or compares a RoPE field against an unset literal."""
import dataclasses
import pathlib
import re

import pytest

from config import RampTable, RecipeError, choices
from config.recipe import parse_ramp
from config.rope import ROPE_SCALING_TYPES, ROPE_TYPES, UNSET, RopeScaling, RopeSettings
from config.schema import ModelConfig
from models.hf_config import from_hf_config
from models.model_config import model_config
from models.rope import rope_frequencies

ROOT = pathlib.Path(__file__).resolve().parents[2]
CANDIDATES = ("", "auto", "default", "llama3", "yarn", "dynamic", "linear", "longrope", "Llama3")
SCALING = set(choices(RopeScaling)) - {"auto"}  # the alias itself, read independently of ROPE_SCALING_TYPES


def _accepts(check) -> set[str]:
    """The candidates `check` does not refuse."""
    accepted = set()
    for kind in CANDIDATES:
        try:
            check(kind)
        except (RecipeError, ValueError, TypeError):
            continue
        accepted.add(kind)
    return accepted


def _hf_config(kind: str) -> dict:
    """A small Llama config.json whose RoPE is of type `kind`."""
    return {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 128, "intermediate_size": 128, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 256, "rope_theta": 10000.0,
            "rope_scaling": {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 64}}


def test_scaling_types_are_the_schema_alias():
    assert SCALING == {"llama3", "yarn"}  # Hugging Face's names of the two scalings computed in models/rope.py
    assert set(ROPE_SCALING_TYPES) == SCALING and set(ROPE_TYPES) == SCALING | {"default"}


def test_every_type_check_accepts_exactly_the_schema_types():
    stage = {"start_step": 0, "seq_len": 64}
    assert _accepts(lambda t: parse_ramp([{**stage, "rope_type": t}], "r.toml")) == SCALING | {""}
    assert _accepts(lambda t: model_config("debug", rope_type=t)) == SCALING
    assert _accepts(lambda t: from_hf_config(_hf_config(t))) == SCALING | {"default"}
    assert _accepts(lambda t: rope_frequencies(8, 10000.0, 4.0, original_max_position=64, rope_type=t)) \
        == SCALING | {"default", ""}  # "" = derived from the factor, as None


def test_recipe_defaults_are_the_one_unset():
    """[model] and [[ramp]] written with nothing (or with their TOML unset spellings) set no RoPE field."""
    assert RopeSettings.from_recipe(ModelConfig()) == RopeSettings() == RopeSettings(UNSET, UNSET, UNSET, UNSET)
    assert RopeSettings.from_recipe(RampTable()) == RopeSettings()
    assert RopeSettings.from_recipe(ModelConfig()).model_overrides() == {}
    switched_off = RopeSettings.from_recipe(RampTable(rope_scaling_factor=-1))
    assert switched_off.model_overrides() == {"rope_scaling_factor": None}
    section = ModelConfig(rope_theta=5e5, rope_scaling_factor=4.0, rope_type="yarn", rope_original_max_position=64)
    assert section.overrides() == {"rope_theta": 5e5, "rope_scaling_factor": 4.0, "rope_type": "yarn",
                                   "rope_original_max_position": 64}
    with pytest.raises(dataclasses.FrozenInstanceError):
        RopeSettings().theta = 1.0  # frozen: a stage's settings are a value


# a RoPE type list, or a rope field compared with a literal unset spelling, outside config/rope.py and config/schema.py
_SPELLED = re.compile(r"""["']llama3["'],\s*["']yarn["']|rope_\w+\s*(!=|==)\s*("auto"|""|0\b)""")


def test_no_module_spells_the_rope_types_or_unset_again():
    allowed = {ROOT / "config" / "rope.py", ROOT / "config" / "schema.py"}
    found = [f"{path.relative_to(ROOT)}:{n}" for package in ("config", "data", "models", "parallelisms", "training")
             for path in sorted((ROOT / package).rglob("*.py")) if path not in allowed
             for n, line in enumerate(path.read_text().splitlines(), 1) if _SPELLED.search(line)]
    assert found == []
