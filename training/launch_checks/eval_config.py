"""Which evaluations a ramp stage runs: the launch check (training/launch_checks/preflight.py) checks each stage
with them on, and the dry run measures them (training/planning/eval_memory.py).

A stage's evaluations are those the trainer runs while the stage is current: long-document loss and NIAH at every
`*_interval` step inside the stage, and all enabled evaluations at the last step (passkey only there).
"""
from __future__ import annotations

import dataclasses

from config.schema import Config


def _due_inside(interval: int, start_step: int, end_step: int) -> bool:
    """A multiple of `interval` among the steps the stage completes, start_step + 1 .. end_step."""
    return interval > 0 and end_step // interval > start_step // interval


def stage_eval_config(stage, last: bool) -> Config:
    """The stage's Config with only the evaluations it runs left on (passkey at the last stage only; long-document
    loss and NIAH where their interval falls inside the stage, and at the last stage)."""
    e = stage.cfg.eval
    long_doc = e.long_doc_loss and (last or _due_inside(e.long_doc_interval, stage.start_step, stage.end_step))
    niah = e.niah and (last or _due_inside(e.niah_interval, stage.start_step, stage.end_step))
    passkey = e.passkey and last  # and its evaluations during training (passkey_interval, passkey_stop_at/_mean)
    runs = dataclasses.replace(e, passkey=passkey, passkey_interval=e.passkey_interval if passkey else 0,
                               passkey_stop_at=e.passkey_stop_at if passkey else 0.0,
                               passkey_stop_mean=e.passkey_stop_mean if passkey else 0.0, long_doc_loss=long_doc,
                               niah=niah)
    return dataclasses.replace(stage.cfg, eval=runs)
