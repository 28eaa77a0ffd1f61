"""One RoPE rule in one place: every shipped recipe's ramp (hand-written or planned) gives each stage at least the
base training/planning/rope_rule.py gives it, and never lowers a pretrained base or the base along the ramp (recipes may only be stricter)."""
import glob
import os

import pytest

from config.recipe import load_config
from models.model_config import model_config
from training.planning.rope_rule import stage_rope_theta

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAMPED = sorted(p for p in glob.glob(os.path.join(ROOT, "recipes", "**", "*.toml"), recursive=True)
                if "[[ramp]]" in open(p).read())


def test_some_recipes_have_ramps():
    assert any("llama3_8b_1m" in p for p in RAMPED), RAMPED


@pytest.mark.parametrize("path", RAMPED, ids=lambda p: os.path.relpath(p, ROOT))
def test_recipe_bases_follow_the_rule(path):
    cfg = load_config(path)
    theta = cfg.model.rope_theta or model_config(cfg.model.name).rope_theta if cfg.model.name != "hf" else None
    if theta is None:
        pytest.skip("an hf-shaped model: its pretrained base is in the folder, not the recipe")
    if not cfg.checkpoint.hf_load_path and cfg.ramp and cfg.ramp[0].rope_theta:
        theta = cfg.ramp[0].rope_theta  # trained from scratch: no pretrained base to keep, the first stage sets it
    for i, stage in enumerate(cfg.ramp):
        wanted = stage_rope_theta(stage.seq_len, theta)
        theta = stage.rope_theta or theta
        assert theta >= wanted, (f"{os.path.relpath(path, ROOT)} stage {i} ({stage.seq_len} tokens): rope_theta "
                                 f"{theta:g} < {wanted:g}, the base training/planning/rope_rule.py gives")
