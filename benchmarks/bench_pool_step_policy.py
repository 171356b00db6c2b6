"""Pool growth policies under a byte cap: DAF's fixed 100 MB steps vs adaptive growth.

The drifting workload of ``bench_pool_fragmentation.py`` (log-normal record sizes whose median moves
every ``--phase-steps`` steps: 1, 2, 0.5, 1 MiB) runs against a ``PagePool`` capped at ``--max-mib``
(``PoolConfig.max_bytes``), small enough that the 2 MiB phase does not fit. Record ``i`` of a step gets importance
``i / records`` (the last saved is needed first by backward, so it matters most); 4-bit records carry
a demote callback. Backward loads every record in reverse order (``load(page_in=False)``: a spilled
record is read from its file, not paged back in, since it is released right after), releases it, then
``end_step``.

The demote callback is *synthetic*: it keeps the first half of each group's code bytes (exactly the
size a 4 -> 2-bit re-quantization produces, without its cost: the policies are compared on memory,
not on kernel time; ``tests/pool/test_pool_eviction.py`` demotes with the real kernels).

Policies: ``fixed-100MiB`` = ``FixedGrowth(100 * 2**20)``, ``adaptive`` = ``AdaptiveGrowth()`` (defaults),
``adaptive-dev1`` = ``AdaptiveGrowth(deviations=1)`` (less headroom, more growth events),
``tracking`` = ``TrackingGrowth()`` (the reservation follows each step's peak in small granules and is
given back down to a floor at every step end), ``tracking-dev2`` = ``TrackingGrowth(deviations=2)``
(a lower floor: higher occupancy, more memory mapped per step).

Reported per policy: evictions (demotions + spills), page-ins, grow / shrink events, peak and mean
reserved bytes, mean occupancy (pages in use / reserved) and payload / reserved at each step's peak,
bytes mapped per step, time per step (wall and CPU).

    python benchmarks/bench_pool_step_policy.py [--steps 2000] [--max-mib 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_pool_fragmentation import MIB, make_source, payload, workload
from common import write_json

from daftrain.budget.memory import format_bytes
from daftrain.pool import AdaptiveGrowth, FixedGrowth, PagePool, PoolConfig, TrackingGrowth

POLICIES = {
    "fixed-100MiB": lambda: FixedGrowth(100 * MIB),
    "adaptive": lambda: AdaptiveGrowth(),
    "adaptive-dev1": lambda: AdaptiveGrowth(deviations=1.0),
    "tracking": lambda: TrackingGrowth(),
    "tracking-dev2": lambda: TrackingGrowth(deviations=2.0),
}


def halve_codes(pl: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
    """Synthetic 4 -> 2-bit demotion: same lo/scale, half the code bytes per group."""
    lo, scale, codes = pl
    if codes.shape[1] * 8 // 256 <= 2:
        return None
    return (lo, scale, codes[:, : codes.shape[1] // 2].contiguous())


def run_policy(name: str, args: argparse.Namespace, sizes, bits, source) -> dict:
    with tempfile.TemporaryDirectory(prefix="pool-bench-") as spill_dir:
        cfg = PoolConfig(page_size=args.page_size, max_bytes=args.max_mib * MIB,
                         growth=POLICIES[name](), spill_dir=spill_dir)
        pool = PagePool(cfg)
        times, cpu, reserved, effs, occs, mapped = [], [], [], [], [], []
        start = time.perf_counter()
        for step in range(args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            r0 = pool.stats().reserved_bytes
            recs = []
            for i in range(args.records):
                pl = payload(source, sizes[step, i], bits[step, i], step * 131 + i)
                demote = halve_codes if bits[step, i] == 4 else None
                recs.append(pool.store(pl, importance=i / args.records, demote=demote))
            s = pool.stats()
            effs.append(s.efficiency)
            occs.append(s.occupancy)
            reserved.append(s.reserved_bytes)
            mapped.append(s.reserved_bytes - r0)  # forward only grows
            for r in reversed(recs):
                r.load(page_in=False)  # backward's last use: read spilled records from their files
                r.release()
            del recs
            pool.end_step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        wall = time.perf_counter() - start
        s = pool.stats()
        pool.close()
    return {
        "policy": repr(POLICIES[name]()),
        "evictions": s.evictions, "demotions": s.demotions, "spills": s.spills, "page_ins": s.page_ins,
        "grow_events": s.grow_events, "shrink_events": s.shrink_events,
        "peak_reserved_bytes": s.peak_reserved_bytes, "peak_used_bytes": s.peak_used_bytes,
        "mean_reserved_at_peak_bytes": statistics.fmean(reserved),
        "occupancy_mean": statistics.fmean(occs),
        "efficiency_mean": statistics.fmean(effs),
        "mapped_bytes_per_step_mean": statistics.fmean(mapped),
        "step_ms_median": 1e3 * statistics.median(times), "step_ms_mean": 1e3 * statistics.fmean(times),
        "step_cpu_ms_median": 1e3 * statistics.median(cpu),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--records", type=int, default=24)
    p.add_argument("--phase-steps", type=int, default=500)
    p.add_argument("--sigma", type=float, default=0.75)
    p.add_argument("--workload", choices=("iid", "layered"), default="iid")
    p.add_argument("--max-mib", type=int, default=64, help="the pool's byte cap (PoolConfig.max_bytes), MiB")
    p.add_argument("--page-size", type=int, default=64 << 10)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of: " + ", ".join(POLICIES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/pool_step_policy.json")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        p.error(f"unknown policies {unknown}; choose from {list(POLICIES)}")
    torch.set_num_threads(args.threads)
    sizes, bits = workload(args.steps, args.records, args.phase_steps, args.sigma, args.seed, kind=args.workload)
    source = make_source(args.seed)
    demand = sizes.sum(axis=1)
    print(f"\n{args.workload} workload, {args.steps} steps x {args.records} records, max_bytes {args.max_mib} MiB, "
          f"payload/step mean {format_bytes(demand.mean())}, max {format_bytes(demand.max())}")
    results = {name: run_policy(name, args, sizes, bits, source) for name in names}
    cols = [
        ("evictions", lambda r: str(r["evictions"])),
        ("demote/spill", lambda r: f"{r['demotions']}/{r['spills']}"),
        ("page-ins", lambda r: str(r["page_ins"])),
        ("grow/shrink", lambda r: f"{r['grow_events']}/{r['shrink_events']}"),
        ("peak reserved", lambda r: format_bytes(r["peak_reserved_bytes"])),
        ("mean reserved", lambda r: format_bytes(r["mean_reserved_at_peak_bytes"])),
        ("used/reserved", lambda r: f"{r['occupancy_mean']:.1%}"),
        ("payload/reserved", lambda r: f"{r['efficiency_mean']:.1%}"),
        ("mapped/step", lambda r: format_bytes(r["mapped_bytes_per_step_mean"])),
        ("ms/step wall/CPU", lambda r: f"{r['step_ms_median']:.1f}/{r['step_cpu_ms_median']:.1f}"),
    ]
    w = max(len(n) for n in names)
    print(f"{'policy':{w}}  " + "  ".join(f"{c:>16}" for c, _ in cols))
    for name, r in results.items():
        print(f"{name:{w}}  " + "  ".join(f"{f(r):>16}" for _, f in cols))
    write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
