"""Llama 3 model: RoPE, attention, shapes, parameter counts and init, each against an independent reference."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.llama import (MODEL_CONFIGS, Attention, Llama, LlamaConfig, count_parameters, flops_per_token,
                          model_config)
from models.rope import RotaryEmbedding, apply_rotary, rope_frequencies
from tests.distributed import run_ranks
from config import RecipeError

TINY = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, rope_theta=10000.0)


def tiny_model(seed: int = 0, **overrides) -> Llama:
    model = Llama(LlamaConfig(**{**TINY, **overrides}))
    model.init_weights(seed)
    return model


# ---------------------------------------------------------------- RoPE
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_matches_closed_form_per_pair(theta):
    head_dim, positions = 8, [0, 1, 7, 100, 1234]
    x = torch.randn(1, len(positions), 2, head_dim)
    rope = RotaryEmbedding(head_dim, theta)
    cos, sin = rope(torch.tensor([positions]))
    got = apply_rotary(x, cos, sin)
    for s, p in enumerate(positions):
        for h in range(2):
            for i in range(head_dim // 2):
                angle = p * theta ** (-2 * i / head_dim)
                a, b = x[0, s, h, 2 * i].item(), x[0, s, h, 2 * i + 1].item()
                assert got[0, s, h, 2 * i].item() == pytest.approx(a * math.cos(angle) - b * math.sin(angle), abs=1e-4)
                assert got[0, s, h, 2 * i + 1].item() == pytest.approx(a * math.sin(angle) + b * math.cos(angle),
                                                                       abs=1e-4)


def _llama31_frequencies_reference(head_dim, theta, factor, low, high, old_context):
    """Meta's published apply_scaling, one scalar at a time."""
    out = []
    for i in range(head_dim // 2):
        freq = 1.0 / theta ** (2 * i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            out.append(freq)
        elif wavelen > old_context / low:
            out.append(freq / factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def test_llama31_scaled_frequencies_match_published_formula():
    expected = _llama31_frequencies_reference(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    got = rope_frequencies(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(expected, rel=1e-5)
    # all three regimes are exercised: kept, divided, and blended
    base = rope_frequencies(128, 500000.0)
    ratio = (got / base).tolist()
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(1 / 8)
    assert any(1 / 8 + 1e-3 < r < 1 - 1e-3 for r in ratio)


def test_model_rope_buffer_follows_config_and_set_rope():
    with torch.device("meta"):
        model = Llama(model_config("llama3_8b"))
    model.to_empty(device="cpu")
    model.set_rope(500000.0, 8.0, 1.0, 4.0, 8192)  # to_empty left the buffer uninitialised
    assert model.rope.inv_freq.tolist() == pytest.approx(
        _llama31_frequencies_reference(128, 500000.0, 8.0, 1.0, 4.0, 8192), rel=1e-5)
    model.set_rope(1e6)
    assert model.config.rope_theta == 1e6 and model.config.rope_scaling_factor is None
    assert model.rope.inv_freq.tolist() == pytest.approx([1e6 ** (-2 * i / 128) for i in range(64)], rel=1e-5)
    assert "rope.inv_freq" not in model.state_dict()


def test_rope_with_arbitrary_positions_equals_rows_of_full_sequence():
    rope = RotaryEmbedding(16, 500000.0, 8.0)
    full_len = 64
    x = torch.randn(2, full_len, 3, 16)
    full = apply_rotary(x, *rope(torch.arange(full_len).expand(2, full_len)))
    # e.g. a zigzag shard (chunks 0 and 3 of 4) and a shuffled subset per row
    rows = torch.stack([torch.cat([torch.arange(0, 16), torch.arange(48, 64)]), torch.randperm(full_len)[:32]])
    picked = torch.stack([x[b, rows[b]] for b in range(2)])
    got = apply_rotary(picked, *rope(rows))
    expected = torch.stack([full[b, rows[b]] for b in range(2)])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_rope_keeps_bfloat16_activations():
    x = torch.randn(1, 5, 2, 8, dtype=torch.bfloat16)
    out = apply_rotary(x, *RotaryEmbedding(8, 10000.0)(torch.arange(5)[None]))
    assert out.dtype == torch.bfloat16


def test_logits_depend_only_on_relative_positions():
    """RoPE attention scores depend on position differences: a constant offset must not change the logits."""
    model = tiny_model()
    tokens = torch.randint(0, TINY["vocab_size"], (2, 24))
    base = model(tokens)
    shifted = model(tokens, torch.arange(24).expand(2, 24) + 1000)
    torch.testing.assert_close(shifted, base, rtol=1e-3, atol=2e-3)


# ---------------------------------------------------------------- attention
def _reference_attention(attn: Attention, x, positions, n_heads, n_kv_heads, theta):
    """Hand-written: complex-number RoPE on interleaved pairs, repeat_interleave K/V, explicit causal softmax."""
    bsz, seqlen, _ = x.shape
    hd = attn.head_dim
    q = (x @ attn.wq.weight.T).view(bsz, seqlen, n_heads, hd)
    k = (x @ attn.wk.weight.T).view(bsz, seqlen, n_kv_heads, hd)
    v = (x @ attn.wv.weight.T).view(bsz, seqlen, n_kv_heads, hd)
    inv = torch.tensor([theta ** (-2 * i / hd) for i in range(hd // 2)], dtype=torch.float64)
    rot = torch.polar(torch.ones(bsz, seqlen, 1, hd // 2, dtype=torch.float64), positions[..., None, None] * inv)

    def rotate(t):
        return torch.view_as_real(torch.view_as_complex(t.double().unflatten(-1, (-1, 2))) * rot).flatten(-2).float()

    q, k = rotate(q).transpose(1, 2), rotate(k).transpose(1, 2)
    group = n_heads // n_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(bsz, seqlen, -1)
    return out @ attn.wo.weight.T


@pytest.mark.parametrize("n_heads,n_kv_heads", [(8, 2), (4, 4)])
def test_gqa_attention_matches_expanded_heads_forward_and_backward(n_heads, n_kv_heads):
    cfg = LlamaConfig(dim=64, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=8)
    attn = Attention(cfg)
    x = torch.randn(2, 20, 64, requires_grad=True)
    positions = torch.randint(0, 5000, (2, 20))
    out = attn(x, *RotaryEmbedding(cfg.head_dim, cfg.rope_theta)(positions))
    ref = _reference_attention(attn, x, positions, n_heads, n_kv_heads, cfg.rope_theta)
    # relative to the norm: float32 RoPE angles lose ~position x 6e-8 rad, which the float64 reference does not
    assert ((out - ref).norm() / ref.norm()).item() < 2e-5
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, attn.wk.weight, attn.wq.weight], grad)
    want = torch.autograd.grad(ref, [x, attn.wk.weight, attn.wq.weight], grad)
    for g, w in zip(got, want):
        assert ((g - w).norm() / w.norm()).item() < 5e-5


def test_attention_passes_unexpanded_kv_to_sdpa(monkeypatch):
    """Context parallelism intercepts this exact call; K/V must keep their n_kv_heads."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape, k.shape, v.shape, kwargs))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = tiny_model()
    model(torch.randint(0, 96, (2, 10)))
    assert len(calls) == TINY["n_layers"]
    q_shape, k_shape, v_shape, kwargs = calls[0]
    assert q_shape == (2, 4, 10, 16) and k_shape == v_shape == (2, 2, 10, 16)
    assert kwargs == dict(is_causal=True, scale=16 ** -0.5, enable_gqa=True)


def test_attention_with_a_slice_of_heads_sums_to_the_full_output():
    """Tensor parallelism shards wq/wk/wv by rows and wo by columns; the module must infer its local head count."""
    cfg = LlamaConfig(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=8)
    full = Attention(cfg)
    x = torch.randn(2, 12, 64)
    cos_sin = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)(torch.arange(12).expand(2, 12))
    partial_sum = torch.zeros(2, 12, 64)
    for shard in range(2):
        local = Attention(cfg)
        q_rows, kv_rows = slice(shard * 32, shard * 32 + 32), slice(shard * 8, shard * 8 + 8)
        with torch.no_grad():
            local.wq.weight = torch.nn.Parameter(full.wq.weight[q_rows].clone())
            local.wk.weight = torch.nn.Parameter(full.wk.weight[kv_rows].clone())
            local.wv.weight = torch.nn.Parameter(full.wv.weight[kv_rows].clone())
            local.wo.weight = torch.nn.Parameter(full.wo.weight[:, q_rows].clone())
        partial_sum += local(x, *cos_sin)
    torch.testing.assert_close(partial_sum, full(x, *cos_sin), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- whole model
def test_pipeline_stages_compose_to_the_full_model():
    model = tiny_model()
    tokens, positions = torch.randint(0, 96, (2, 16)), torch.randint(0, 100, (2, 16))
    first, last = tiny_model(), tiny_model()
    for key in ("2", "3"):
        del first.layers[key]
    for key in ("0", "1"):
        del last.layers[key]
    first.norm = first.output = None
    last.tok_embeddings = None
    hidden = first(tokens, positions)
    assert hidden.shape == (2, 16, 64)
    torch.testing.assert_close(last(hidden, positions), model(tokens, positions), rtol=0, atol=0)


PUBLISHED_COUNTS = {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496, "llama3_405b": 405_853_388_800}


@pytest.mark.parametrize("name", list(PUBLISHED_COUNTS))
def test_parameter_counts_match_published(name):
    with torch.device("meta"):
        model = Llama(model_config(name))
    assert count_parameters(model) == PUBLISHED_COUNTS[name]
    assert model.config.vocab_size == 128256 and model.config.rope_scaling_factor == 8.0


def test_debug_model_shape_and_count():
    cfg = model_config("debug")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.vocab_size, cfg.ffn_hidden_dim) == (256, 6, 16, 2048, 768)
    # 6 x (4 x 256^2 attention + 3 x 256 x 768 SwiGLU + 2 norms) + 2 x 2048 x 256 embedding/output + final norm
    expected = 6 * (4 * 256 * 256 + 3 * 256 * 768 + 2 * 256) + 2 * 2048 * 256 + 256
    assert count_parameters(Llama(cfg)) == expected == 6_163_712


def test_flops_per_token_for_8b():
    cfg = model_config("llama3_8b")
    dense = 6 * (PUBLISHED_COUNTS["llama3_8b"] - 128256 * 4096)
    attention = 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(cfg, 8192, causal=False) == dense + attention
    assert flops_per_token(cfg, 8192) == dense + attention / 2


def test_model_config_errors_are_recipe_errors():
    with pytest.raises(RecipeError, match="did you mean 'llama3_8b'"):
        model_config("llama3-8b")
    with pytest.raises(RecipeError, match="did you mean 'n_layers'"):
        model_config("debug", n_layer=2)
    with pytest.raises(RecipeError, match="dim"):
        model_config("debug", dim="256")
    with pytest.raises(RecipeError, match="n_kv_heads"):
        model_config("debug", n_kv_heads=5)
    cfg = model_config("debug", n_layers=2, rope_theta=10000)
    assert cfg.n_layers == 2 and isinstance(cfg.rope_theta, float) and MODEL_CONFIGS["debug"].n_layers == 6


# ---------------------------------------------------------------- init
def test_init_same_seed_same_weights_for_a_pipeline_stage():
    full = tiny_model(seed=11)
    stage = Llama(LlamaConfig(**TINY))
    for key in ("0", "1"):
        del stage.layers[key]
    stage.tok_embeddings = None
    stage.init_weights(11)
    full_state = full.state_dict()
    for name, tensor in stage.state_dict().items():
        torch.testing.assert_close(tensor, full_state[name], rtol=0, atol=0)
    other = tiny_model(seed=12)
    assert not torch.equal(other.layers["1"].attention.wq.weight, full.layers["1"].attention.wq.weight)
    # distinct parameters of one model get distinct draws
    assert not torch.equal(full.layers["1"].attention.wq.weight, full.layers["2"].attention.wq.weight)


def test_init_from_meta_and_through_wrappers_matches_plain_init():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    plain = tiny_model(seed=5)
    with torch.device("meta"):
        model = Llama(LlamaConfig(**TINY))
    model.layers["1"] = checkpoint_wrapper(model.layers["1"])
    model.to_empty(device="cpu")
    model.init_weights(5)
    tokens = torch.randint(0, 96, (1, 8))
    torch.testing.assert_close(model(tokens), plain(tokens), rtol=0, atol=0)


def test_init_standard_deviations():
    model = Llama(model_config("debug"))
    model.init_weights(0)
    trunc = 0.9866  # std of a normal truncated at +-3 std, relative to the untruncated std

    def std(t):
        return t.detach().float().std().item()

    assert std(model.tok_embeddings.weight) == pytest.approx(1.0, rel=0.02)
    assert std(model.layers["0"].attention.wq.weight) == pytest.approx(0.02 * trunc, rel=0.03)
    assert std(model.layers["4"].feed_forward.w1.weight) == pytest.approx(0.02 * trunc, rel=0.03)
    for layer in (0, 5):
        depth_std = 0.02 / math.sqrt(2 * (layer + 1)) * trunc
        assert std(model.layers[str(layer)].attention.wo.weight) == pytest.approx(depth_std, rel=0.03)
        assert std(model.layers[str(layer)].feed_forward.w2.weight) == pytest.approx(depth_std, rel=0.03)
    assert std(model.output.weight) == pytest.approx(256 ** -0.5 * trunc, rel=0.03)
    assert model.output.weight.abs().max().item() <= 3 * 256 ** -0.5
    assert torch.equal(model.norm.weight, torch.ones(256))
    flat = Llama(model_config("debug", depth_init=False))
    flat.init_weights(0)
    assert std(flat.layers["0"].feed_forward.w3.weight) == pytest.approx(0.02 / math.sqrt(12) * trunc, rel=0.03)


def _sharded_init_body(rank, world_size, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg = LlamaConfig(**{**TINY, "vocab_size": 33})  # 33 rows: an uneven FSDP shard
    reference = Llama(cfg)
    reference.init_weights(seed)
    tokens = torch.randint(0, 33, (2, 12), generator=torch.Generator().manual_seed(0))
    mesh = init_device_mesh("cpu", (world_size,))
    report = {}
    for kind in ("fsdp", "tp"):
        with torch.device("meta"):
            model = Llama(cfg)
        if kind == "fsdp":
            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                    "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel()}
            for block in model.layers.values():
                parallelize_module(block, mesh, plan)
        model.to_empty(device="cpu")
        model.init_weights(seed)
        ref_params = dict(reference.named_parameters())
        sharded = 0
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                sharded += 1
                param = param.full_tensor()
            assert torch.equal(param, ref_params[name]), f"{kind}: {name} differs"
        with torch.no_grad():
            report[kind] = (sharded, (model(tokens) - reference(tokens)).abs().max().item())
    return report


def test_sharded_init_equals_single_process_init_fsdp_and_tp():
    reports = run_ranks(_sharded_init_body, world_size=2, args=(3,), timeout=120)
    for report in reports:
        assert report["fsdp"][0] == 4 * 9 + 3 and report["tp"][0] == 4 * 7
        assert report["fsdp"][1] < 1e-5 and report["tp"][1] < 1e-5


# ---------------------------------------------------------------- training sanity
def test_tiny_model_overfits_a_fixed_batch():
    torch.manual_seed(0)
    model = tiny_model(seed=1, n_layers=2)
    tokens = torch.randint(0, 96, (4, 33))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 3.5 and losses[-1] < 0.5 * losses[0], losses
