"""Training within a memory budget: gradient accumulation vs checkpointing + accumulation vs daftrain's planner.

CIFAR-style ResNet-18 (3x32x32, batch 256) and GPT-2 small (from a config, seq 256, batch 8, eager
attention), Adam. Every configuration runs in a fresh process. Budgets are

    budget(f) = baseline + f * (plain_peak - baseline),   f in {0.5, 0.25, 0.125}

where ``baseline`` is what training holds before any activation: the process's RSS once model, batch
and runtime are loaded, plus gradients and Adam's two states (computed from the parameter sizes), and
``plain_peak`` is the peak RSS of plain PyTorch training at the full batch. Whole-process fractions
(f * plain_peak) are recorded too; where they fall below ``baseline`` no method can meet them, and
the JSON says so.

(a) accumulation: the largest power-of-two micro-batch whose measured peak fits (tried from the
    linear estimate ``f * batch`` downwards, a fresh process per try);
(b) every block checkpointed (non-reentrant) + accumulation, largest fitting micro-batch likewise;
(c) ``daftrain.BudgetedStep`` with the budget (planner chooses micro-batches, checkpoints, bits).

A budget-change run (ResNet-18) halves the headroom at one step and restores it later.

    nice -n 10 python benchmarks/bench_budget.py [--quick] [--models resnet18,gpt2_small]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
FRACTIONS = (0.5, 0.25, 0.125)
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # same allocator setting for every method


# -- child process -------------------------------------------------------------------------------------

def _case(name: str):
    import torch
    import torch.nn.functional as F

    from daftrain.budget.batching import token_count
    from daftrain.demo.models.resnet import resnet18
    from daftrain.demo.models.transformers_zoo import gpt2_lm

    torch.manual_seed(0)
    if name == "resnet18":
        model = resnet18(num_classes=10)
        batch = (torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,)))
        return model, batch, (lambda m, b: F.cross_entropy(m(b[0]), b[1])), None
    model = gpt2_lm(seed=0)
    ids = torch.randint(0, 50257, (8, 256), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, (lambda m, b: m(**b).loss), token_count("labels")


def child(spec: dict) -> dict:
    import torch

    from daftrain.budget.batching import balanced_sizes, batch_size, split_batch
    from daftrain.budget.memory import current_rss_bytes, peak_rss_bytes
    from daftrain.budget.segments import checkpointing, find_segments
    from daftrain.budget.step import BudgetedStep

    model, batch, loss_fn, count = _case(spec["model"])
    count = count or batch_size
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    params = sum(p.nbytes for p in model.parameters())
    rss0 = current_rss_bytes()
    baseline = rss0 + 3 * params  # + gradients + Adam's exp_avg and exp_avg_sq
    B = batch_size(batch)
    method = spec["method"]
    segments = find_segments(model)
    records = []

    def manual_step(m: int, ckpt: bool) -> float:
        opt.zero_grad(set_to_none=True)
        parts = split_batch(batch, balanced_sizes(B, -(-B // m)))
        counts = [float(count(p)) for p in parts]
        total, value = sum(counts), 0.0
        for p, c in zip(parts, counts, strict=True):
            with checkpointing(segments, list(segments) if ckpt else []):
                loss = loss_fn(model, p)
            (loss * (c / total)).backward()
            value += float(loss.detach()) * c / total
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value

    if method in ("daftrain", "change"):
        schedule = spec.get("schedule")
        state = {"i": 0}
        budget = (lambda: schedule[min(state["i"], len(schedule) - 1)]) if schedule else spec["budget"]
        step = BudgetedStep(model, loss_fn, opt, budget=budget, count=count)
        run = lambda: step(batch)  # noqa: E731
    else:
        m = B if method == "plain" else spec["micro"]
        run = lambda: manual_step(m, method == "ckpt")  # noqa: E731
    times, cpu, probe_s = [], [], None
    for i in range(spec["steps"] + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = run()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i == 0:
            probe_s = dt
        else:
            times.append(dt)
            cpu.append(dc)
        if method in ("daftrain", "change"):
            r = step.history[-1]
            records.append({"step": i, "budget": r.budget_bytes, "peak": r.peak_bytes, "start_rss": r.start_rss_bytes,
                            "step_s": dt, "micro_batch": r.plan.micro_batch_size,
                            "checkpointed": len(r.plan.checkpointed), "bits": r.plan.bits, "loss": loss})
            state["i"] = i + 1 if method == "change" else 0
    peak = step.process_peak_bytes if method in ("daftrain", "change") else peak_rss_bytes()
    out = {"loadavg_1min_after": os.getloadavg()[0], "peak_rss": peak, "baseline": baseline, "rss_before_step": rss0,
           "first_step_s": probe_s,
           "step_s": times, "samples_per_s": B * len(times) / sum(times) if times else None, "loss": loss,
           # CPU seconds of the whole process (all threads): far less sensitive than wall time to other
           # jobs sharing the machine's cores.
           "step_cpu_s": cpu, "samples_per_cpu_s": B * len(cpu) / sum(cpu) if cpu else None}
    if method in ("daftrain", "change"):
        out["plan"] = str(step.plan)
        out["steps"] = records
        out["alpha"] = step.alpha
    return out


# -- parent ---------------------------------------------------------------------------------------------

def spawn(spec: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=False)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return {"error": proc.stderr[-1500:], "spec": spec}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.time() - t0
    return res


def largest_fitting(model: str, method: str, budget: int, start: int, steps: int) -> dict:
    m, tries = start, []
    while True:
        r = spawn({"model": model, "method": method, "micro": m, "steps": steps})
        r["micro"] = m
        tries.append({"micro": m, "peak_rss": r.get("peak_rss")})
        fits = "peak_rss" in r and r["peak_rss"] <= budget
        print(f"    ({method}) micro {m}: peak {r.get('peak_rss', 0) / 1e6:.0f} MB vs budget {budget / 1e6:.0f} MB "
              f"{'fits' if fits else 'over'}; {r.get('samples_per_s') or 0:.2f} samples/s", flush=True)
        if fits or m == 1:
            r["fits"], r["tries"] = fits, tries
            return r
        m //= 2


def run_model(model: str, steps: int, batch: int, fractions: tuple[float, ...] = FRACTIONS) -> dict:
    print(f"{model}: plain", flush=True)
    plain = spawn({"model": model, "method": "plain", "steps": steps})
    base, peak = plain["baseline"], plain["peak_rss"]
    print(f"  plain peak {peak / 1e6:.0f} MB, baseline {base / 1e6:.0f} MB, {plain['samples_per_s']:.2f} samples/s",
          flush=True)
    out = {"plain": plain, "budgets": {}}
    for f in fractions:
        budget = int(base + f * (peak - base))
        print(f"  budget {f:g}: {budget / 1e6:.0f} MB", flush=True)
        m_a = max(1, 1 << (int(f * batch).bit_length() - 1)) if int(f * batch) >= 1 else 1
        a = largest_fitting(model, "accum", budget, m_a, steps)
        b = largest_fitting(model, "ckpt", budget, min(batch, 4 * m_a), steps)
        c = spawn({"model": model, "method": "daftrain", "budget": budget, "steps": steps})
        c["fits"] = "peak_rss" in c and c["peak_rss"] <= budget
        best_ab = max(x.get("samples_per_s") or 0 for x in (a, b) if x.get("fits")) if (
            a.get("fits") or b.get("fits")) else 0.0
        ratio = (c.get("samples_per_s") or 0) / best_ab if best_ab else None
        print(f"    (c) daftrain: peak {c.get('peak_rss', 0) / 1e6:.0f} MB {'fits' if c['fits'] else 'OVER'}; "
              f"{c.get('samples_per_s') or 0:.2f} samples/s; vs best of (a),(b): {ratio}", flush=True)
        if "plan" in c:
            print("      " + c["plan"].splitlines()[0], flush=True)
        out["budgets"][str(f)] = {
            "fraction": f, "budget_bytes": budget, "whole_process_fraction_bytes": int(f * peak),
            "whole_process_fraction_below_baseline": f * peak < base,
            "a_accumulation": a, "b_checkpoint_accumulation": b, "c_daftrain": c,
            "c_over_best_ab_throughput": ratio,
        }
    return out


def change_run(steps: int, base: int, peak: int) -> dict:
    high = int(base + 0.5 * (peak - base))
    low = int(base + 0.25 * (peak - base))
    n = max(6, steps * 3)
    third = n // 3
    schedule = [high] * third + [low] * third + [high] * (n - 2 * third)
    print(f"budget change: {high / 1e6:.0f} MB -> {low / 1e6:.0f} MB at step {third} -> back at {2 * third}",
          flush=True)
    r = spawn({"model": "resnet18", "method": "change", "schedule": schedule, "steps": n})
    r["schedule"] = schedule
    r["fits_every_step"] = all(s["peak"] <= s["budget"] for s in r.get("steps", []))
    return r


def plot(change: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = change["steps"]
    x = [s["step"] for s in steps]
    fig, ax = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax[0].step(x, [s["budget"] / 1e6 for s in steps], where="mid", label="budget")
    ax[0].plot(x, [s["peak"] / 1e6 for s in steps], "o-", label="peak RSS of step")
    ax[0].plot(x, [s["start_rss"] / 1e6 for s in steps], "x--", label="RSS at step start")
    ax[0].set_ylabel("MB")
    ax[0].legend()
    ax[0].set_title("ResNet-18 batch 256 under a changing budget (daftrain planner)")
    ax[1].plot(x, [s["step_s"] for s in steps], "o-")
    for s in steps:
        ax[1].annotate(f"m={s['micro_batch']},ck={s['checkpointed']},b={s['bits']}", (s["step"], s["step_s"]),
                       fontsize=6, rotation=30)
    ax[1].set_ylabel("step time (s)")
    ax[1].set_xlabel("step (0 includes planning)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(path: Path) -> None:
    """Add CPU-time throughput ratios and a table to an existing result file (``--summarize``)."""
    data = json.loads(path.read_text())
    lines, ratios = [], {}
    for name, res in data["results"].items():
        for f, row in res["budgets"].items():
            cfgs = {"a": row["a_accumulation"], "b": row["b_checkpoint_accumulation"], "c": row["c_daftrain"]}
            for k, r in cfgs.items():
                lines.append(f"{name:<11} {float(f):>6.3f} ({k}) micro {r.get('micro', '-')!s:>4} "
                             f"peak {r.get('peak_rss', 0) / 1e6:7.0f} MB / budget {row['budget_bytes'] / 1e6:6.0f} MB "
                             f"{'fits' if r.get('fits') else 'OVER'}  {r.get('samples_per_s') or 0:6.2f} samples/s  "
                             f"{r.get('samples_per_cpu_s') or 0:6.2f} samples/cpu-s")
            fit_ab = [x.get("samples_per_cpu_s") for x in (cfgs["a"], cfgs["b"]) if x.get("fits")]
            c = cfgs["c"].get("samples_per_cpu_s")
            if fit_ab and all(fit_ab) and c:
                ratios[f"{name}@{f}"] = c / max(fit_ab)
    data["c_over_best_ab_cpu_time_throughput"] = ratios
    data["table"] = lines
    path.write_text(json.dumps(data, indent=2, default=str))
    print("\n".join(lines))
    print("c / best(a, b), samples per CPU-second:", json.dumps(ratios, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--summarize", action="store_true", help="add CPU-time ratios and a table to --out")
    parser.add_argument("--quick", action="store_true", help="one timed step per configuration")
    parser.add_argument("--models", default="resnet18,gpt2_small")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 2; 1 quick)")
    parser.add_argument("--gpt2-fractions", default="0.5,0.25,0.125",
                        help="budget fractions for GPT-2 (each costs several slow steps on a small CPU)")
    parser.add_argument("--out", default=str(RESULTS / "budget.json"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child)), default=str))
        return
    if args.summarize:
        summarize(Path(args.out))
        return
    sys.path.insert(0, str(HERE))
    from common import write_json

    steps = args.steps or (1 if args.quick else 2)
    results, targets = {}, {}
    t0 = time.time()
    for name in args.models.split(","):
        fractions = FRACTIONS if name == "resnet18" else tuple(float(f) for f in args.gpt2_fractions.split(","))
        results[name] = run_model(name, steps, 256 if name == "resnet18" else 8, fractions)
        r = results[name]["budgets"]
        targets[name] = {
            "c_under_every_budget": all(v["c_daftrain"].get("fits") for v in r.values()),
            "ratio_at_12.5pct": r["0.125"]["c_over_best_ab_throughput"] if "0.125" in r else None,
            "target_ratio": 1.3,
        }
        targets[name]["ratio_target_met"] = (targets[name]["ratio_at_12.5pct"] or 0) >= 1.3
    change = None
    if "resnet18" in results:
        p = results["resnet18"]["plain"]
        change = change_run(steps, p["baseline"], p["peak_rss"])
        if "steps" in change:
            plot(change, RESULTS / "budget_change.png")
    write_json(args.out, {
        "definition": "budget(f) = baseline + f * (plain_peak - baseline); baseline = RSS with model, batch and "
                      "runtime loaded + gradients + Adam state (3 x parameter bytes); peaks are whole-process "
                      "VmHWM of a fresh process (daftrain: kept across its per-step resets); all processes run with "
                      "MALLOC_MMAP_THRESHOLD_=65536",
        "steps_timed": steps, "wall_s": time.time() - t0, "results": results, "budget_change": change,
        "targets": targets,
    })


if __name__ == "__main__":
    main()
