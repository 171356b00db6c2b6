"""Training within a memory budget: ``BudgetedStep`` against accumulation, checkpointing and torch.compile.

CIFAR-style ResNet-18 (3x32x32, batch 256) and GPT-2 small (from a config, seq 256, batch 8, eager
attention, dropout 0 in every method: see ``DROPOUT``), Adam. Budgets are

    budget(f) = baseline + f * (plain_peak - baseline),   f in {0.5, 0.25, 0.125, 0.05}

where ``baseline`` is what training holds before any activation (the RSS once model, batch and runtime
are loaded, plus gradients and Adam's two states, 3 x the parameter bytes) and ``plain_peak`` the peak
RSS of plain PyTorch at the full batch. Peers, each at the largest power-of-two micro-batch whose
measured peak fits:

(a) gradient accumulation;
(b) every block checkpointed (non-reentrant) plus accumulation;
(c) ``torch.compile(model)`` with ``torch._functorch.config.activation_memory_budget = f`` plus
    accumulation;
(d) ``daftrain.BudgetedStep`` with the budget (it chooses micro-batches, checkpoints and bits).

Memory phase (plain and the peers): every try is a fresh process running two steps; its peak is the
kernel's high-water mark (VmHWM) over both, the first (with compilation) included. Timing phase: one
fresh, long-lived worker per configuration that fits (plain and (d) included), driven over a line
protocol: each worker's first step (compilation; (d)'s planning step), then rounds in which each
worker runs one step in turn, the load average read every round. (d) is checked at every step
(``StepRecord.peak_bytes``) and over its whole process (``process_peak_bytes``). As many workers run
together as their measured peaks fit ``--max-ram-gb`` (plain first, then budgets from the smallest);
each result names its group. Every process runs with the default allocator settings (``BudgetedStep``
sets glibc's mmap threshold itself, as a user gets it) and one inductor compile thread (so compilation
counts in the process's peak); the run has its own inductor cache, warmed for each compiled
configuration by a one-step process before the one that is measured.

    flock /tmp/daftrain-bench.lock python benchmarks/bench_budget.py [--quick] [--models resnet18,gpt2_small]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
FRACTIONS = (0.5, 0.25, 0.125, 0.05)
BATCH = {"resnet18": 256, "gpt2_small": 8}
PEERS = ("accum", "ckpt", "compile")
LABEL = {"plain": "plain", "accum": "(a)", "ckpt": "(b)", "compile": "(c)", "daftrain": "(d)"}
DROPOUT = ("0 in every method, for comparability: (c) must run without it (a reported PyTorch gradient bug "
           "with dropout under activation_memory_budget)")
ENV = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # default allocator settings
ENV["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
MEMORY_STEPS = 2


# -- worker process: one configuration, one step per "step" line on stdin -------------------------------

def _case(name: str, batch: int):
    import torch
    import torch.nn.functional as F

    from daftrain.budget.batching import token_count
    from daftrain.demo.models.resnet import resnet18
    from daftrain.demo.models.transformers_zoo import gpt2_lm

    torch.manual_seed(0)
    if name == "resnet18":
        data = (torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)))
        return resnet18(num_classes=10), data, (lambda m, b: F.cross_entropy(m(b[0]), b[1])), None
    ids = torch.randint(0, 50257, (batch, 256), generator=torch.Generator().manual_seed(0))
    return gpt2_lm(dropout=0.0, seed=0), {"input_ids": ids, "labels": ids}, (lambda m, b: m(**b).loss), \
        token_count("labels")


def levers(spec: dict) -> dict:
    """``BudgetedStep``'s optional levers a spec names (``bench_levers.py``): ``bits``, the planner's
    allowed bit-widths (with no compression reserve, so that compressed plans are taken where they fit);
    ``auto``, bits by importance at the plan's bytes; ``pool``, a ``PagePool`` under the plan's cap;
    ``tune_allocator``, glibc's mmap threshold fixed from the start (``BudgetedStep(tune_allocator=True)``)."""
    from daftrain import CompressionConfig, PagePool, PlannerConfig, PoolConfig

    out: dict = {}
    if spec.get("bits"):
        out["config"] = PlannerConfig(bits=tuple(spec["bits"]), compression_reserve=0)
    if spec.get("auto"):
        out["compression"] = CompressionConfig(bits="auto")
    if spec.get("pool"):
        out["pool"] = PagePool(PoolConfig(page_size=4096))
    if spec.get("tune_allocator"):
        out["tune_allocator"] = True
    return out


def worker(spec: dict) -> None:
    # The protocol owns the real stdout; anything else printed (by C code too) goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj, default=str) + "\n")

    import torch

    from daftrain.budget.batching import balanced_sizes, batch_size, split_batch
    from daftrain.budget.segments import checkpointing, find_segments
    from daftrain.budget.step import BudgetedStep
    from daftrain.rss import current_rss_bytes, peak_rss_bytes

    model, batch, loss_fn, count = _case(spec["model"], spec["batch"])
    count = count or batch_size
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    rss0 = current_rss_bytes()
    baseline = rss0 + 3 * sum(p.nbytes for p in model.parameters())
    method, B = spec["method"], spec["batch"]
    if method == "daftrain":
        step = BudgetedStep(model, loss_fn, opt, budget=spec["budget"], count=count, **levers(spec))
        run, peak = (lambda: step(batch)), (lambda: step.process_peak_bytes)
    else:
        if method == "compile":
            torch._functorch.config.activation_memory_budget = spec["memory_budget"]
        fwd = torch.compile(model) if method == "compile" else model
        segments = find_segments(model)
        names = list(segments) if method == "ckpt" else []
        parts = split_batch(batch, balanced_sizes(B, -(-B // spec.get("micro", B))))
        counts = [float(count(p)) for p in parts]

        def run() -> float:
            value = 0.0
            for p, c in zip(parts, counts, strict=True):
                with checkpointing(segments, names):
                    loss = loss_fn(fwd, p)
                (loss * (c / sum(counts))).backward()
                value += float(loss.detach()) * c / sum(counts)
                del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
            return value

        peak = peak_rss_bytes  # never reset in this process: the peak since it started
    reply({"baseline": baseline, "rss_before_step": rss0})
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            loss = run()
        except Exception as exc:  # reported: BudgetTooSmallError, compile errors
            reply({"error": f"{type(exc).__name__}: {exc}"[:2000], "peak": peak()})
            return
        out = {"s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "loss": loss, "peak": peak()}
        if method == "daftrain":
            r = step.history[-1]
            out.update(step_peak=r.peak_bytes, budget=r.budget_bytes, micro=r.plan.micro_batch_size,
                       checkpointed=len(r.plan.checkpointed), bits=r.plan.bits, pool_evictions=r.pool_evictions)
        reply(out)
    reply({"peak": peak()})


# -- parent ---------------------------------------------------------------------------------------------

class Worker:
    """A configuration's process; ``step()`` runs one training step there and returns its report."""

    def __init__(self, spec: dict) -> None:
        self.spec, self.steps, self.error, self.info = spec, [], None, None
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=ENV, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)

    def _ask(self, command: str | None) -> dict | None:
        if command:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.stderr.seek(0)
            self.error = "worker died: " + self.stderr.read()[-1500:]
            return None
        msg = json.loads(line)
        self.error = msg.get("error")
        return None if self.error else msg

    def ready(self) -> bool:
        if self.info is None and self.error is None:
            self.info = self._ask(None)
        return self.error is None

    def step(self) -> dict | None:
        msg = self._ask("step") if self.ready() else None
        self.steps += [msg] if msg else []
        return msg

    def end(self) -> dict:
        final = self._ask("end") if self.ready() else None
        self.proc.stdin.close()
        self.proc.wait()
        peaks = [s["peak"] for s in self.steps] + ([final["peak"]] if final else [])
        return {"error": self.error, "peak": max(peaks, default=None), "steps": self.steps,
                "baseline": (self.info or {}).get("baseline")}


def measure(spec: dict, log: list, cold: bool = False) -> dict:
    """Peak of a fresh process over ``MEMORY_STEPS`` steps, the first included."""
    w = Worker(spec)
    for _ in range(MEMORY_STEPS):
        w.step()
    r = w.end()
    log.append({**spec, "cold_cache": cold, "peak": r["peak"], "error": r["error"],
                "step_s": [s["s"] for s in r["steps"]]})
    print(f"    {LABEL[spec['method']]} micro {spec.get('micro', '-')}{' (cold cache)' if cold else ''}: peak "
          f"{(r['peak'] or 0) / 1e6:.0f} MB" + (f"  ERROR {r['error'][:200]}" if r["error"] else ""), flush=True)
    return r


def largest_fitting(peak_of, budget: int, start: int, batch: int) -> int | None:
    """The largest power-of-two micro-batch (<= ``batch``) whose peak fits, searched from ``start``.

    Going down stops early where the peak, linear in the micro-batch, cannot fit even at 0: its
    intercept from the last two tries, ``2 * peak(m) - peak(2m)``, is over the budget."""
    seen: dict[int, int | None] = {}

    def fits(m: int) -> bool:
        seen[m] = peak_of(m)
        return seen[m] is not None and seen[m] <= budget

    m = start
    if fits(m):
        while m < batch and fits(min(2 * m, batch)):
            m = min(2 * m, batch)
        return m
    while m > 1:
        m //= 2
        if fits(m):
            return m
        if seen[m] and seen.get(2 * m) and 2 * seen[m] - seen[2 * m] > budget:
            print(f"    stop: the peak would not fit at any micro-batch (intercept "
                  f"{(2 * seen[m] - seen[2 * m]) / 1e6:.0f} MB)", flush=True)
            return None
    return None


def memory_phase(name: str, B: int, fractions: list[float]) -> dict:
    print(f"{name}: memory phase (fresh processes, {MEMORY_STEPS} steps each)", flush=True)
    tries: list[dict] = []
    plain = measure({"model": name, "batch": B, "method": "plain"}, tries)
    base, peak = plain["baseline"], plain["peak"]
    cache: dict[tuple, dict] = {("accum", None, B): plain}

    def peak_of(method: str, f: float | None):
        def at(m: int) -> int | None:
            key = (method, f, m)
            if key not in cache:
                spec = {"model": name, "batch": B, "method": method, "micro": m}
                if method == "compile":  # compiled once with a cold cache, then measured warm
                    spec["memory_budget"] = f
                    cold = measure(spec, tries, cold=True)
                cache[key] = measure(spec, tries) if method != "compile" or not cold["error"] else cold
            return None if cache[key]["error"] else cache[key]["peak"]
        return at

    out = {"baseline": base, "plain_peak": peak, "budgets": {}, "tries": tries}
    fractions = sorted(fractions, reverse=True)
    start = 1 << max(0, int(fractions[0] * B).bit_length() - 1)  # the linear estimate, as a power of two
    previous = dict.fromkeys(PEERS, start)
    compile_error = None
    for f in fractions:
        budget = int(base + f * (peak - base))
        print(f"  budget {f:g}: {budget / 1e6:.0f} MB", flush=True)
        row = {"budget_bytes": budget}
        for method in PEERS:
            if method == "compile" and compile_error:
                row[method] = {"micro": None, "error": compile_error}
                continue
            g = f if method == "compile" else None
            m = largest_fitting(peak_of(method, g), budget, min(B, previous[method]), B)
            tried = [t for (k, h, _), t in cache.items() if k == method and h == g]
            errors = [t["error"] for t in tried if t["error"]]
            if method == "compile" and errors and len(errors) == len(tried):
                compile_error = errors[0]  # compile does not run here: record it once and go on
            row[method] = {"micro": m, "peak": cache[(method, g, m)]["peak"] if m else None,
                           "error": errors[0] if errors and m is None else None}
            previous[method] = m or 1
        out["budgets"][str(f)] = row
    return out


def ram_available() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024


def timing_phase(name: str, B: int, mem: dict, rounds: int, max_ram: int, d_levers: dict | None = None) -> dict:
    """One worker per configuration that fits, and plain; as many run together (interleaved) as fit
    ``max_ram`` by their measured peaks (budgets from the smallest, plain with the first)."""
    configs = [(None, "plain", {"method": "plain"}, mem["plain_peak"])]  # (fraction, method, spec, RSS)
    for f in sorted(mem["budgets"], key=float):
        row = mem["budgets"][f]
        for method in PEERS:
            if row[method]["micro"]:
                spec = {"method": method, "micro": row[method]["micro"]}
                spec.update({"memory_budget": float(f)} if method == "compile" else {})
                configs.append((f, method, spec, row[method]["peak"]))
        configs.append((f, "daftrain", {"method": "daftrain", "budget": row["budget_bytes"], **(d_levers or {})},
                        row["budget_bytes"]))
    groups: list[list] = [[]]
    for c in configs:
        if groups[-1] and sum(g[3] for g in groups[-1]) + c[3] > max_ram:
            groups.append([])
        groups[-1].append(c)
    out: dict = {"load_average_per_round": [], "configs": []}
    for gi, group in enumerate(groups):
        print(f"{name}: timing group {gi + 1}/{len(groups)}: " + ", ".join(
            f"{LABEL[m]}@{f or 1}" for f, m, _, _ in group), flush=True)
        workers = [Worker({"model": name, "batch": B, **spec}) for _, _, spec, _ in group]
        for w in workers:  # all loaded before any step is timed
            w.ready()
        firsts = [w.step() for w in workers]  # first step: compilation, daftrain's probing and planning
        loads = []
        for r in range(rounds):
            loads.append(os.getloadavg())
            for w in workers:
                w.step()
            print(f"  round {r + 1}/{rounds}, load average {loads[-1][0]:.2f}", flush=True)
        out["load_average_per_round"].append(loads)
        for (f, method, _, _), w, first in zip(group, workers, firsts, strict=True):
            r = w.end()
            wall, cpu = [s["s"] for s in r["steps"][1:]], [s["cpu_s"] for s in r["steps"][1:]]
            res = {"fraction": f, "method": method, "group": gi, "micro": w.spec.get("micro"), "peak": r["peak"],
                   "error": r["error"], "first_step_s": first["s"] if first else None, "step_s": wall,
                   "step_cpu_s": cpu, "samples_per_s": B / statistics.median(wall) if wall else None,
                   "samples_per_cpu_s": B / statistics.median(cpu) if cpu else None}
            if method == "daftrain":
                budget, steps = w.spec["budget"], r["steps"]
                res["steps"] = steps
                res["every_step_under_budget"] = bool(steps) and r["error"] is None and all(
                    s["step_peak"] <= budget for s in steps)
                res["process_peak_under_budget"] = r["peak"] is not None and r["peak"] <= budget
                plan = (lambda s: (s["micro"], s["bits"], s["checkpointed"]))  # noqa: E731
                same = [s["s"] for s in steps[1:] if plan(s) == plan(steps[0])]
                res["first_over_steady_same_plan"] = first["s"] / statistics.median(same) if first and same else None
            out["configs"].append(res)
    return out


def summarize(mem: dict, timing: dict) -> dict:
    """Per-budget ratios to the best fitting peer, (d)'s fit at 12.5 %, and the moonshot figure."""
    base, plain_peak = mem["baseline"], mem["plain_peak"]
    plain = next(c for c in timing["configs"] if c["method"] == "plain")
    budgets: dict = {}
    for c in timing["configs"]:
        if c["fraction"] is not None:
            budgets.setdefault(c["fraction"], {"budget_bytes": mem["budgets"][c["fraction"]]["budget_bytes"]})
            budgets[c["fraction"]][c["method"]] = c
    moon = None
    for f in sorted(budgets, key=float, reverse=True):
        row, budget = budgets[f], budgets[f]["budget_bytes"]
        for m in PEERS:
            if m not in row:  # no micro-batch fitted in the memory phase
                row[m] = {"micro": None, "peak": None, "error": mem["budgets"][f][m]["error"], "samples_per_s": None}
            # fits: the memory phase chose a micro-batch and the timing worker (more steps) stayed under too
            row[m]["timing_peak_under_budget"] = row[m]["peak"] is not None and row[m]["peak"] <= budget
            row[m]["fits"] = (row[m]["error"] is None and row[m]["micro"] is not None
                              and row[m]["timing_peak_under_budget"])
        best = max((row[m] for m in PEERS if row[m]["fits"] and row[m]["samples_per_s"]),
                   key=lambda c: c["samples_per_s"], default=None)
        d = row["daftrain"]
        d["fits"] = d["every_step_under_budget"] and d["process_peak_under_budget"]
        ok = bool(d["fits"] and d["samples_per_s"])
        last = d["steps"][-1] if d["steps"] else {"bits": None}
        larger = bool(best and last["bits"] is not None and last["micro"] > best["micro"])
        row["best_peer"] = best["method"] if best else None
        row["d_over_best_peer"] = d["samples_per_s"] / best["samples_per_s"] if ok and best else None
        row["d_over_best_peer_cpu_time"] = (d["samples_per_cpu_s"] / best["samples_per_cpu_s"]
                                            if ok and best else None)
        row["same_timing_group"] = bool(best) and best["group"] == d["group"]
        row["target"] = 1.3 if larger else 0.95  # 1.3x where compression lets a larger micro-batch fit
        row["target_met"] = ok and (best is None or row["d_over_best_peer"] >= row["target"])
        # The first step against steady steps at its plan; where no later step ran that plan (the planner
        # corrected it), against every later step, and the row says which.
        later = [s["s"] for s in d["steps"][1:]]
        same = d["first_over_steady_same_plan"]
        row["first_step_compared_with"] = "same plan" if same is not None else "every later step"
        row["first_over_steady"] = same if same is not None else (
            d["first_step_s"] / statistics.median(later) if d["first_step_s"] and later else None)
        row["first_step_target_met"] = ok and (row["first_over_steady"] or float("inf")) <= 1.5
        if ok:
            moon = {"fraction": float(f), "step_memory_vs_plain": (d["peak"] - base) / (plain_peak - base),
                    "throughput_vs_plain": d["samples_per_s"] / plain["samples_per_s"],
                    "same_timing_group": d["group"] == plain["group"]}
    if moon:
        moon["met"] = moon["step_memory_vs_plain"] <= 0.05 and moon["throughput_vs_plain"] >= 0.5
    return {"plain": plain, "budgets": budgets, "moonshot": moon,
            "d_under_budget_every_step": all(r["daftrain"]["fits"] for r in budgets.values()),
            "d_fits_at_0.125": budgets.get("0.125", {}).get("daftrain", {}).get("fits")}


def table(name: str, summary: dict) -> list[str]:
    lines = []
    for f, row in summary["budgets"].items():
        for m in (*PEERS, "daftrain"):
            c = row[m]
            last = c.get("steps", [])[-1:] or [None]
            plan = (f"m={last[0]['micro']} ck={last[0]['checkpointed']} bits={last[0]['bits']}" if m == "daftrain"
                    and last[0] else f"micro {c['micro']}")
            lines.append(f"{name:<10} {float(f):>6.3f} {LABEL[m]} {plan:<22} peak {(c['peak'] or 0) / 1e6:6.0f} / "
                         f"{row['budget_bytes'] / 1e6:6.0f} MB {'fits' if c['fits'] else 'OVER':<4} "
                         f"{c['samples_per_s'] or 0:6.2f} samples/s {c.get('samples_per_cpu_s') or 0:6.2f} per cpu-s "
                         f"first {c.get('first_step_s') or 0:6.1f} s"
                         + (f"  {c['error'][:80]}" if c["error"] else ""))
        ratio, first = row["d_over_best_peer"], row["first_over_steady"]
        cpu = row["d_over_best_peer_cpu_time"]
        lines.append(f"{'':<17} (d) / best peer {row['best_peer']}: {ratio and round(ratio, 3)} (target "
                     f"{row['target']}; CPU time {cpu and round(cpu, 3)}); (d) first / steady "
                     f"{first and round(first, 2)} ({row['first_step_compared_with']})")
    m = summary["moonshot"] or {"fraction": 0, "step_memory_vs_plain": 0, "throughput_vs_plain": 0}
    lines.append(f"{name}: moonshot at {m['fraction']:g}: (d)'s step memory {m['step_memory_vs_plain']:.3f} of "
                 f"plain's, throughput {m['throughput_vs_plain']:.2f}x plain's")
    return lines


def _targets(results: dict) -> dict:
    keys = ("d_over_best_peer", "target", "target_met", "first_over_steady", "first_step_compared_with",
            "first_step_target_met")
    return {name: {**{k: res["summary"][k] for k in ("d_under_budget_every_step", "d_fits_at_0.125", "moonshot")},
                   **{f: {k: r[k] for k in keys} for f, r in res["summary"]["budgets"].items()}}
            for name, res in results.items()}


def _write_json(path: Path | str, data: dict) -> None:
    """``common.write_json``, imported on use (the workers of this script do not need it)."""
    sys.path.insert(0, str(HERE))
    from common import write_json

    write_json(path, data)


def resummarize(path: Path) -> None:
    """Recompute a results file's summaries, targets and table from its memory and timing records (no run)."""
    data = json.loads(path.read_text())
    lines = []
    for name, res in data["results"].items():
        res["summary"] = summarize(res["memory"], res["timing"])
        lines += table(name, res["summary"])
    data.update(targets=_targets(data["results"]), table=lines,
                resummarized_by=" ".join(["python", *sys.argv]))
    _write_json(path, data)
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke test: ResNet-18 at batch 64, 2 budgets, 2 rounds")
    parser.add_argument("--models", default=None, help="comma-separated, default resnet18,gpt2_small")
    parser.add_argument("--fractions", default=None, help="budget fractions, default 0.5,0.25,0.125,0.05")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; 2 with --quick)")
    parser.add_argument("--max-ram-gb", type=float, default=None,
                        help="RAM the workers of one timing group may hold together (default 0.7 x MemAvailable)")
    parser.add_argument("--out", default=None, help="default results/budget.json (budget_quick.json with --quick)")
    parser.add_argument("--tune-allocator", action="store_true",
                        help="(d) with BudgetedStep(tune_allocator=True): glibc's mmap threshold fixed from the start")
    parser.add_argument("--resummarize", metavar="JSON",
                        help="recompute the summary, targets and table of a results file from its recorded steps")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.resummarize:
        resummarize(Path(args.resummarize))
        return
    models = (args.models or ("resnet18" if args.quick else "resnet18,gpt2_small")).split(",")
    fractions = [float(f) for f in args.fractions.split(",")] if args.fractions else (
        [0.5, 0.25] if args.quick else list(FRACTIONS))
    rounds = args.rounds or (2 if args.quick else 5)
    max_ram = int(args.max_ram_gb * 1e9) if args.max_ram_gb else int(0.7 * ram_available())
    t0, results, lines = time.time(), {}, []
    ENV["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_budget_inductor_")
    for name in models:
        B = 64 if args.quick and name == "resnet18" else BATCH[name]
        mem = memory_phase(name, B, fractions)
        timing = timing_phase(name, B, mem, rounds, max_ram, {"tune_allocator": True} if args.tune_allocator else None)
        results[name] = {"memory": mem, "timing": timing, "summary": summarize(mem, timing)}
        lines += table(name, results[name]["summary"])
    shutil.rmtree(ENV["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    print("\n".join(lines))
    targets = _targets(results)
    _write_json(args.out or RESULTS / ("budget_quick.json" if args.quick else "budget.json"), {
        "command": " ".join(["python", *sys.argv]),
        "definition": "budget(f) = baseline + f * (plain_peak - baseline); baseline = RSS with model, batch and "
                      "runtime loaded + 3 x parameter bytes (gradients, Adam's two states); peaks are whole-process "
                      f"VmHWM over every step of a fresh process, the first included ({MEMORY_STEPS} steps in the "
                      "memory phase, every step in the timing phase); (d)'s is kept across its per-phase resets",
        "dropout": DROPOUT, "environment_variables": {"TORCHINDUCTOR_COMPILE_THREADS": "1",
                                                      "allocator": "default (no MALLOC_* variables)"},
        "compile": "(c) sets torch._functorch.config.activation_memory_budget = f; the run has its own inductor "
                   "cache, and each compiled configuration runs once (cold cache, in memory.tries with "
                   "cold_cache true) before the process whose peak decides (warm cache, as a repeated run finds it)",
        "rounds": rounds, "max_ram_bytes": max_ram, "wall_s": time.time() - t0, "methods": LABEL,
        "targets": targets, "results": results, "table": lines,
    })


if __name__ == "__main__":
    main()
