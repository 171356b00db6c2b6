"""How much can any memory planner gain over plain gradient accumulation on this machine?

A budget planner beats gradient accumulation by running larger micro-batches (made to fit by
compressed activations or checkpointing), so its ceiling is set by how much faster one full batch
runs than the same batch as ``k`` small micro-batches. This script measures exactly that, side by
side in one process (configurations interleaved within every repeat, medians over repeats):

* plain PyTorch, batch 256 as ``256 / m`` micro-batches of ``m`` for m in {8, 16, ..., 256};
* the same with every saved activation at 2 bits (``daftrain.compress``), which is what lets a
  larger micro-batch fit a budget in the first place.

It prints samples/s per configuration and two ratios against accumulation at the micro-batch that
fits a budget (``--fitting-micro``, default 16: the largest that fits 12.5 % of plain PyTorch's
peak in ``benchmarks/results/budget.json``):

* ``ceiling_exact``: best plain throughput / plain at the fitting micro-batch -- the most any
  planner could gain if memory were free;
* ``ceiling_2bit``: best 2-bit throughput / plain at the fitting micro-batch -- the most the
  compressed-activation route can gain.

    python benchmarks/bench_microbatch_ceiling.py [--repeats 5] [--out benchmarks/results/microbatch_ceiling.json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import median, timed, write_json

import daftrain
from daftrain.demo.models.resnet import resnet18

BATCH = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro", default="8,16,32,64,128,256", help="micro-batch sizes (divisors of 256)")
    parser.add_argument("--fitting-micro", type=int, default=16)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "microbatch_ceiling.json"))
    args = parser.parse_args()
    micros = [int(m) for m in args.micro.split(",")]
    if any(BATCH % m for m in micros) or args.fitting_micro not in micros:
        raise SystemExit(f"--micro must divide {BATCH} and include --fitting-micro")

    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    x, y = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    ctx = daftrain.compress(bits=2, model=model)

    def step(m: int, compressed: bool) -> None:
        opt.zero_grad(set_to_none=True)
        for i in range(0, BATCH, m):
            with ctx if compressed else contextlib.nullcontext():
                loss = F.cross_entropy(model(x[i:i + m]), y[i:i + m]) * (m / BATCH)
            loss.backward()
        opt.step()

    configs = [(m, c) for m in micros for c in (False, True)]
    for m, c in configs:  # warm-up: allocator, JIT caches, calibration
        step(m, c)
    times: dict[tuple[int, bool], list[float]] = {k: [] for k in configs}
    for r in range(args.repeats):
        for k in configs if r % 2 == 0 else reversed(configs):
            times[k].append(timed(lambda k=k: step(*k)))
        print(f"repeat {r + 1}/{args.repeats}: "
              + ", ".join(f"m={m}{' 2b' if c else ''} {times[(m, c)][-1]:.2f}s" for m, c in configs), flush=True)
    ctx.close()

    rows = {f"{'2bit' if c else 'plain'}_micro{m}": {"micro_batch": m, "compressed": c,
                                                      "step_s_median": median(times[(m, c)]),
                                                      "samples_per_s": BATCH / median(times[(m, c)]),
                                                      "step_s": times[(m, c)]}
            for m, c in configs}
    fitting = rows[f"plain_micro{args.fitting_micro}"]["samples_per_s"]
    best_plain = max(r["samples_per_s"] for r in rows.values() if not r["compressed"])
    best_2bit = max(r["samples_per_s"] for r in rows.values() if r["compressed"])
    summary = {"fitting_micro": args.fitting_micro, "ceiling_exact": best_plain / fitting,
               "ceiling_2bit": best_2bit / fitting, "target_ratio": 1.3}
    print(f"\n{'config':<16}{'step s':>9}{'samples/s':>11}")
    for name, r in rows.items():
        print(f"{name:<16}{r['step_s_median']:>9.2f}{r['samples_per_s']:>11.1f}")
    print(f"\nagainst accumulation at micro-batch {args.fitting_micro}: the best exact configuration is "
          f"{summary['ceiling_exact']:.2f}x, the best 2-bit one {summary['ceiling_2bit']:.2f}x "
          f"(the budget benchmark's target is 1.3x)")
    write_json(args.out, {"command": " ".join(sys.argv), "batch": BATCH, "repeats": args.repeats,
                          "results": rows, "summary": summary})


if __name__ == "__main__":
    main()
