"""Paged pool vs plain per-record tensors on a drifting, training-like workload.

Every step stores ``--records`` quantized records ``(lo float32, scale bfloat16, codes uint8)`` whose
byte sizes are log-normal (sigma ``--sigma``) around a median that changes every ``--phase-steps``
steps (1 MiB, 2 MiB, 0.5 MiB, then 1 MiB again, cycling; ``--scale`` multiplies them), at 2 or 4 bits.
``--workload iid`` draws every size afresh each step; ``--workload layered`` keeps each record's element
count for a whole phase and only flips bit-widths (see ``workload``). Backward then consumes them
in reverse order. One variant per growth policy plus the baseline, each in its own process so that
resident memory is comparable:

* ``pool:<policy>``: ``PagePool.store`` in forward; per record in backward ``borrow`` (zero-copy
  views of the pages, the way the hooks decode; a record spread over two chunks is gathered into
  the pool's scratch buffer) or, with ``--backward load``, ``load`` (a fresh gathered copy), then
  ``release``; ``end_step``. Policies (``--policies``): ``adaptive`` = ``AdaptiveGrowth()`` (the
  default: headroom kept between steps), ``tracking`` = ``TrackingGrowth()`` (the reservation follows
  each step's peak), ``tracking-dev2`` = ``TrackingGrowth(deviations=2)``, ``fixed`` = ``FixedGrowth(100 MiB)``.
* ``plain``: a fresh ``torch.empty`` per payload tensor + copy in forward (what a packer without a
  pool allocates), kept in a list, read in place in backward and freed at step end.

Reported, at the busiest moment of a step (after its forward), for the last step and as
mean / 5th percentile / min over every measured step:

* ``occupancy`` = pages in use / pages reserved (``used / reserved``: the target metric, >= 95 %);
* ``efficiency`` = payload bytes / reserved bytes: page tails and alignment count against it too;
  ``efficiency_held`` also counts the pool's scratch buffers (``borrow`` of records spread over two
  chunks) in the denominator; ``page_fill`` = payload / used. For ``plain`` the analogue of
  efficiency is payload / (RSS at that moment - RSS before the workload).
* the price of tracking the peak: bytes the pool maps (and faults in) per step, grow / shrink
  events per step.
* ``RSS growth after warm-up``: process RSS at the end of the last step minus at the end of the
  warm-up steps; the last phase has the warm-up phase's distribution, so a non-fragmenting store
  should come back to where it was. For the pool it splits into the growth of what the pool holds
  (chunks + borrow scratch buffers) and the growth outside it (e.g. ``load``'s fresh buffers).
* time per step (median over the measured steps): forward stores, backward (including ``end_step``),
  total; as wall time and as the process's CPU time (user + system: page faults and unmaps count,
  time spent waiting for a core on a shared machine does not).

    python benchmarks/bench_pool_fragmentation.py [--steps 2000] [--records 24]
        [--policies adaptive,tracking] [--workload iid|layered] [--scale 1.0] [--page-size 65536]
        [--out benchmarks/results/pool_fragmentation.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_json

from daftrain.budget.memory import format_bytes
from daftrain.pool import AdaptiveGrowth, FixedGrowth, PagePool, PoolConfig, TrackingGrowth
from daftrain.rss import current_rss_bytes

MIB = 1 << 20
PHASE_MEDIANS_MIB = (1.0, 2.0, 0.5, 1.0)
GROUP = 256
SOURCE_BYTES = 160 * MIB
MAX_RECORD = 16 * MIB
MIN_RECORD = 4 << 10


# -- the workload (shared with bench_pool_step_policy.py) ---------------------------------------------------


def workload(steps: int, records: int, phase_steps: int, sigma: float, seed: int, scale: float = 1.0,
             kind: str = "iid") -> tuple[np.ndarray, np.ndarray]:
    """Per step and record: payload bytes and bit-width (2 or 4).

    ``iid``: every size drawn afresh each step, log-normal around the phase's median (the per-step
    total then varies by ~sigma / sqrt(records)). ``layered``: like a network, record ``i`` has the
    same element count for a whole phase (drawn log-normal at the phase start, as the 4-bit size) and
    only its bit-width changes, each record flipping 2 <-> 4 bits with probability 5 % per step (the
    dynamic bit-width case).
    """
    rng = np.random.default_rng(seed)
    phase = (np.arange(steps) // phase_steps) % len(PHASE_MEDIANS_MIB)
    medians = np.asarray(PHASE_MEDIANS_MIB)[phase] * MIB * scale
    hi = min(MAX_RECORD * max(1.0, scale), SOURCE_BYTES // 2)
    if kind == "iid":
        sizes = rng.lognormal(np.log(medians)[:, None], sigma, size=(steps, records))
        bits = rng.choice(np.array([2, 4]), size=(steps, records))
        return np.clip(sizes, MIN_RECORD, hi).astype(np.int64), bits
    if kind != "layered":
        raise ValueError(f"unknown workload {kind!r}")
    sizes, bits = np.zeros((steps, records), np.int64), np.zeros((steps, records), np.int64)
    b = rng.choice(np.array([2, 4]), size=records)
    base = None
    for t in range(steps):
        if t % phase_steps == 0:
            base = rng.lognormal(np.log(medians[t]), sigma, size=records)
        b = np.where(rng.random(records) < 0.05, 6 - b, b)
        bits[t], sizes[t] = b, np.clip(base * b / 4, MIN_RECORD, hi)
    return sizes, bits


def make_source(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (SOURCE_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def payload(source: torch.Tensor, nbytes: int, bits: int, salt: int) -> tuple[torch.Tensor, ...]:
    """A ``(lo, scale, codes)`` payload of about ``nbytes`` bytes, as views into ``source``."""
    per_group = 6 + GROUP * bits // 8
    ng = max(1, int(nbytes) // per_group)
    codes_n = ng * GROUP * bits // 8
    off = (salt * 4096) % (SOURCE_BYTES - codes_n - 6 * ng - 64) // 64 * 64
    lo = source[off : off + 4 * ng].view(torch.float32)
    scale = source[off + 4 * ng : off + 6 * ng].view(torch.bfloat16)
    codes = source[off + 6 * ng + 2 : off + 6 * ng + 2 + codes_n].view(ng, GROUP * bits // 8)
    return (lo, scale, codes)


def payload_nbytes(pl: tuple[torch.Tensor, ...]) -> int:
    return sum(t.nbytes for t in pl)


def held_bytes(pool: PagePool | None) -> int:
    """What the pool holds of the process's memory: its chunks plus its borrow scratch buffers."""
    if pool is None:
        return 0
    s = pool.stats()
    return s.reserved_bytes + s.scratch_bytes


POLICIES = {
    "adaptive": AdaptiveGrowth,
    "tracking": TrackingGrowth,
    "tracking-dev2": lambda: TrackingGrowth(deviations=2.0),
    "fixed": lambda: FixedGrowth(100 * MIB),
}


def spread(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "p5": float(np.quantile(xs, 0.05)), "min": min(xs)}


# -- one variant ---------------------------------------------------------------------------------------------


def run_variant(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    sizes, bits = workload(args.steps, args.records, args.phase_steps, args.sigma, args.seed, args.scale,
                           args.workload)
    source = make_source(args.seed)
    pool = None
    if args.variant == "pool":
        pool = PagePool(PoolConfig(page_size=args.page_size, growth=POLICIES[args.policy]()))
    rss_start = current_rss_bytes()
    fwd, bwd, fwd_cpu, bwd_cpu, rss_trace, step_eff = [], [], [], [], [], []
    occ, eff_held, mapped, grows, shrinks = [], [], [], [], []
    rss_warm = reserved_warm = None
    peak: dict = {}
    for step in range(args.steps):
        last = step == args.steps - 1
        pls = [payload(source, sizes[step, i], bits[step, i], step * 131 + i) for i in range(args.records)]
        before = pool.stats() if pool is not None else None
        t0, c0 = time.perf_counter(), time.process_time()
        if pool is not None:
            recs = [pool.store(pl, importance=i / args.records) for i, pl in enumerate(pls)]
        else:
            kept = [tuple(torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in pl) for pl in pls]
        t1, c1 = time.perf_counter(), time.process_time()
        if step >= args.warmup:  # the busiest moment of every measured step
            payload_b = sum(payload_nbytes(pl) for pl in pls)
            if pool is not None:
                s = pool.stats()
                step_eff.append(s.payload_bytes / s.reserved_bytes)
                occ.append(s.occupancy)
                eff_held.append(s.payload_bytes / (s.reserved_bytes + s.scratch_bytes))
                # forward only grows (shrinking happens in end_step): what this step mapped
                mapped.append(s.reserved_bytes - before.reserved_bytes)
                grows.append(s.grow_events - before.grow_events)
            else:
                step_eff.append(payload_b / max(1, current_rss_bytes() - rss_start))
        if last:  # the busiest moment of the last step
            payload_b = sum(payload_nbytes(pl) for pl in pls)
            peak = {"payload_bytes": payload_b, "rss_above_start": current_rss_bytes() - rss_start}
            if pool is not None:
                s = pool.stats()
                peak.update(reserved_bytes=s.reserved_bytes, used_bytes=s.used_bytes,
                            scratch_bytes=s.scratch_bytes, occupancy=s.occupancy,
                            efficiency=s.payload_bytes / s.reserved_bytes,
                            efficiency_held=s.payload_bytes / (s.reserved_bytes + s.scratch_bytes),
                            page_fill=s.payload_bytes / s.used_bytes)
            else:
                peak.update(efficiency=payload_b / max(1, peak["rss_above_start"]))
        t2, c2 = time.perf_counter(), time.process_time()
        if pool is not None:
            for r in reversed(recs):
                if args.backward == "load":
                    r.load()
                else:
                    with r.borrow():
                        pass
                r.release()
            del recs
            pool.end_step()
        else:
            while kept:
                kept.pop()
        t3, c3 = time.perf_counter(), time.process_time()
        if step >= args.warmup:
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
            fwd_cpu.append(c1 - c0)
            bwd_cpu.append(c3 - c2)
            if pool is not None:
                shrinks.append(pool.stats().shrink_events - before.shrink_events)
        if step + 1 == args.warmup:
            rss_warm = current_rss_bytes()
            reserved_warm = held_bytes(pool)
        if (step + 1) % 100 == 0:
            rss_trace.append((step + 1, current_rss_bytes(), held_bytes(pool)))
    rss_end = current_rss_bytes()
    out = {
        "variant": args.variant,
        "peak_last_step": peak,
        "rss_start": rss_start,
        "rss_after_warmup": rss_warm,
        "rss_end": rss_end,
        "rss_growth_after_warmup": rss_end - rss_warm,
        "rss_max_in_trace": max(r for _, r, _ in rss_trace),
        "rss_trace": rss_trace,
        "efficiency_mean_over_steps": statistics.fmean(step_eff),
        "efficiency_min_over_steps": min(step_eff),
        "fwd_ms_median": 1e3 * statistics.median(fwd),
        "bwd_ms_median": 1e3 * statistics.median(bwd),
        "step_ms_median": 1e3 * statistics.median([a + b for a, b in zip(fwd, bwd, strict=True)]),
        "step_ms_mean": 1e3 * (sum(fwd) + sum(bwd)) / len(fwd),
        "fwd_cpu_ms_median": 1e3 * statistics.median(fwd_cpu),
        "bwd_cpu_ms_median": 1e3 * statistics.median(bwd_cpu),
        "step_cpu_ms_median": 1e3 * statistics.median([a + b for a, b in zip(fwd_cpu, bwd_cpu, strict=True)]),
        "payload_bytes_per_step_mean": float(sizes.sum(axis=1).mean()),
    }
    if pool is not None:
        s = pool.stats()
        reserved_end = held_bytes(pool)
        out.update(
            held_after_warmup=reserved_warm,
            held_end=reserved_end,
            scratch_bytes_end=s.scratch_bytes,
            rss_minus_held_growth=(rss_end - reserved_end) - (rss_warm - reserved_warm),
            grow_events=s.grow_events,
            shrink_events=s.shrink_events,
            peak_reserved_bytes=s.peak_reserved_bytes,
            policy=repr(POLICIES[args.policy]()),
            occupancy_over_steps=spread(occ),
            efficiency_over_steps=spread(step_eff),
            efficiency_held_over_steps=spread(eff_held),
            mapped_bytes_per_step_mean=statistics.fmean(mapped),
            grow_events_per_step_mean=statistics.fmean(grows),
            shrink_events_per_step_mean=statistics.fmean(shrinks),
        )
        pool.close()
    return out


# -- driver --------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--records", type=int, default=24)
    p.add_argument("--phase-steps", type=int, default=500)
    p.add_argument("--warmup", type=int, default=200, help="steps before RSS and time are measured")
    p.add_argument("--sigma", type=float, default=0.75)
    p.add_argument("--workload", choices=("iid", "layered"), default="iid")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the phase medians (1, 2, 0.5, 1 MiB); records are clipped at 16 MiB * scale "
                   "(80 MiB at most)")
    p.add_argument("--page-size", type=int, default=64 << 10)
    p.add_argument("--policies", default="adaptive,tracking",
                   help="comma-separated pool step policies, each run in its own process: " + ", ".join(POLICIES))
    p.add_argument("--policy", choices=tuple(POLICIES), help=argparse.SUPPRESS)  # one variant's policy
    p.add_argument("--backward", choices=("borrow", "load"), default="borrow",
                   help="how the pool variant reads records in backward")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: copies are small; a parallel copy on a busy machine stalls)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", choices=("pool", "plain"), help=argparse.SUPPRESS)
    p.add_argument("--out", default="benchmarks/results/pool_fragmentation.json")
    args = p.parse_args(argv)
    if not 0 < args.warmup < args.steps:
        p.error("--warmup must be in (0, --steps)")
    args.policy_names = [n.strip() for n in args.policies.split(",") if n.strip()]
    if not args.policy_names or any(n not in POLICIES for n in args.policy_names):
        p.error(f"--policies must name some of {list(POLICIES)}, got {args.policies!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    argv = list(argv if argv is not None else sys.argv[1:])
    results = {}
    for variant, policy in [*(("pool", n) for n in args.policy_names), ("plain", None)]:
        extra = ["--variant", variant] + (["--policy", policy] if policy else [])
        start = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, *argv, *extra], check=True, capture_output=True, text=True)
        name = f"pool:{policy}" if policy else "plain"
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        results[name]["wall_s"] = time.perf_counter() - start
    plain = results["plain"]
    pools = {k: v for k, v in results.items() if k != "plain"}
    targets = {
        k: {"occupancy_at_end_ge_95pct": r["peak_last_step"]["occupancy"] >= 0.95,
            "efficiency_at_end_ge_95pct": r["peak_last_step"]["efficiency"] >= 0.95,
            "occupancy_mean_over_steps_ge_95pct": r["occupancy_over_steps"]["mean"] >= 0.95,
            "rss_growth_after_warmup_le_0": r["rss_growth_after_warmup"] <= 0}
        for k, r in pools.items()
    }
    print(f"\n{args.workload} workload, {args.steps} steps x {args.records} records, scale {args.scale}, "
          f"page {args.page_size} B, backward {args.backward}, "
          f"mean payload {format_bytes(plain['payload_bytes_per_step_mean'])}/step, "
          f"measured over steps {args.warmup}..{args.steps}")

    def over(r, key):
        d = r[key]
        return f"{d['mean']:.1%} / {d['p5']:.1%} / {d['min']:.1%}"

    def ms(r, a, b):
        return f"{r[a]:.2f} / {r[b]:.2f}"

    rows = [
        ("occupancy at last peak (used/reserved)", lambda r: f"{r['peak_last_step']['occupancy']:.1%}", "-"),
        ("efficiency at last peak (payload/reserved)", lambda r: f"{r['peak_last_step']['efficiency']:.1%}",
         f"{plain['peak_last_step']['efficiency']:.1%} (of RSS)"),
        ("  payload/(reserved+scratch)", lambda r: f"{r['peak_last_step']['efficiency_held']:.1%}", "-"),
        ("  page fill (payload/used)", lambda r: f"{r['peak_last_step']['page_fill']:.1%}", "-"),
        ("occupancy at each peak, mean/p5/min", lambda r: over(r, "occupancy_over_steps"), "-"),
        ("efficiency at each peak, mean/p5/min", lambda r: over(r, "efficiency_over_steps"),
         f"{plain['efficiency_mean_over_steps']:.1%} / - / {plain['efficiency_min_over_steps']:.1%}"),
        ("RSS growth after warm-up", lambda r: format_bytes(r["rss_growth_after_warmup"]),
         format_bytes(plain["rss_growth_after_warmup"])),
        ("  of which the pool's chunks + scratch", lambda r: format_bytes(r["held_end"] - r["held_after_warmup"]),
         "-"),
        ("  of which outside the pool", lambda r: format_bytes(r["rss_minus_held_growth"]), "-"),
        ("max RSS (sampled every 100 steps)", lambda r: format_bytes(r["rss_max_in_trace"]),
         format_bytes(plain["rss_max_in_trace"])),
        ("peak reserved", lambda r: format_bytes(r["peak_reserved_bytes"]), "-"),
        ("mapped per step (faulted in)", lambda r: format_bytes(r["mapped_bytes_per_step_mean"]), "-"),
        ("grow / shrink events per step", lambda r: f"{r['grow_events_per_step_mean']:.2f} / "
         f"{r['shrink_events_per_step_mean']:.2f}", "-"),
        ("grow / shrink events, total", lambda r: f"{r['grow_events']} / {r['shrink_events']}", "-"),
        ("fwd / bwd ms, median wall", lambda r: ms(r, "fwd_ms_median", "bwd_ms_median"),
         ms(plain, "fwd_ms_median", "bwd_ms_median")),
        ("fwd / bwd ms, median CPU", lambda r: ms(r, "fwd_cpu_ms_median", "bwd_cpu_ms_median"),
         ms(plain, "fwd_cpu_ms_median", "bwd_cpu_ms_median")),
        ("step ms, median wall / CPU", lambda r: ms(r, "step_ms_median", "step_cpu_ms_median"),
         ms(plain, "step_ms_median", "step_cpu_ms_median")),
        ("wall time of the run", lambda r: f"{r['wall_s']:.1f} s", f"{plain['wall_s']:.1f} s"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'':{w}}  " + "  ".join(f"{k:>24}" for k in pools) + f"  {'plain tensors':>24}")
    for name, f, b in rows:
        print(f"{name:{w}}  " + "  ".join(f"{f(r):>24}" for r in pools.values()) + f"  {b:>24}")
    for k, t in targets.items():
        print(f"{k}: " + ", ".join(f"{n} {'yes' if v else 'NO'}" for n, v in t.items()))
    skip = ("variant", "policy", "policy_names")
    write_json(args.out, {"args": {k: v for k, v in vars(args).items() if k not in skip},
                          "targets": targets, "results": results})


if __name__ == "__main__":
    main()
