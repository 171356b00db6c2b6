"""``BudgetedStep``'s compression levers at one budget: fixed bits, bits by importance, a page pool.

On this CPU the planner takes no compressed plan at the budgets of ``bench_budget.py`` (the kernels'
own memory, ``PlannerConfig.compression_reserve``, costs more room than compression gives). This
benchmark restricts the planner to 2-bit plans with no reserve, so that every step runs compressed, and
compares, at the same budget, what each lever costs and whether the step stays under the budget:

* ``exact``: the default planner (exact plans here), for reference;
* ``2bit``: 2-bit plans, fixed bits;
* ``2bit_auto``: 2-bit plans with bits chosen by importance at the same bytes
  (``compression=CompressionConfig(bits="auto")``);
* ``2bit_pool`` and ``2bit_auto_pool``: the same through a ``PagePool`` under the plan's byte cap.

Budget: ``baseline + fraction * (plain_peak - baseline)`` as in ``bench_budget.py`` (plain's peak from a
fresh two-step process). One fresh, long-lived worker per variant: its first step (the planning step),
then ``--rounds`` rounds in which each worker runs one step in turn, the load average read every round.

    flock /tmp/daftrain-bench.lock python benchmarks/bench_levers.py [--fraction 0.25] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from bench_budget import BATCH, Worker, measure  # noqa: E402
from common import write_json  # noqa: E402

VARIANTS = {
    "exact": {},
    "2bit": {"bits": [2]},
    "2bit_auto": {"bits": [2], "auto": True},
    "2bit_pool": {"bits": [2], "pool": True},
    "2bit_auto_pool": {"bits": [2], "auto": True, "pool": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=sorted(BATCH))
    parser.add_argument("--fraction", type=float, default=0.25, help="budget fraction (default 0.25)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--out", default=str(HERE / "results" / "levers.json"))
    args = parser.parse_args()
    t0, B = time.time(), BATCH[args.model]
    plain = measure({"model": args.model, "batch": B, "method": "plain"}, [])
    base, peak = plain["baseline"], plain["peak"]
    budget = int(base + args.fraction * (peak - base))
    print(f"{args.model}: plain peak {peak / 1e6:.0f} MB, baseline {base / 1e6:.0f} MB, "
          f"budget {budget / 1e6:.0f} MB ({args.fraction})", flush=True)
    workers = {name: Worker({"model": args.model, "batch": B, "method": "daftrain", "budget": budget, **spec})
               for name, spec in VARIANTS.items()}
    for w in workers.values():
        w.ready()
    firsts = {name: w.step() for name, w in workers.items()}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg())
        for w in workers.values():
            w.step()
        print(f"  round {r + 1}/{args.rounds}, load average {loads[-1][0]:.2f}", flush=True)
    results, lines = {}, []
    for name, w in workers.items():
        r = w.end()
        steps = r["steps"]
        timed = [s["s"] for s in steps[1:]]
        results[name] = {
            "spec": VARIANTS[name], "error": r["error"], "process_peak": r["peak"],
            "first_step_s": firsts[name]["s"] if firsts[name] else None,
            "step_s": timed, "step_s_median": statistics.median(timed) if timed else None,
            "every_step_under_budget": bool(steps) and all(s["step_peak"] <= budget for s in steps),
            "process_peak_under_budget": r["peak"] is not None and r["peak"] <= budget,
            "pool_evictions": sum(s.get("pool_evictions", 0) for s in steps),
            "plans": [{k: s[k] for k in ("micro", "checkpointed", "bits")} for s in steps],
            "step_peaks": [s["step_peak"] for s in steps],
        }
    ref = results["2bit"]["step_s_median"]
    for name, res in results.items():
        res["step_s_over_2bit"] = res["step_s_median"] / ref if ref and res["step_s_median"] else None
        last = res["plans"][-1] if res["plans"] else {}
        lines.append(
            f"{name:<15} plan m={last.get('micro')} ck={last.get('checkpointed')} bits={last.get('bits')}  "
            f"step {res['step_s_median'] or 0:.2f} s ({res['step_s_over_2bit'] or 0:.3f}x 2bit)  "
            f"peak {(res['process_peak'] or 0) / 1e6:.0f} / {budget / 1e6:.0f} MB "
            f"{'under' if res['every_step_under_budget'] else 'OVER'}  evictions {res['pool_evictions']}"
            + (f"  ERROR {res['error'][:120]}" if res["error"] else ""))
    print("\n".join(lines))
    write_json(args.out, {
        "command": " ".join(["python", *sys.argv]), "model": args.model,
        "batch": B, "fraction": args.fraction, "budget_bytes": budget, "baseline_bytes": base,
        "plain_peak_bytes": peak, "rounds": args.rounds, "load_average_per_round": loads,
        "wall_s": time.time() - t0, "results": results, "table": lines,
    })


if __name__ == "__main__":
    main()
