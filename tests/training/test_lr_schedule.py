import math

import pytest
import torch

from training.lr_schedule import build_lr_scheduler


@pytest.mark.parametrize("decay", ["linear", "cosine", "constant"])
def test_schedule_matches_closed_form(decay):
    peak, warmup, total, floor = 1e-3, 4, 20, 0.1
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = build_lr_scheduler(opt, warmup, total, decay, floor)
    seen = []
    for _ in range(total):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    for step, lr in enumerate(seen):
        if step < warmup:
            want = peak * (step + 1) / (warmup + 1)
        else:
            p = (step - warmup) / (total - warmup)
            shape = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "constant": None}[decay]
            want = peak if shape is None else peak * (floor + (1 - floor) * shape)
        assert lr == pytest.approx(want, rel=1e-12)
