"""The per-rank data loader: an endless, seeded stream of packed rows, split across data-parallel ranks.

The stream. Packed rows (data/packing.py) are numbered globally: global row g is row
`permutation(seed, epoch)[g % rows_per_epoch]` of epoch `g // rows_per_epoch`, a fresh permutation per epoch. Global
batch b is rows [b*G, (b+1)*G) with G = local_batch_size * dp_size, and dp rank r takes the slice
[b*G + r*L, b*G + (r+1)*L) with L = local_batch_size. Context- and tensor-parallel ranks of one dp rank build the
loader with the same dp_rank and therefore get the same rows. Nothing depends on the world size except that split,
so any mesh reads the same global stream.

The checkpoint. `state_dict()` is {"global_rows_consumed": N, ...}: the number of rows of the GLOBAL stream handed out
so far, i.e. the start of the next global batch. Every dp rank reports the same N (they advance in lock step), so any
rank's copy restores any other rank. `load_state_dict()` sets N and the next `iter(loader)` starts the global stream at
row N, cutting it with the new loader's own (local_batch_size, dp_size). Resuming on a different number of dp ranks
or a different local batch therefore continues exactly where the global stream stopped: no row is repeated or skipped.
The count is only meaningful for the same corpus, tokenizer, seq_len and seed (the stream's definition); the state
records seq_len and seed for that reason but does not forbid changing them (a later stage may change seq_len on
purpose, and then simply continues at the same row count of its own stream).

Counting happens in the main process when a batch is handed to the caller, so it is exact with any num_workers
(prefetched but unconsumed batches are not counted). Each `iter(loader)` continues from the current count.
"""
from __future__ import annotations

import multiprocessing
import sys
import warnings

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from data.packing import PackedRows, pack_documents
from data.niah import NiahRows
from data.passkey import PasskeyRows
from config import RecipeError
from config.schema import MIN_SEQ_LEN

_ROW_SHUFFLE_STREAM = 1  # keeps the row permutations' random stream apart from anything else seeded by `seed`


def row_permutation(seed: int, epoch: int, rows_per_epoch: int) -> np.ndarray:
    """The order in which epoch `epoch` visits the rows."""
    return np.random.default_rng([_ROW_SHUFFLE_STREAM, seed, epoch]).permutation(rows_per_epoch)


class GlobalRowStream(torch.utils.data.Dataset):
    """Map-style view of the endless stream: index g (a global row number) -> that row's int64 tensors."""

    def __init__(self, packed: PackedRows, seed: int):
        self.packed = packed
        self.seed = seed
        self._cached_epoch = (-1, np.empty(0, dtype=np.int64))  # the last permutation used, per process

    def row_of(self, global_row: int) -> int:
        """Which packed row global row `global_row` is (synthetic sources, already random, are read in order)."""
        if not getattr(self.packed, "needs_shuffle", True):
            return global_row % self.packed.num_rows
        epoch, offset = divmod(global_row, self.packed.num_rows)
        if self._cached_epoch[0] != epoch:
            self._cached_epoch = (epoch, row_permutation(self.seed, epoch, self.packed.num_rows))
        return int(self._cached_epoch[1][offset])

    def __getitem__(self, global_row: int) -> dict[str, torch.Tensor]:
        if hasattr(self.packed, "row_at"):  # a mixture places its rows itself (data/mixture.py)
            fields = self.packed.row_at(global_row)
        else:
            fields = self.packed.row_fields(self.row_of(global_row))
        return {name: torch.from_numpy(values) for name, values in fields.items()}


class DataParallelBatchSampler:
    """Yields this dp rank's list of global row numbers for each global batch, starting at global row `start_row`."""

    def __init__(self, local_batch_size: int, dp_rank: int, dp_size: int):
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.start_row = 0

    @property
    def global_batch_rows(self) -> int:
        return self.local_batch_size * self.dp_size

    def __iter__(self):
        return self._batches(self.start_row)  # bind start_row now, not at the first next()

    def _batches(self, start_row: int):
        first = start_row + self.dp_rank * self.local_batch_size
        while True:
            yield list(range(first, first + self.local_batch_size))
            first += self.global_batch_rows


def worker_start_method() -> str | None:
    """How a rank starts its data workers: forked on Linux, whatever started the rank (torchrun, a test's forkserver,
    a Python whose default is forkserver, as 3.14's is). A forked worker has the rank's imports already; one started
    by a forkserver or spawn imports torch and the trainer again first, ~1.5 s of one core per worker and loader
    (a 4-rank debug run starts 4, again on every stage and resume). The workers only read the corpus and build host
    plans, never the device, so forking a rank that has started CUDA is safe here, as for torch's own default on
    Linux. Elsewhere (macOS, Windows) the platform's default stays."""
    return "fork" if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods() else None


class PackedRowLoader(StatefulDataLoader):
    """A StatefulDataLoader whose checkpoint state is the global number of rows consumed (see module docstring)."""

    def __init__(self, dataset: GlobalRowStream, batch_sampler: DataParallelBatchSampler, num_workers: int = 0,
                 collate_fn=None, pin_memory: bool = False, worker_init_fn=None):
        """`collate_fn` runs in the workers (training/batch_plans.py makes each step's plans there); the batch
        sampler's `global_batch_rows` is what one yielded item counts as consumed. `worker_init_fn(worker_id)`
        runs first in each worker (the trainer's makes workers ignore the signals their rank saves on)."""
        with warnings.catch_warnings():  # torchdata 0.11 calls a torch API that torch 2.13 deprecates; not ours
            warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")
            super().__init__(dataset, batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                             pin_memory=pin_memory, worker_init_fn=worker_init_fn,
                             multiprocessing_context=worker_start_method() if num_workers else None)
        self.packed = dataset.packed
        self.global_rows_consumed = 0

    @property
    def rows_per_epoch(self) -> int:
        return self.packed.num_rows

    @property
    def num_tokens(self) -> int:
        """Tokens in the tokenized corpus (one EOS per document included), before any repetition."""
        return self.packed.corpus_tokens

    @property
    def tokens_per_epoch(self) -> int:
        """Input tokens in one pass over every row."""
        return self.packed.tokens_per_epoch

    def __iter__(self):
        self.batch_sampler.start_row = self.global_rows_consumed
        return _CountingIterator(super().__iter__(), self)

    def state_dict(self) -> dict:
        return {"global_rows_consumed": self.global_rows_consumed, "seq_len": self.packed.seq_len,
                "seed": self.dataset.seed, "rows_per_epoch": self.packed.num_rows}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict({})  # drops any live iterator; the next iter() starts from the loaded count
        if state_dict:
            self.global_rows_consumed = int(state_dict["global_rows_consumed"])


class _CountingIterator:
    """Counts each batch handed to the caller as one global batch consumed."""

    def __init__(self, batches, loader: PackedRowLoader):
        self._batches = batches
        self._loader = loader

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self._batches)
        self._loader.global_rows_consumed += self._loader.batch_sampler.global_batch_rows
        return batch


def build_dataloader(tokenizer, documents: list[str] | None, *, seq_len: int, local_batch_size: int, dp_rank: int,
                     dp_size: int, seed: int, document_masking: bool = False,
                     num_workers: int = 0, dataset: str = "text", rows=None) -> PackedRowLoader:
    """This dp rank's loader of (local_batch_size, seq_len) int64 batches: `rows` (packed rows read from the token
    stores, data/sources.py) or `documents` packed in memory (dataset "text"), or synthetic passkey rows (dataset
    "passkey", data/passkey.py)."""
    if seq_len < MIN_SEQ_LEN:
        raise RecipeError(f"training.seq_len must be >= 2 (one input and one label token per row), got {seq_len}; "
                          f"set e.g. --training.seq_len 512.")
    if local_batch_size < 1:
        raise RecipeError(f"training.local_batch_size must be >= 1, got {local_batch_size}.")
    if num_workers < 0:
        raise RecipeError(f"data.num_workers must be >= 0, got {num_workers}.")
    if seed < 0:
        raise RecipeError(f"job.seed must be >= 0, got {seed}.")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
    if dataset == "passkey":
        packed = PasskeyRows(tokenizer, seq_len=seq_len, seed=seed)
    elif dataset == "niah":
        packed = NiahRows(tokenizer, seq_len=seq_len, seed=seed)
    elif rows is not None:
        packed = rows
    else:
        packed = pack_documents(tokenizer, documents, seq_len=seq_len, seed=seed, document_masking=document_masking)
    sampler = DataParallelBatchSampler(local_batch_size, dp_rank, dp_size)
    return PackedRowLoader(GlobalRowStream(packed, seed), sampler, num_workers=num_workers)
