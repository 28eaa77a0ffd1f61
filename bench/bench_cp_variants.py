"""Context-parallel variants side by side in one run: ring (zigzag), all-gather, Ulysses, hybrid, torch's native CP.

    .venv/bin/python bench/bench_cp_variants.py [--quick] [--seq N] [--reps N]

1. causal attention fwd+bwd at CP=2 and CP=4 for every variant and two head layouts (GQA 8/2 and MHA 8/8, head dim
   64, fp32): wall time of the slowest rank, CPU time of the busiest rank, peak memory per rank; ratios to our ring.
   torch's native CP (torch.distributed.tensor.experimental.context_parallel) runs on CPU through
   bench/native_cp_cpu.py, with its default all-gather rotation and with its true ring (all-to-all rotation).
2. ring overlap at CP=2: the ring's fwd+bwd step vs the same compute with the transfers replaced by local copies, and
   vs the same transfers with no compute: step / max(compute alone, comm alone).
3. what `cp_impl = "auto"` picks for each shape, next to the measured-fastest variant.
CP=2 runs 2 processes x 1 thread (= the 2 cores). CP=4 runs 4 x 1 on 2 cores, so its wall times are oversubscribed
(as a cp=4 job on this box would be); CPU time is then the cleaner figure. Reps interleave the variants and keep the
fastest, so load from other processes hits every variant alike.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_context_parallel import _max_over_ranks, _measure_peak, time_variants  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

MIB = 2 ** 20
OURS = ("ring", "allgather", "ulysses", "hybrid")
NATIVE = ("torch_allgather", "torch_ring")
TIE = 0.05  # variants this close in wall time swap places between runs of this benchmark on this box


def _inputs(shape, size, seed=0):
    batch, heads, kv_heads, seq, head_dim = shape
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    local = seq // size
    q = torch.randn(batch, heads, local, head_dim, generator=gen).requires_grad_()
    k, v = (torch.randn(batch, kv_heads, local, head_dim, generator=gen).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(batch, heads, local, head_dim, generator=gen)


def _ours_step(shape, impl):
    from parallelisms.context_parallel import ring_attention
    from parallelisms.cp.attention import allgather_attention
    from parallelisms.cp.exchange_hybrid import hybrid_attention
    from parallelisms.cp.exchange_ulysses import ulysses_attention
    size = dist.get_world_size()
    fn = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention,
          "hybrid": lambda *a, **kw: hybrid_attention(*a, ulysses_degree=2, **kw)}[impl]
    q, k, v, grad = _inputs(shape, size)

    def step():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v, dist.group.WORLD, is_causal=True).backward(grad)
    return step


def _native_step(shape, rotate):
    from torch.distributed.device_mesh import init_device_mesh

    from bench.native_cp_cpu import native_context_parallel
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v, grad = _inputs(shape, dist.get_world_size())

    def step():
        for t in (q, k, v):
            t.grad = None
        with native_context_parallel(mesh, shape[3], rotate):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=shape[1] != shape[2])
            out.backward(grad)
    return step


def _steps(shape, size):
    steps = {impl: _ours_step(shape, impl) for impl in OURS if impl != "hybrid" or size == 4}
    steps["torch_allgather"] = _native_step(shape, "allgather")
    steps["torch_ring"] = _native_step(shape, "alltoall")
    return steps


def variants(rank, size, shapes, reps):
    """{shape: {variant: (wall, cpu, peak bytes)}} and auto's choice per shape."""
    from parallelisms.cp.choice import Topology, choose_cp_impl
    results = {}
    for shape in shapes:
        steps = _steps(shape, size)
        times = time_variants(rank, size, steps, reps)
        peaks = {name: _max_over_ranks(_measure_peak(step)) for name, step in steps.items()}
        choice = choose_cp_impl(Topology.of(dist.group.WORLD, "cpu"), shape[1], shape[2], "zigzag", False, 4)
        results[shape] = ({name: (*times[name], peaks[name]) for name in steps}, choice.impl)
    return results


class _LocalLinks:
    """Stands in for the ring's point-to-point links: each received buffer is a local copy of the matching sent one
    (what a neighbour would send), so the ring computes exactly as usual and nothing is transferred."""

    def __init__(self, group):
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def exchange(self, send_next, recv_prev, tag=0):
        for send, recv in zip(send_next, recv_prev):
            recv.copy_(send)
        return []


def _ring_comm_only(k, v, group):
    """The ring's transfers for one fwd+bwd, nothing computed, posted as cp/exchange_ring.py posts them: P-1 K/V hops
    forward; backward, one exchange per step (the float32 dK/dV accumulator after the first step, the K/V hop before
    the last) and the final return hop."""
    from parallelisms.comm import RingLinks, wait_all
    from parallelisms.cp.rows import pack_kv
    links = RingLinks(group)
    size = links.size
    kv = pack_kv(k, v)
    dkv = torch.zeros(kv.numel(), dtype=torch.float32)
    for _ in range(size - 1):
        wait_all(links.exchange([kv], [torch.empty_like(kv)]))
    for step in range(size):
        sends, receives = [], []
        if step > 0:
            sends.append(dkv)
            receives.append(torch.empty_like(dkv))
        if step < size - 1:
            sends.append(kv)
            receives.append(torch.empty_like(kv))
        wait_all(links.exchange(sends, receives))
    wait_all(links.exchange([dkv], [torch.empty_like(dkv)]))


def ring_overlap(rank, size, shape, reps):
    import parallelisms.cp.exchange_ring as ring_module
    step = _ours_step(shape, "ring")
    _, k, v, _ = _inputs(shape, size)
    real_links = ring_module.RingLinks

    def compute_only():
        ring_module.RingLinks = _LocalLinks
        try:
            step()
        finally:
            ring_module.RingLinks = real_links
    return time_variants(rank, size, {"step": step, "compute": compute_only,
                                      "comm": lambda: _ring_comm_only(k.detach(), v.detach(), dist.group.WORLD)},
                         reps)


def profile_rings(rank, size, shape):
    """Rank 0's torch.profiler table (self CPU time) of one fwd+bwd of our ring and of torch's native ring."""
    from torch.profiler import ProfilerActivity, profile
    tables = {}
    for name, step in (("ours (ring, zigzag)", _ours_step(shape, "ring")),
                       ("torch native ring (alltoall rotation)", _native_step(shape, "alltoall"))):
        step()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14,
                                                 max_name_column_width=55)
    return tables


class OtherLoad:
    """Mean number of runnable tasks that are not ours while a phase runs (/proc/loadavg's running count, sampled
    every 0.5 s, minus this poller and our `own` busy threads): > 0.5 means other work shared the cores."""

    def __init__(self, own: int):
        self.own, self.samples, self._stop = own, [], threading.Event()

    def _poll(self):
        while not self._stop.wait(0.5):
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
            self.samples.append(max(0, running - 1 - self.own))

    def __enter__(self):
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return sum(self.samples) / max(1, len(self.samples))


def _print_variants(size, results, load):
    print(f"\n## CP={size}: causal attention fwd+bwd, fp32 (B, Hq, Hkv, S, D); ratios are to our ring; other "
          f"runnable tasks {load:.1f}{' (> 0.5: wall times disturbed, see the CPU columns)' if load > 0.5 else ''}")
    print("| shape | variant | wall s | wall / ring | CPU s (busiest rank) | CPU / ring | peak MiB/rank | mem / ring |")
    print("|---|---|---|---|---|---|---|---|")
    fastest = {}
    for shape, (rows, auto) in results.items():
        ring = rows["ring"]
        for name, (wall, cpu, peak) in rows.items():
            print(f"| {shape} | {name} | {wall:.3f} | {wall / ring[0]:.2f} | {cpu:.3f} | {cpu / ring[1]:.2f} | "
                  f"{peak / MIB:.1f} | {peak / max(ring[2], 1):.2f} |")
        ours = {n: r for n, r in rows.items() if n in OURS}
        fastest[shape] = (min(ours, key=lambda n: ours[n][0]), min(ours, key=lambda n: ours[n][1]), auto)
    for shape, (by_wall, by_cpu, auto) in fastest.items():
        rows = results[shape][0]
        gap = rows[auto][0] / rows[by_wall][0] - 1
        verdict = "yes" if auto == by_wall else f"tie ({gap:.1%} slower)" if gap <= TIE else f"NO ({gap:.1%} slower)"
        print(f"auto at CP={size} {shape}: picks {auto}; fastest of ours by wall {by_wall}, by CPU {by_cpu}: "
              f"auto picks the wall-fastest: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="seq 2048 and 2 reps (a couple of minutes)")
    parser.add_argument("--seq", type=int, default=None, help="global sequence length (default 8192)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="also print rank 0's profile of our ring and torch's")
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file (for "
                        "bench/plot_cp_variants.py)")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # freed tensors leave the resident set at once
    seq = args.seq or (2048 if args.quick else 8192)
    reps = args.reps or (2 if args.quick else 5)
    # long GQA (Llama 3's 4:1) and MHA (the CPU-sized model's attention), then two short, latency-bound shapes: the
    # debug model's attention (batch 8, seq 512, 16 heads of 16) and a short GQA one
    shapes = [(1, 8, 2, seq, 64), (1, 8, 8, seq, 64), (8, 16, 16, 512, 16), (4, 8, 2, 1024, 64)]
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"command: {' '.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])}")
    with OtherLoad(own=2) as load2:
        cp2 = run_ranks(variants, 2, args=(shapes, reps), threads=1, timeout=3600)[0]
    with OtherLoad(own=2) as load_overlap:
        overlap = run_ranks(ring_overlap, 2, args=(shapes[0], reps), threads=1, timeout=3600)[0]
    with OtherLoad(own=4) as load4:
        cp4 = run_ranks(variants, 4, args=(shapes, reps), threads=1, timeout=3600)[0]
    _print_variants(2, cp2, load2.mean)
    _print_variants(4, cp4, load4.mean)
    step, compute, comm = overlap["step"], overlap["compute"], overlap["comm"]
    print(f"\n## ring overlap at CP=2, shape {shapes[0]}; other runnable tasks {load_overlap.mean:.1f}")
    print("| measure | wall s | CPU s (busiest rank) |\n|---|---|---|")
    for name, (wall, cpu) in (("ring step (fwd+bwd)", step), ("compute alone (transfers -> local copies)", compute),
                              ("communication alone (same transfers)", comm)):
        print(f"| {name} | {wall:.3f} | {cpu:.3f} |")
    print(f"| step / max(compute, comm) | {step[0] / max(compute[0], comm[0]):.3f} | goal <= 1.15 |")
    if args.profile:
        for name, table in run_ranks(profile_rings, 2, args=(shapes[0],), threads=1, timeout=3600)[0].items():
            print(f"\n### profile, CP=2 rank 0, {shapes[0]}: {name}\n{table}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv[1:]), "overlap": overlap, "load": [load2.mean, load4.mean],
                       "variants": {size: [{"shape": list(shape), "auto": auto, "rows": rows}
                                           for shape, (rows, auto) in results.items()]
                                    for size, results in ((2, cp2), (4, cp4))}}, f, indent=1)
    for size, results in ((2, cp2), (4, cp4)):
        rows = results[shapes[0]][0]
        print(f"our ring / torch native ring at CP={size} GQA: wall {rows['ring'][0] / rows['torch_ring'][0]:.3f}, "
              f"CPU {rows['ring'][1] / rows['torch_ring'][1]:.3f} (goal <= 0.8 at CP=2); our ring / torch "
              f"all-gather CP: wall {rows['ring'][0] / rows['torch_allgather'][0]:.3f}")


if __name__ == "__main__":
    main()
