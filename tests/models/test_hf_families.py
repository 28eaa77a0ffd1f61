"""Llama 3.2 (tied), Qwen2.5 (q/k/v biases) and Qwen3 (per-head q/k norms, head_dim != dim / heads) against
transformers itself: tiny random folders built in the test (every weight random, norms and biases included, so a
mapping mistake cannot hide behind ones and zeros), logits in fp32 both ways, and YaRN tables against transformers'."""
from __future__ import annotations

import json
import os

import pytest
import torch

from models.hf import load_hf, save_hf
from models.hf_config import from_hf_config
from models.rope import RotaryEmbedding
from config import RecipeError
from tests.hf_folders import KINDS, hf_config, random_hf_model

transformers = pytest.importorskip("transformers")

def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


TOKENS = torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", KINDS)
def test_family_logits_match_transformers_both_ways(tmp_path, name):
    reference = random_hf_model(name)
    reference.save_pretrained(tmp_path / "in")
    model = load_hf(str(tmp_path / "in"))
    cfg = model.config
    assert cfg.family == reference.config.model_type
    tied = reference.config.tie_word_embeddings
    assert cfg.tie_embeddings == tied and (model.output.weight is model.tok_embeddings.weight) == tied
    with torch.no_grad():
        want = reference(TOKENS).logits
        got = model(TOKENS)
    assert rel_error(got, want) <= 1e-5, rel_error(got, want)

    save_hf(model, str(tmp_path / "out"), dtype=torch.float32)  # our export, read by transformers and by us
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(exported) is type(reference) and exported.config.tie_word_embeddings == tied
    reloaded = load_hf(str(tmp_path / "out"))
    with torch.no_grad():
        assert rel_error(exported(TOKENS).logits, want) <= 1e-5
        assert rel_error(reloaded(TOKENS), want) <= 1e-5
    from safetensors import safe_open

    with safe_open(os.path.join(tmp_path / "out", "model-00001-of-00001.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not tied)


@pytest.mark.parametrize("factor", [2.0, 4.0])
@pytest.mark.parametrize("extra", [{}, {"beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
                                   {"attention_factor": 1.25}, {"original_max_position_embeddings": None}])
def test_yarn_tables_equal_transformers(factor, extra):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor, "original_max_position_embeddings": 64,
            **extra}
    if extra.get("original_max_position_embeddings") is None:  # absent: transformers uses max_position_embeddings
        rope.pop("original_max_position_embeddings")
    hf = transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                  max_position_embeddings=int(64 * factor),
                                  rope_parameters=rope)
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = from_hf_config(hf.to_dict())
    kw = cfg.rope_kwargs
    ours = RotaryEmbedding(cfg.head_dim, kw.pop("theta"), kw.pop("scaling_factor"), **kw)
    assert torch.allclose(ours.inv_freq, want_freq.float(), rtol=1e-6, atol=0)
    assert abs(ours.attention_scaling - want_scale) <= 1e-6


def test_unsupported_folders_are_one_line_errors(tmp_path):
    base = hf_config("qwen2_5_bias").to_dict()
    cases = {
        "sliding": ({"use_sliding_window": True, "sliding_window": 16}, "sliding-window attention"),
        "moe": ({"model_type": "qwen3", "num_experts": 8}, "mixture of experts"),
        "model_type": ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        "rope": ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type 'longrope'"),
        "act": ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    }
    for label, (change, message) in cases.items():
        with pytest.raises(RecipeError, match=message) as err:
            from_hf_config({**base, **change}, where="x/config.json")
        assert "\n" not in str(err.value) and str(err.value).startswith("x/config.json"), label


@pytest.mark.parametrize("name, billions", [("llama3_2_1b", 1.24), ("llama3_2_3b", 3.21), ("qwen2_5_7b", 7.62),
                                            ("qwen3_8b", 8.19)])
def test_named_shapes_have_their_published_sizes(name, billions):
    """Parameter counts of the published models (their model cards), tied embeddings counted once; the dry run's
    closed-form count agrees with the model built on the meta device."""
    from models.llama import Llama, count_parameters, model_config
    from training.planning.workload import parameter_count

    cfg = model_config(name)
    with torch.device("meta"):
        built = count_parameters(Llama(cfg))
    assert round(built / 1e9, 2) == billions and parameter_count(cfg) == built
