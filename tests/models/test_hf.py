"""models.hf against transformers itself: a random LlamaForCausalLM built in code (nothing downloaded) is the
reference for logits in both directions; the Q/K row permutation is checked against its closed form.

The weights are drawn so attention is sharp (query / key projections N(0, 0.3), norms 1 + N(0, 0.2)): with
transformers' own init (N(0, 0.02)) attention is near uniform and positions barely matter, so a doubled RoPE base
moved the logits by 1.4e-4 only. Here the bound is 1e-5 and a doubled base moves them by far more (see
test_a_doubled_rope_base_is_caught)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from models.hf import (hf_name, interleaved_to_rotate_half, load_hf, load_hf_weights, rotate_half_to_interleaved,
                       save_hf)
from models.llama import Llama, LlamaConfig
from tests.distributed import run_ranks
from config import RecipeError

transformers = pytest.importorskip("transformers")

ROPE_31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_model(tie: bool = False, seed: int = 0, **overrides):
    """A random HF Llama: GQA (8 query / 2 key-value heads), Llama 3.1 RoPE scaling, untied output by default."""
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, rms_norm_eps=1e-5, rope_parameters=dict(ROPE_31), max_position_embeddings=256,
                  tie_word_embeddings=tie)
    kwargs.update(overrides)
    return sharpen(transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval())


PARITY_BOUND = 1e-5  # float32 on both sides; measured ~1e-7 (printed by the tests)


@torch.no_grad()
def sharpen(model, query_key_std: float = 0.3):
    """Every weight random and far from the init: query / key projections wide enough that attention is peaked
    (so RoPE's angles decide the output), other matrices N(0, 0.08), norms 1 + N(0, 0.2)."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.2 * torch.randn_like(p))
        elif any(key in name for key in ("q_proj", "k_proj", ".wq.", ".wk.")):
            p.copy_(query_key_std * torch.randn_like(p))
        else:
            p.copy_(0.08 * torch.randn_like(p))
    return model


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_qk_permutation_matches_its_closed_form():
    n_heads, head_dim = 3, 8
    rows = torch.arange(n_heads * head_dim, dtype=torch.float32).unsqueeze(1)
    ours = rotate_half_to_interleaved(rows, n_heads).squeeze(1).tolist()
    for h in range(n_heads):
        for j in range(head_dim // 2):  # HF pairs (j, j + hd/2) become our (2j, 2j + 1)
            assert ours[h * head_dim + 2 * j] == h * head_dim + j
            assert ours[h * head_dim + 2 * j + 1] == h * head_dim + head_dim // 2 + j
    assert torch.equal(interleaved_to_rotate_half(rotate_half_to_interleaved(rows, n_heads), n_heads), rows)


def _as_transformers_4(path):
    """Rewrite config.json the way transformers 4.4x wrote it: rope_theta + rope_scaling, torch_dtype."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("layout", ["single", "sharded", "transformers4", "tied"])
def test_load_hf_gives_transformers_logits(tmp_path, layout):
    reference = hf_model(tie=layout == "tied")
    reference.save_pretrained(tmp_path, max_shard_size="40KB" if layout == "sharded" else "5GB")
    names = os.listdir(tmp_path)
    if layout == "sharded":
        assert "model.safetensors.index.json" in names and sum(n.endswith(".safetensors") for n in names) > 2
    if layout == "transformers4":
        _as_transformers_4(tmp_path)
    model = load_hf(str(tmp_path))
    cfg = model.config
    assert (cfg.n_heads, cfg.num_kv_heads, cfg.rope_scaling_factor, cfg.rope_original_max_position) == (8, 2, 8.0, 64)
    tokens = torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(tokens).logits
        got = model(tokens)
    print(f"{layout}: relative error {rel_error(got, want):.1e}")
    assert rel_error(got, want) <= PARITY_BOUND, rel_error(got, want)


def test_a_doubled_rope_base_is_caught(tmp_path):
    """The parity bound must be able to fail: the same folder with its RoPE base doubled in our model only."""
    reference = hf_model()
    reference.save_pretrained(tmp_path)
    model = load_hf(str(tmp_path))
    rope = model.config.rope_kwargs
    model.rope.reset(2 * rope.pop("theta"), rope.pop("scaling_factor"), **rope)
    tokens = torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        error = rel_error(model(tokens), reference(tokens).logits)
    print(f"doubled RoPE base: relative error {error:.1e}")
    assert error > 100 * PARITY_BOUND


def _trained_llama() -> Llama:
    """Our model after a few AdamW steps, so the weights are no longer the init's."""
    model = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=128, multiple_of=32,
                              rope_scaling_factor=8.0, rope_original_max_position=64))
    model.init_weights(3)
    sharpen(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        tokens = torch.randint(0, 128, (2, 33), generator=generator)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_hf_loads_in_transformers_with_the_same_logits(tmp_path, dtype):
    model = _trained_llama()
    save_hf(model, str(tmp_path), dtype=dtype)
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert loaded.config.tie_word_embeddings is False and loaded.config.num_key_value_heads == 2
    if dtype == torch.bfloat16:  # compare against our model at the exported (rounded) weights
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    tokens = torch.randint(0, 128, (2, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = loaded(tokens).logits
        want = model(tokens)
    print(f"{dtype}: relative error {rel_error(got, want):.1e}")
    assert rel_error(got, want) <= PARITY_BOUND, rel_error(got, want)
    from safetensors import safe_open

    with safe_open(os.path.join(tmp_path, "model-00001-of-00001.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == dtype


def test_mismatched_or_unsupported_folders_are_refused(tmp_path):
    hf_model().save_pretrained(tmp_path)
    model = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128, multiple_of=32))
    with pytest.raises(RecipeError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[16, 64\] but "
                                          r"parameter layers.0.attention.wk.weight has \[32, 64\]"):
        load_hf_weights([model], str(tmp_path))
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    cfg["rope_parameters"]["rope_type"] = "dynamic"
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(RecipeError, match="rope_type 'dynamic' is not supported"):
        load_hf(str(tmp_path))
    with pytest.raises(RecipeError, match="config.json' does not exist"):
        load_hf(str(tmp_path / "nowhere"))
    assert hf_name("layers.3.feed_forward.w3.weight") == "model.layers.3.mlp.up_proj.weight"


def _sharded_roundtrip_body(rank, world, hf_path, out_path):
    """FSDP-sharded model: load HF weights into the shards, then export them again from the shards."""
    from torch.distributed.device_mesh import init_device_mesh

    from models.hf import from_hf_config, read_hf_config
    from parallelisms.data_parallel import apply_fsdp

    with torch.device("meta"):
        model = Llama(from_hf_config(read_hf_config(hf_path)))
    apply_fsdp(model, init_device_mesh("cpu", (world,)), torch.float32, True)
    model.to_empty(device="cpu")
    model.init_weights(0)  # overwritten by the load below
    load_hf_weights([model], hf_path)
    save_hf(model, out_path, dtype=torch.float32)
    tokens = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(tokens).tolist()  # plain lists: tensors through the result queue can deadlock


def test_sharded_model_loads_and_exports_hf(tmp_path):
    reference = hf_model(seed=7)
    reference.save_pretrained(tmp_path / "in")
    results = run_ranks(_sharded_roundtrip_body, 2, args=(str(tmp_path / "in"), str(tmp_path / "out")), timeout=120)
    tokens = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = reference(tokens).logits
    assert rel_error(torch.tensor(results[0]), want) <= PARITY_BOUND
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model-00001-of-00001.safetensors",
                                                  "model.safetensors.index.json"]
    exported = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        assert rel_error(exported(tokens).logits, want) <= 1e-5
