"""The first training step of a new process against its steady steps (CIFAR ResNet-18, batch 128).

One warm-up process first runs a compressed step, so numba's cache holds every kernel specialisation
the model needs (what any earlier run on the machine leaves). Then each configuration runs in
``--processes`` fresh processes, interleaved: ``--steps`` training steps (AdamW), each timed by phase
(forward, backward, optimizer). The first step is compared with the median of the later ones. Each
process also records its import times, how many kernel specialisations numba loaded from its cache
or compiled, and per step its CPU time (all threads: on a busy machine it counts the work and not the
waiting for a core), kernel (system) time and minor page faults.

Configurations: ``plain`` (PyTorch alone), ``bits2`` (``compress(bits=2)``, whose construction is timed
apart: it loads the CPU kernels, ``NOTE [ Kernels load before the first step ]``), ``bits2+lazy`` (the
same with that load left to each kernel's first call, inside the first step), ``bits2+nocache`` (numba
pointed at an empty cache directory: every kernel compiled in this process).

    flock /tmp/daftrain-bench.lock .venv/bin/python benchmarks/bench_first_step.py --processes 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("plain", "bits2", "bits2+lazy", "bits2+nocache")


def _numba_counts() -> dict[str, int]:
    """Specialisations numba loaded from its cache or compiled, over the CPU kernels' dispatchers."""
    from numba.core.registry import CPUDispatcher

    from daftrain.kernels import cpu

    hits = misses = 0
    for value in vars(cpu).values():
        if isinstance(value, CPUDispatcher):
            hits += sum(value.stats.cache_hits.values())
            misses += sum(value.stats.cache_misses.values())
    return {"cache_hits": hits, "cache_misses": misses}


def worker(config: str, steps: int, profile: bool) -> dict:
    import resource

    t0 = time.perf_counter()
    import torch

    t1 = time.perf_counter()
    import daftrain
    from daftrain.demo.models import resnet18

    t2 = time.perf_counter()
    torch.manual_seed(0)
    model = resnet18(num_classes=10, width=64)
    model.train()
    x, y = torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if config == "bits2+lazy":
        from daftrain.saved import hooks

        hooks.load_fast_kernels = lambda **kwargs: None  # each kernel loads at its first call
    start = time.perf_counter()
    ctx = daftrain.compress(bits=2, model=model) if config != "plain" else None
    construct_s = time.perf_counter() - start  # loads the CPU kernels (NOTE [ Kernels load before the first step ])
    rows, profile_top = [], None
    for step in range(steps):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        prof = None
        if profile and step == 0:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        start, cpu_start = time.perf_counter(), time.process_time()
        if ctx is not None:
            with ctx:
                loss = torch.nn.functional.cross_entropy(model(x), y)
        else:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        fwd = time.perf_counter()
        loss.backward()
        del loss
        bwd = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end, cpu_end = time.perf_counter(), time.process_time()
        end_usage = resource.getrusage(resource.RUSAGE_SELF)
        if prof is not None:
            import io
            import pstats

            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
            profile_top = out.getvalue()
        rows.append({"step_s": end - start, "forward_s": fwd - start, "backward_s": bwd - fwd,
                     "optimizer_s": end - bwd, "cpu_s": cpu_end - cpu_start,
                     "sys_s": end_usage.ru_stime - usage.ru_stime,
                     "minor_faults": end_usage.ru_minflt - usage.ru_minflt})
    later = rows[1:]
    out = {"config": config, "import_torch_s": t1 - t0, "import_daftrain_s": t2 - t1, "construct_s": construct_s,
           "first_step_s": rows[0]["step_s"], "steady_step_s": statistics.median(r["step_s"] for r in later),
           "steps": rows, **_numba_counts(), "load_average": list(os.getloadavg())}
    out["first_over_steady"] = out["first_step_s"] / out["steady_step_s"]
    # CPU seconds (all threads) count the work, not the waiting for a core other processes hold.
    out["first_cpu_s"] = rows[0]["cpu_s"]
    out["steady_cpu_s"] = statistics.median(r["cpu_s"] for r in later)
    out["first_over_steady_cpu"] = out["first_cpu_s"] / out["steady_cpu_s"]
    if profile_top is not None:
        out["profile_first_step"] = profile_top
    return out


def _run(config: str, steps: int, profile: bool, cache_dir: str | None) -> dict:
    env = os.environ.copy()
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    cmd = [sys.executable, __file__, "--worker", config, "--steps", str(steps)] + (["--profile"] if profile else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--processes", type=int, default=3, help="fresh processes per configuration")
    ap.add_argument("--steps", type=int, default=7, help="steps per process: the first and the later ones")
    ap.add_argument("--profile", action="store_true", help="cProfile the first step (keeps the top 40 entries)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "first_step.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.profile)))
        return
    if args.steps < 6:
        raise SystemExit("--steps must be at least 6 (the first and >= 5 later steps)")
    sys.path.insert(0, str(Path(__file__).parent))
    from common import write_json

    configs = args.configs.split(",")
    warm = _run("bits2", 2, False, None)  # fills numba's cache, as an earlier run on the machine would
    print(f"warm-up process: {warm['cache_hits']} specialisations loaded, {warm['cache_misses']} compiled", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            for config in configs:  # interleaved: every configuration once per round
                cache = os.path.join(tmp, f"cache{i}") if config.endswith("+nocache") else None
                r = _run(config, args.steps, args.profile, cache)
                rows.append(r)
                print(f"{config:>14}: first {r['first_step_s']:.2f} s, steady {r['steady_step_s']:.2f} s "
                      f"({r['first_over_steady']:.2f}x; CPU {r['first_cpu_s']:.2f} s against "
                      f"{r['steady_cpu_s']:.2f} s, {r['first_over_steady_cpu']:.2f}x); compress() "
                      f"{r['construct_s']:.2f} s; import torch "
                      f"{r['import_torch_s']:.2f} s, daftrain {r['import_daftrain_s']:.2f} s; numba "
                      f"{r['cache_hits']} loaded / {r['cache_misses']} compiled; load {r['load_average'][0]:.2f}",
                      flush=True)
    summary = {}
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        summary[config] = {k: statistics.median(r[k] for r in mine)
                           for k in ("first_step_s", "steady_step_s", "first_over_steady", "first_cpu_s",
                                     "steady_cpu_s", "first_over_steady_cpu", "construct_s")}
        s = summary[config]
        print(f"{config:>14}: first step {s['first_step_s']:.2f} s = {s['first_over_steady']:.2f}x the steady "
              f"{s['steady_step_s']:.2f} s (CPU time {s['first_over_steady_cpu']:.2f}x; medians over {len(mine)} "
              f"processes)")
    write_json(args.out, {"command": " ".join(sys.argv), "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
