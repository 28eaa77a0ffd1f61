"""The CP attention's kernel family (`[parallelism] attention_kernel`, parallelisms/cp/kernel_blocks.py) on a CPU-only
box:
- "auto" resolves by compute capability (cuDNN from SM 9.0, flash below and on CPU); an explicit choice the device
  cannot run is refused with the reason;
- on fake CUDA tensors with "cudnn", every cuDNN call of the dense ring (zigzag and contiguous: diagonal causal
  squares, off-diagonal full blocks) and of the all-gather (fused blocks with Lq != Lk) has the arguments, strides,
  dtypes and log-sum-exp layout that torch's meta kernels define, and the dense ring calls no FlashAttention-2 op;
  the all-gather's causal Lq != Lk blocks and packed documents take the flash ops (bottom-right causal, varlen);
- with "fa4" the trainer's activation goes through torch's registry, and the documents path calls only ops that
  torch's own FA4 registration re-registers (a stand-in records what it would register instead of registering).
The numbers of the real kernels: tests/gpu/test_gpu_block_kernels.py (`./run_tests.sh --gpu`)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from parallelisms.cp.block_spec import BlockSpec
from parallelisms.cp.exchange_allgather import allgather_backward, allgather_forward
from parallelisms.cp.exchange_ring import ring_backward, ring_forward
from parallelisms.cp.flash_impls import activate_flash_implementation, flash_implementation
from parallelisms.cp.kernel_blocks import CudnnBlock, concrete_kernel, kernel_problem
from parallelisms.cp.plan_layout import DocumentLayout
from parallelisms.cp.plan_pieces import DocumentShards
from training.planning import cuda_path_probe as probe
from training.planning.fake.counter import KERNEL_OF_OP, DispatchCounter
from training.planning.fake.cuda import load_fake_cuda_guard
from training.planning.fake.world import fake_process_group

aten = torch.ops.aten
CUDNN_FORWARD = aten._scaled_dot_product_cudnn_attention.default
CUDNN_BACKWARD = aten._scaled_dot_product_cudnn_attention_backward.default
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


@pytest.fixture(scope="module")
def fake_cuda():
    why = load_fake_cuda_guard()
    if why:
        pytest.skip(why)


# ---- choice and refusals -----------------------------------------------------------------------------------------

def test_auto_is_cudnn_from_hopper_and_flash_below_it_and_on_cpu():
    assert concrete_kernel("auto", "cuda", (9, 0)) == "cudnn"  # H100 / H200
    assert concrete_kernel("auto", "cuda", (10, 0)) == "cudnn"  # B200
    assert concrete_kernel("auto", "cuda", (8, 0)) == "flash"  # A100
    assert concrete_kernel("auto", "cuda", None) == "flash"  # fake CUDA: no capability to read
    assert concrete_kernel("auto", "cpu", None) == "flash"
    assert concrete_kernel("fa4", "cuda", (9, 0)) == "fa4" and concrete_kernel("cudnn", "cuda", (8, 0)) == "cudnn"


def test_auto_takes_cudnn_only_where_torch_itself_prefers_it():
    """torch's conditions (sdp_utils.cpp): SM 9.x / 10.x, cuDNN newer than 9.15, its SDPA backend enabled; and never
    under deterministic algorithms, where cuDNN's attention backward is not deterministic."""
    assert concrete_kernel("auto", "cuda", (9, 0), cudnn_version=91900) == "cudnn"  # torch 2.11's cuDNN
    assert concrete_kernel("auto", "cuda", (9, 0), cudnn_version=91500) == "flash"
    assert concrete_kernel("auto", "cuda", (12, 0), cudnn_version=91900) == "flash"  # consumer Blackwell
    assert concrete_kernel("auto", "cuda", (9, 0), cudnn_version=91900, cudnn_sdp_enabled=False) == "flash"
    assert concrete_kernel("auto", "cuda", (9, 0), cudnn_version=91900, deterministic=True) == "flash"
    assert concrete_kernel("cudnn", "cuda", (9, 0), deterministic=True) == "cudnn"  # asked for by name: as asked


def test_cudnns_avoid_recompile_switch_is_refused_in_one_line(monkeypatch):
    """With TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 torch reads the dense LSE as (B, Lq): wrong gradients for batch > 1."""
    monkeypatch.setenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")
    for asked in ("cudnn", "auto"):
        problem = kernel_problem(asked, "cuda", (9, 0), True, lambda module: False)
        assert "TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1" in problem and "unset it" in problem and "\n" not in problem
    assert kernel_problem("flash", "cuda", (9, 0), True, lambda module: False) is None
    assert kernel_problem("auto", "cuda", (8, 0), True, lambda module: False) is None  # auto is flash on A100
    monkeypatch.setenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "0")
    assert kernel_problem("cudnn", "cuda", (9, 0), True, lambda module: False) is None


def test_a_kernel_the_device_cannot_run_is_refused_with_the_reason():
    def installed(*names):
        return lambda module: module in names

    def problem(asked, device="cuda", capability=(9, 0), cudnn=True, found=installed()):
        return kernel_problem(asked, device, capability, cudnn, found)

    assert problem("auto") is None and problem("flash", "cpu", None) is None
    assert "runs on CUDA GPUs and this run is on cpu" in problem("cudnn", "cpu", None)
    assert "no cuDNN" in problem("cudnn", cudnn=False)
    assert "8.0+" in problem("cudnn", capability=(7, 5)) and problem("cudnn", capability=(8, 0)) is None
    assert "FA3 runs on compute capability 9.0, this GPU has 8.0" in problem("fa3", capability=(8, 0))
    assert "flash_attn_interface" in problem("fa3")
    assert problem("fa3", found=installed("flash_attn_interface")) is None
    assert "flash_attn.cute.interface" in problem("fa4", capability=(10, 0))
    assert problem("fa4", capability=(10, 0), found=installed("flash_attn.cute.interface")) is None


# ---- cuDNN calls on fake CUDA ------------------------------------------------------------------------------------

def _layer_calls(exchange, layout: str, kernel: str, cp: int = 4, rank: int = 2, length: int = 64):
    """Every attention call (op, args, kwargs, result) of one layer's forward + backward of `rank`, dense layout."""
    forward, backward = exchange
    counter = DispatchCounter(record=True)
    with fake_process_group(cp, rank) as group, FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = probe._qkv(1, length, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16)
        spec = BlockSpec(group, True, None, layout, None, None, 0, kernel)
        with counter:
            probe.run_layer(forward, backward, q, k, v, spec)
    return counter.attention_calls


def _bound(func, args, kwargs) -> dict:
    """The call's arguments by schema name, defaults filled in (dispatch drops trailing defaults)."""
    named = {}
    for i, arg in enumerate(func._schema.arguments):
        named[arg.name] = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
    return named


def _order(t: torch.Tensor) -> list[int]:
    """The dims from outermost to innermost in memory."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def _check_cudnn_call(func, args, kwargs, result):
    """The arguments, strides, dtypes and LSE layout of one cuDNN call, as torch's meta kernels define them."""
    a = _bound(func, args, kwargs)
    q, k, v, is_causal = a["query"], a["key"], a["value"], a["is_causal"]
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and all(x.stride(-1) == 1 for x in (q, k, v))
    assert k.size(1) == v.size(1) == KV_HEADS and q.size(1) == HEADS  # GQA native, K/V never expanded
    assert not is_causal or q.size(2) == k.size(2)  # top-left causal only where it equals bottom-right
    assert a["dropout_p"] == 0.0 and a["attn_bias"] is None
    if func is CUDNN_FORWARD:
        out, lse = result[:2]
        assert a["compute_log_sumexp"] is True
        assert out.shape == q.shape and _order(out) == _order(q)  # written in the query's memory order
        assert lse.shape == (*q.shape[:3], 1) and lse.dtype == torch.float32
        return "causal" if is_causal else ("full" if q.size(2) == k.size(2) else "full, Lq != Lk")
    assert func is CUDNN_BACKWARD, f"unexpected attention op {func}"
    grad_out, out, lse = a["grad_out"], a["out"], a["logsumexp"]
    assert grad_out.stride() == out.stride() and _order(out) == _order(q)  # one graph per shape: out, grad_out alike
    assert lse.shape == (*q.shape[:3], 1) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert a["cum_seq_q"] is None and a["max_q"] == q.size(2) and a["max_k"] == k.size(2)
    assert [g.shape for g in result] == [q.shape, k.shape, v.shape]
    return "backward"


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_dense_ring_on_cudnn_calls_only_cudnn_ops_and_each_fits_its_schema(fake_cuda, layout):
    calls = _layer_calls((ring_forward, ring_backward), layout, "cudnn")
    kinds = [_check_cudnn_call(func, args, kwargs, result) for func, args, kwargs, result in calls]
    off_diagonal = {"zigzag": "full, Lq != Lk", "contiguous": "full"}[layout]  # zigzag: half chunks vs blocks
    assert {"causal", off_diagonal, "backward"} <= set(kinds), kinds  # the diagonal squares and the other blocks
    assert kinds.count("backward") * 2 == len(kinds)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_flash_keeps_the_dense_ring_off_cudnn(fake_cuda, layout):
    calls = _layer_calls((ring_forward, ring_backward), layout, "flash")
    assert calls and {KERNEL_OF_OP[func] for func, *_ in calls} == {"flash"}


def test_the_allgather_on_cudnn_keeps_every_causal_block_square(fake_cuda):
    """The all-gather fuses only full rectangles: its causal blocks are squares, so all of them run on cuDNN (whose
    dense path aligns causal masks top-left) and none needs flash's bottom-right alignment."""
    calls = _layer_calls((allgather_forward, allgather_backward), "zigzag", "cudnn")
    cudnn = [_check_cudnn_call(func, args, kwargs, result) for func, args, kwargs, result in calls
             if KERNEL_OF_OP[func] == "cudnn"]
    assert "full, Lq != Lk" in cudnn and "causal" in cudnn, cudnn  # causal calls are checked square
    assert {KERNEL_OF_OP[func] for func, *_ in calls} == {"cudnn"}


def test_a_causal_rectangle_is_refused_and_single_rows_go_to_flash(fake_cuda):
    """cuDNN's dense causal mask is top-left: a causal block with Lq != Lk would be wrong there, so it is an error
    upstream. A query or key length of 1 (the zigzag half of a 2-token shard) is refused by torch's own cuDNN
    dispatch checks: such blocks run on flash, forward and backward alike."""
    counter = DispatchCounter(record=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = probe._qkv(1, 1, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16)
        wide = probe._qkv(1, 8, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16)
        block = CudnnBlock()
        with counter:
            out, lse, aux = block.forward(q, k, v, is_causal=True, scale=None, mask=None)
            block.backward(torch.empty_like(out), q, k, v, out, lse, aux, is_causal=True, scale=None, mask=None)
            out, lse, aux = block.forward(q, *wide[1:], is_causal=False, scale=None, mask=None)  # 1 x 8, full
        with pytest.raises(AssertionError, match="must be square"):
            block.forward(q, *wide[1:], is_causal=True, scale=None, mask=None)
    assert {KERNEL_OF_OP[func] for func, *_ in counter.attention_calls} == {"flash"}
    assert len(counter.attention_calls) == 3


def _documents_row(seq: int = 512, cp: int = 4) -> DocumentShards:
    row = torch.cat([torch.full((1, n), i) for i, n in enumerate([200, 37, 90, 5, 180])], dim=1)[:, :seq]
    return DocumentShards.from_layout(row, DocumentLayout.plan(row, cp))


def test_documents_take_the_flash_varlen_ops_whatever_the_family(fake_cuda):
    for kernel in ("cudnn", "flash"):
        counter = DispatchCounter(record=True)
        probe.measure_layer(_documents_row(), 1, "ring", (1, 128, HEADS, KV_HEADS, HEAD_DIM), counter=counter,
                            kernel=kernel)
        assert counter.by_kernel and set(counter.by_kernel) == {"flash"}, (kernel, counter.by_kernel)


# ---- FA4: torch's flash ops, re-registered -----------------------------------------------------------------------

def test_fa4_is_activated_through_torchs_registry_and_documents_call_only_the_ops_it_replaces(fake_cuda, monkeypatch):
    """A stand-in for the flash-attn-4 package: torch's own FA4 registration runs, with its `Library` replaced by a
    recorder, so the test learns which aten ops FA4 would take over (from torch's code) without registering any."""
    from torch.nn import attention
    from torch.nn.attention import _fa4, _registry

    replaced: set[str] = set()

    class RecordingLibrary:
        def __init__(self, *args, **kwargs):
            pass

        def impl(self, name, fn, key=None, **kwargs):
            replaced.add(name)

    monkeypatch.setattr(_fa4, "Library", RecordingLibrary)
    monkeypatch.setitem(_registry._FLASH_ATTENTION_IMPLS, "FA4", lambda: _fa4._FA4Handle(_fa4._fa4_register_kernels()))
    try:
        activate_flash_implementation("fa4")
        assert attention.current_flash_attention_impl() == "FA4"
        assert {"_flash_attention_forward", "_flash_attention_backward"} <= replaced
        counter = DispatchCounter(record=True)
        probe.measure_layer(_documents_row(), 1, "ring", (1, 128, HEADS, KV_HEADS, HEAD_DIM), counter=counter,
                            kernel="fa4")
        called = {func._schema.name.split("::")[1] for func, *_ in counter.attention_calls}
        assert called and called <= replaced, (called, replaced)
    finally:
        attention.restore_flash_attention_impl(_raise_warn=False)
    assert attention.current_flash_attention_impl() is None


# ---- without a CP context: the model's own SDPA call, backends ordered by the family ------------------------------

def test_sdpa_runs_with_the_familys_backend_order_on_cuda_and_untouched_on_cpu():
    from torch.nn.attention import SDPBackend

    from parallelisms.cp.kernel_blocks import sdpa_priority

    before = (torch._C._get_sdp_priority_order(), torch.backends.cuda.cudnn_sdp_enabled())
    with sdpa_priority("cudnn", torch.device("cuda", 0)):
        assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    with sdpa_priority("flash", torch.device("cuda", 0)):
        assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.FLASH_ATTENTION)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    with sdpa_priority("cudnn", torch.device("cpu")):
        assert (torch._C._get_sdp_priority_order(), torch.backends.cuda.cudnn_sdp_enabled()) == before
    assert (torch._C._get_sdp_priority_order(), torch.backends.cuda.cudnn_sdp_enabled()) == before


def test_ulysses_whole_sequence_call_runs_sdpa_with_the_familys_backend_order(fake_cuda):
    """Ulysses without documents makes one whole-sequence SDPA call after its all-to-all: torch's dispatcher picks
    the kernel, with cuDNN first for "cudnn" and left out for "flash" (on fake CUDA a CPU build's dispatcher would
    take the math path either way, so the order it is given is what can be checked here)."""
    from torch.nn.attention import SDPBackend
    from torch.overrides import TorchFunctionMode

    from parallelisms.cp.exchange_ulysses import ulysses_attention

    class SdpaCalls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.scaled_dot_product_attention:
                self.calls.append((torch._C._get_sdp_priority_order()[0], torch.backends.cuda.cudnn_sdp_enabled(),
                                   args[0].size(1), args[1].size(1)))
            return func(*args, **(kwargs or {}))

    for kernel, first, cudnn_on in (("cudnn", SDPBackend.CUDNN_ATTENTION, True),
                                    ("flash", SDPBackend.FLASH_ATTENTION, False)):
        spy = SdpaCalls()
        with fake_process_group(2, 0) as group, FakeTensorMode(allow_non_fake_inputs=True):
            q, k, v = probe._qkv(1, 32, 4, 2, 64, torch.bfloat16)
            with spy:
                ulysses_attention(q, k, v, group, is_causal=True, load_balancer="zigzag", kernel=kernel)
        assert spy.calls == [(int(first), cudnn_on, 2, 1)], spy.calls  # heads / 2 per rank, K/V unexpanded


def test_flash_after_fa4_restores_torchs_own_flash_ops(monkeypatch):
    """Issue 50, bug 7: activate_flash_implementation("flash") after "fa4" left FA4 registered (no way back but the
    benches' hand-written restore); the scoped form puts back what was there before."""
    import torch.nn.attention as attention

    active = [None]
    monkeypatch.setattr(attention, "current_flash_attention_impl", lambda: active[0])
    monkeypatch.setattr(attention, "activate_flash_attention_impl", lambda name: active.__setitem__(0, name))
    monkeypatch.setattr(attention, "restore_flash_attention_impl",
                        lambda _raise_warn=True: active.__setitem__(0, None))
    activate_flash_implementation("fa4")
    assert active[0] == "FA4"
    activate_flash_implementation("flash")
    assert active[0] is None
    activate_flash_implementation("fa3")
    with flash_implementation("fa4"):
        assert active[0] == "FA4"
    assert active[0] == "FA3"
    with flash_implementation("cudnn"):
        assert active[0] is None
    assert active[0] == "FA3"
