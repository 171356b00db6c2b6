"""Host-device synchronisations per compressed training step on CUDA, with step times and peak memory.

For each model of ``bench_peak_memory.py`` and each configuration (plain PyTorch, ``compress(bits=2)``,
``bits=4``, the default ``compress()``), in one process, one after the other: a first step, then the
peak ``torch.cuda.max_memory_allocated`` above the allocated bytes after it, over ``--steps`` more steps
(step times: medians of those after the first two, each step ending with ``torch.cuda.synchronize()``),
then one more step under ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every operation that
makes the host wait for the device: the sites are counted by the two innermost daftrain frames of the
stack (``NOTE [ Checks the host does not wait for ]`` in ``saved/checks.py``).

``--src`` imports daftrain from another checkout's ``src`` (another revision through ``git worktree add``),
so that two revisions alternate in fresh processes on one machine:

    python benchmarks/bench_host_syncs.py --models minilm_lora,gpt2 --configs plain,bits2 \
        --out benchmarks/results/host_syncs_cuda.json
    python benchmarks/bench_host_syncs.py --src /tmp/before/src --models minilm_lora,gpt2 --configs plain,bits2 \
        --out /tmp/host_syncs_before.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {"plain": {}, "bits2": {"bits": 2}, "bits4": {"bits": 4}, "default": {}}


def steps(model, batch, loss_fn, optimizer, ctx, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    import torch

    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with ctx:
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def sync_sites(model, batch, loss_fn, optimizer, ctx) -> collections.Counter[str]:  # type: ignore[no-untyped-def]
    """The synchronising operations of one step, by the two innermost daftrain frames that made them."""
    import torch

    sites: collections.Counter[str] = collections.Counter()

    def note(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        ours = [f for f in traceback.extract_stack() if "/daftrain/" in f.filename]
        where = ";".join(f"{f.filename.split('/daftrain/')[-1]}:{f.lineno}" for f in ours[-2:])
        sites[where or f"{filename}:{lineno}"] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            steps(model, batch, loss_fn, optimizer, ctx, 1)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    return sites


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="minilm_lora,gpt2,resnet18")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--src", help="import daftrain from this folder instead of the installed one")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "host_syncs_cuda.json"))
    args = ap.parse_args()
    if args.src:
        sys.path.insert(0, args.src)
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from bench_peak_memory import build
    from common import environment, median, write_json

    import daftrain

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rows = []
    for model_name in args.models.split(","):
        for config_name in args.configs.split(","):
            torch.manual_seed(0)
            model, batch, loss_fn = build(model_name, "cuda")
            cfg = CONFIGS[config_name]
            ctx = (contextlib.nullcontext() if config_name == "plain"
                   else daftrain.compress(model=model, **cfg))
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            first = steps(model, batch, loss_fn, optimizer, ctx, 1)
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            times = first + steps(model, batch, loss_fn, optimizer, ctx, args.steps)
            peak = torch.cuda.max_memory_allocated() - baseline
            sites = (sync_sites(model, batch, loss_fn, optimizer, ctx) if config_name != "plain"
                     else collections.Counter())
            row = {"model": model_name, "config": config_name, "median_step_s": median(times[2:]), "steps_s": times,
                   "peak_allocated_mb": peak / 1e6, "syncs": sum(sites.values()), "sync_sites": dict(sites)}
            rows.append(row)
            print(f"{model_name} {config_name}: step {row['median_step_s'] * 1e3:.1f} ms, peak {peak / 1e6:.0f} MB, "
                  f"{row['syncs']} syncs {dict(sites.most_common(4))}", flush=True)
            del model, batch, ctx, optimizer
            torch.cuda.empty_cache()
    write_json(args.out, {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                          "environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
