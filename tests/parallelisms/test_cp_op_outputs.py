"""The registered CP op's real outputs against its fake implementation (issue 57): inductor plans every buffer from
the fake and trusts it, so each real output must have the fake's shape, dtype and device (checked, one line naming
the op and output), and its strides and own storage (copied into them only where needed). The fake here is the op's
own `_forward_fakes`, the meta layout its registered fake returns; the reference for shapes is q itself."""
import pytest
import torch

from parallelisms.cp.op import _forward_fakes, own_outputs


def _q():
    return torch.randn(2, 8, 4, 16).transpose(1, 2)  # (B, H, S, D) viewed from (B, S, H, D), as the model calls SDPA


def test_right_outputs_pass_in_the_fakes_layout_and_own_storage():
    q = _q()
    out = torch.randn(2, 4, 8, 16)  # contiguous (B, H, S, D): q's layout differs
    lse = torch.randn(2, 4, 8)
    got_out, got_lse = own_outputs("attention", [out, lse], _forward_fakes(q), (q,))
    assert got_out.stride() == torch.empty_like(q).stride() and torch.equal(got_out, out)
    assert got_lse is lse  # already right: no copy
    aliased = q.detach()  # an output sharing an input's storage is copied
    (own,) = own_outputs("attention_backward", [aliased], [torch.empty_like(q, device="meta")], (q,))
    assert own.untyped_storage().data_ptr() != q.untyped_storage().data_ptr() and torch.equal(own, q)


@pytest.mark.parametrize("which, bad, expect", [
    (0, lambda q: torch.randn(2, 4, 8, 16, dtype=torch.float64), "output 0 is (2, 4, 8, 16) torch.float64"),
    (1, lambda q: torch.randn(2, 8, 4), "output 1 is (2, 8, 4) torch.float32"),  # lse as (B, S, H)
    (1, lambda q: torch.randn(2, 4, 8, dtype=torch.bfloat16), "says (2, 4, 8) torch.float32"),
])
def test_an_output_the_fake_does_not_describe_is_refused_in_one_line(which, bad, expect):
    q = _q()
    results = [torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8)]
    results[which] = bad(q)
    with pytest.raises(RuntimeError) as err:
        own_outputs("attention", results, _forward_fakes(q), (q,))
    message = str(err.value)
    assert expect in message and "titan_cp.attention" in message and "\n" not in message, message
