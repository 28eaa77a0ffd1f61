"""The batch travels with its plan (issue 27): the trainer's loader yields whole optimizer steps, each micro-batch
with everything the host must decide about it, made in the loader's worker processes one step ahead.

What a worker does per step (`StepPlanner`, the loader's collate_fn): stacks the step's rows (numpy), places them by
attention work over the data-parallel ranks and micro-steps when placement is on (data/placement.py, the same
`place_step` the training thread ran before), keeps this dp rank's micro-batches, and for the documents CP layout
makes each micro-batch's `BatchPlan` (parallelisms/cp/plan_host.py: positions, this CP rank's pieces and exchange rows,
in integer work units, so every rank makes the same plan); for the fixed layouts the batch's document ids kept on
the host (`HostDocumentIds`); at CP 1 the batch's packed sequences instead
(parallelisms/cp/packed_documents.py: cu_seqlens for one attention call per layer). The DataLoader pins it (pin_memory on CUDA); the step
moves it with non_blocking copies (`training/step.move_batch`) and hands it to context_parallel, so nothing in the
step plans or reads a device tensor back.

The rows are exactly the loader's: a step is `micro_steps` consecutive global micro-batches, as the training thread
read them one by one before; the checkpointed count of global rows consumed advances by a whole step per item handed
to the trainer (prefetched steps are not counted), so a resume continues at the same row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data.loader import PackedRowLoader
from data.placement import StepSlots, place_step
from parallelisms.cp.layouts import DOCUMENTS
from parallelisms.cp.packed_documents import PackedDocuments
from parallelisms.cp.plan_host import BatchPlan, HostDocumentIds


class StepBatchSampler:
    """Groups `micro_steps` consecutive batches of a per-micro-batch sampler into one list of rows per step."""

    def __init__(self, micro_sampler, micro_steps: int):
        self.micro_sampler, self.micro_steps = micro_sampler, micro_steps
        self.start_row = 0

    @property
    def global_batch_rows(self) -> int:
        """Global rows of one step (what the loader counts as consumed per item)."""
        return self.micro_sampler.global_batch_rows * self.micro_steps

    def __iter__(self):
        self.micro_sampler.start_row = self.start_row
        micro = iter(self.micro_sampler)
        while True:
            yield [row for _ in range(self.micro_steps) for row in next(micro)]


@dataclass(frozen=True)
class CpPlanning:
    """What a worker needs to plan the documents layout for this rank."""
    cp_size: int
    cp_rank: int
    cp_impl: str
    varlen: bool = False
    """Also plan the CUDA varlen calls' indices (a CUDA run: they then travel with the batch, kernel_varlen.py)."""
    documents_layout: bool = True
    """The documents load balancer: without a packed form at CP 1 the batch still gets its layout's plan."""

    def plan(self, document_ids: np.ndarray):
        """CP 1: the batch's packed sequences (cp/packed_documents.py: one attention call per layer) where the ids
        have that form; else the documents layout's BatchPlan, or for the fixed load balancers the ids themselves on
        the host (plan_host.HostDocumentIds: the step cuts its pieces from them without reading the device)."""
        if self.cp_size == 1:
            packed = PackedDocuments.from_ids(document_ids)
            if packed is not None:
                return packed
        if not self.documents_layout:
            return HostDocumentIds(torch.from_numpy(np.ascontiguousarray(document_ids)))
        return BatchPlan.build(document_ids, self.cp_size, self.cp_rank, self.cp_impl, varlen=self.varlen)


class StepPlanner:
    """The loader's collate_fn (runs in the workers): one step's rows -> {"micro_batches": [this dp rank's
    micro-batch dicts, each with its "plan" when `cp` is set], "whole_rows": placement fell back to whole rows}."""

    def __init__(self, micro_steps: int, slots: StepSlots | None, dp_rank: int, cp: CpPlanning | None):
        self.micro_steps, self.slots, self.dp_rank, self.cp = micro_steps, slots, dp_rank, cp

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict:
        fields = {name: np.stack([row[name].numpy() for row in rows]) for name in rows[0]}
        whole_rows = False
        if self.slots is not None:
            placement = place_step(fields, self.slots)
            whole_rows = placement.whole_rows
            micro = [{name: values[self.slots.of(m, self.dp_rank)] for name, values in placement.fields.items()}
                     for m in range(self.micro_steps)]
        else:
            per = len(rows) // self.micro_steps
            micro = [{name: values[m * per:(m + 1) * per] for name, values in fields.items()}
                     for m in range(self.micro_steps)]
        batches = []
        for values in micro:
            batch = {name: torch.from_numpy(np.ascontiguousarray(v)) for name, v in values.items()}
            plan = self.cp.plan(values["document_ids"]) if self.cp is not None else None
            if plan is not None:
                batch["plan"] = plan
            batches.append(batch)
        return {"micro_batches": batches, "whole_rows": whole_rows}


def step_loader(micro_loader: PackedRowLoader, micro_steps: int, slots: StepSlots | None, dp_rank: int,
                cp: CpPlanning | None, num_workers: int, pin_memory: bool, worker_init_fn=None) -> PackedRowLoader:
    """A loader of whole steps over the same row stream as `micro_loader` (built by training/build.py for this rank,
    or for the whole global micro-batch when placing by work), at the same count of rows consumed."""
    loader = PackedRowLoader(micro_loader.dataset, StepBatchSampler(micro_loader.batch_sampler, micro_steps),
                             num_workers=num_workers, collate_fn=StepPlanner(micro_steps, slots, dp_rank, cp),
                             pin_memory=pin_memory, worker_init_fn=worker_init_fn)
    loader.global_rows_consumed = micro_loader.global_rows_consumed
    return loader


def stage_step_loader(cfg, setup, micro_loader: PackedRowLoader, micro_steps: int, device_type: str,
                      pin_memory: bool, worker_init_fn=None) -> PackedRowLoader:
    """The loader of a stage's whole steps as the trainer runs it (`setup`: the stage's StepSetup): placed by work
    when the recipe places, each micro-batch with its documents plan when the step shards the sequence with document
    masking (the documents layout's, the fixed layouts' host ids, or at CP 1 the packed form). One function for the
    trainer and the step-sync probe (training/planning/step_sync_probe.py), so the probe counts the loader the
    trainer runs."""
    p, t, mesh = cfg.parallelism, cfg.training, setup.mesh
    slots = StepSlots(micro_steps, mesh.dims.dp, t.local_batch_size, t.seq_len) if cfg.data.places_by_work() else None
    cp, documents_layout = None, p.cp_load_balancer == DOCUMENTS
    if setup.shards_sequence and setup.document_masking:
        cp = CpPlanning(p.cp, mesh.cp_mesh.get_local_rank(), p.cp_impl, varlen=device_type == "cuda",
                        documents_layout=documents_layout)
    return step_loader(micro_loader, micro_steps, slots, mesh.dp_rank, cp, num_workers=max(1, cfg.data.num_workers),
                       pin_memory=pin_memory, worker_init_fn=worker_init_fn)
