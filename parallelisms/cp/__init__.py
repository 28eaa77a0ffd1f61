"""Context parallelism, one family (parallelisms/context_parallel.py is its façade; read top to bottom):

  names     layouts.py (layout + implementation constants, fixed positions)  groups.py  counters.py  rows.py
  plan      plan_layout.py (DOCUMENTS placement) -> plan_sharding.py (shard/unshard) -> plan_piece.py / plan_pieces.py
            (blocks cut into mask-free pieces, DocumentShards) ; plan_host.py (the same plan, made in data workers)
  kernels   kernel_blocks.py (one piece) ; kernel_varlen.py (a block in <= 2 varlen calls) ; kernel_calls.py (the two,
            for one block) -> accumulators.py (log-sum-exp merges) ; block_spec.py, checks.py (what a call fixes)
  exchanges exchange_ring.py, exchange_allgather.py (dense) ; exchange_ring_sparse.py, exchange_allgather_sparse.py
            (DOCUMENTS: only visible rows) ; exchange_alltoall.py -> exchange_ulysses.py, exchange_hybrid.py
  autograd  autograd.py wraps a (forward, backward) pair ; attention.py: ring/allgather entries + BLOCK_EXCHANGES
  choice    choice.py: `auto`'s rule and ROUTES, the one table keyed by (implementation, layout kind)
"""
