"""The process-level NCCL double (tests/nccl_device_rule.py) on real gloo ranks: each rule refuses what NCCL would
refuse (or hang on), and accepts the correct form of the same code. The trainer runs under it in
test_nccl_device_rule.py."""
import pytest

from tests.distributed import run_ranks


def _outcome(fn):
    try:
        return fn()
    except RuntimeError as e:
        return str(e).splitlines()[0]


def _host_buffers(rank, world_size):
    import numpy as np
    import torch
    import torch.distributed as dist

    from tests import nccl_device_rule

    hosts, rules = nccl_device_rule.install(timeout_s=20)
    device = torch.device("cpu")  # the run device, as build.py hands it out
    run = torch.ones(3, device=device)
    cases = {
        "from_numpy": lambda: torch.from_numpy(np.ones(3, dtype=np.float32)),
        "cpu()": lambda: (run * 2).cpu(),
        "device-cpu": lambda: torch.ones(3, device="cpu"),
        "no-device": lambda: torch.ones(3),
        "view-of-host": lambda: torch.from_numpy(np.ones(6, dtype=np.float32)).view(2, 3)[0],
        "to(device)": lambda: torch.from_numpy(np.ones(3, dtype=np.float32)).to(device),
        "run": lambda: run.clone(),
    }
    out = {name: _outcome(lambda: dist.all_reduce(make()) or "ok") for name, make in cases.items()}
    out["checked"] = rules.checked
    return out


@pytest.mark.timeout(120)
def test_host_tensors_reaching_a_collective_are_refused_wherever_they_were_made():
    for result in run_ranks(_host_buffers, 2, timeout=100):
        refused = {k for k, v in result.items() if isinstance(v, str) and v.startswith("No backend type")}
        assert refused == {"from_numpy", "cpu()", "device-cpu", "no-device", "view-of-host"}, result
        assert result["to(device)"] == result["run"] == "ok" and result["checked"] >= 7


def _groups(rank, world_size, everyone):
    import torch.distributed as dist

    from tests import nccl_device_rule

    nccl_device_rule.install(timeout_s=5)
    pair = [0, 1] if rank < 2 else [2, 3]
    if everyone or rank < 2:
        return _outcome(lambda: dist.get_process_group_ranks(dist.new_group(pair, use_local_synchronization=True)))
    return None


@pytest.mark.slow  # the thread double shows the same rule in the fast tier (test_nccl_rules.py)
@pytest.mark.timeout(150)
def test_group_creation_is_a_collective_of_the_whole_world():
    assert run_ranks(_groups, 4, args=(True,), timeout=120) == [[0, 1], [0, 1], [2, 3], [2, 3]]
    alone = run_ranks(_groups, 4, args=(False,), timeout=120)
    assert alone[2:] == [None, None]
    assert all("new_group #0 (ranks [0, 1]) splits the world communicator" in r and "ranks [2, 3] did not" in r
               for r in alone[:2]), alone


def _reduce(rank, world_size, ops):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from tests import nccl_device_rule

    nccl_device_rule.install(timeout_s=20)
    t = torch.full((2,), float(rank + 1), device=torch.device("cpu"))
    op = getattr(dist.ReduceOp, ops[rank].upper())
    c10d = _outcome(lambda: dist.all_reduce(t, op=op) or t.tolist())
    functional = _outcome(lambda: funcol.all_reduce(torch.full((2,), float(rank + 1)).to(torch.device("cpu")),
                                                    ops[rank], dist.group.WORLD).tolist())
    return c10d, functional


@pytest.mark.slow  # the thread double shows the same rule in the fast tier (test_nccl_rules.py)
@pytest.mark.timeout(120)
def test_reduce_ops_must_agree_across_ranks():
    assert run_ranks(_reduce, 2, args=(["max", "max"],), timeout=100) == [([2.0, 2.0], [2.0, 2.0])] * 2
    for c10d, functional in run_ranks(_reduce, 2, args=(["sum", "max"],), timeout=100):
        assert "reduce ops differ in reduction #0" in c10d and "reduce ops differ in reduction #1" in functional


def _async_reads(rank, world_size):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from tests import nccl_device_rule

    nccl_device_rule.install(timeout_s=20)
    device = torch.device("cpu")
    out, inp = torch.zeros(2 * world_size, device=device), torch.full((2,), float(rank + 1), device=device)
    work = dist.all_gather_into_tensor(out, inp, async_op=True)
    inp.fill_(-5.0)  # a write after post: not what is sent
    before = out.clone()
    work.wait()
    summed = funcol.all_reduce(torch.full((2,), float(rank + 1), device=device), "sum", dist.group.WORLD)
    early = summed.elem.clone() if hasattr(summed, "elem") else None  # the result before anything waited on it
    return before.tolist(), out.tolist(), early, (summed * 1).tolist()


@pytest.mark.timeout(120)
def test_outputs_hold_poison_until_wait_and_inputs_are_read_at_post():
    import math

    for before, after, early, summed in run_ranks(_async_reads, 2, timeout=100):
        assert all(math.isnan(x) for x in before) and after == [1.0, 1.0, 2.0, 2.0]
        assert early is None or all(math.isnan(x) for x in early.tolist())
        assert summed == [3.0, 3.0]
