"""RoPE's rotation over tiles of tokens (models/rope.py `apply_rotary`): the same values and gradients as autograd
through the plain float32 rotation (bit for bit, fp32 and bf16), both against a float64 complex-number reference,
and what it keeps for the backward (cos and sin only, never a float32 copy of q or k)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from models.rope import RotaryEmbedding, _rotate, apply_rotary


def _inputs(dtype, b=2, s=37, h=4, d=16):
    gen = torch.Generator().manual_seed(0)
    cos, sin = RotaryEmbedding(d, 500000.0)(torch.randint(0, 4096, (b, s), generator=gen))
    x = torch.randn(b, s, h, d, generator=gen).to(dtype).requires_grad_()
    return x, cos, sin, torch.randn(b, s, h, d, generator=gen).to(dtype)


def _complex_reference(x, cos, sin, grad):
    """Pairs (2i, 2i+1) as complex numbers times e^{i angle}, in float64; the gradient of a rotation is the
    rotation by the opposite angle."""
    turn = torch.complex(cos.double(), sin.double())
    as_complex = lambda t: torch.view_as_complex(t.double().reshape(*t.shape[:-1], -1, 2).contiguous())  # noqa
    out = torch.view_as_real(as_complex(x.detach()) * turn).flatten(-2)
    back = torch.view_as_real(as_complex(grad) * turn.conj()).flatten(-2)
    return out, back


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tile_tokens", [1, 5, 37, 1000])
def test_tiled_rotation_equals_the_plain_one_bit_for_bit_and_the_complex_reference(dtype, bound, tile_tokens):
    x, cos, sin, grad = _inputs(dtype)
    plain = _rotate(x, cos, sin)
    plain.backward(grad)
    plain_grad, x.grad = x.grad, None
    tiled = apply_rotary(x, cos, sin, tile_elements=tile_tokens * 4 * 16)
    tiled.backward(grad)
    assert torch.equal(tiled, plain) and torch.equal(x.grad, plain_grad)
    want_out, want_grad = _complex_reference(x, cos, sin, grad)
    for got, want in ((tiled, want_out), (x.grad, want_grad)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= bound


class _LargestFloat32(TorchDispatchMode):
    """The most elements of any float32 tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_float32_temporaries_span_one_tile_and_only_cos_and_sin_are_kept():
    x, cos, sin, grad = _inputs(torch.bfloat16, s=64)
    kept = []
    with _LargestFloat32() as tiled, torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t,
                                                                               lambda t: t):
        apply_rotary(x, cos, sin, tile_elements=1024).backward(grad)  # 8 of the 64 tokens (x 2 rows) per tile
    with _LargestFloat32() as plain:
        _rotate(x, cos, sin).backward(grad)
    assert plain.largest == x.numel() and tiled.largest == 1024
    assert [t.shape for t in kept] == [cos.shape, sin.shape, (2,)]  # and the rotation's (-1, 1) sign


def test_compiled_rotation_is_one_tile_whatever_the_length():
    """Issue 47: under torch.compile the rotation is one fused region, not a tile loop that dynamo unrolls (the
    graph and its subgraphs grew with the sequence: 280 nodes at 32 tokens, 1,048 at 128, 8 tokens a tile); values
    and gradients as eager's within fp32."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def graph_nodes(s):
        torch._dynamo.reset()
        backend = CompileCounterWithBackend("aot_eager")
        x, cos, sin, grad = _inputs(torch.float32, s=s)
        out = torch.compile(lambda t: apply_rotary(t, cos, sin, tile_elements=8 * 4 * 16), backend=backend,
                            fullgraph=True)(x)
        out.backward(grad)
        eager_x = x.detach().clone().requires_grad_()
        eager = apply_rotary(eager_x, cos, sin, tile_elements=8 * 4 * 16)
        eager.backward(grad)
        assert torch.allclose(out, eager, atol=1e-6) and torch.allclose(x.grad, eager_x.grad, atol=1e-6)
        (graph,) = backend.graphs  # the autograd.Function's forward and backward are subgraphs of it
        return sum(len(module.graph.nodes) for module in graph.modules() if isinstance(module, torch.fx.GraphModule))

    assert graph_nodes(32) == graph_nodes(128)
