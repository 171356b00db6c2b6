"""RSS over a long run of compressed training steps, in the two ways users write the context:

* ``inline``: ``with daftrain.compress(bits=2):`` written inside the loop, a new context every step;
* ``reused``: one context created before the loop and entered every step.

Each pattern runs in a fresh process (default allocator settings). After ``--warmup`` steps the process
RSS is read after every step; each window of ``--every`` steps gives one sample, its minimum (the floor
the step returns to), and a least-squares line through those samples gives the growth in MB per 1000
steps. The target is under 1 MB per 1000 steps in both patterns.

Why the floor: between two steps the RSS of a healthy run swings by several MB (freed activations and
decode buffers the allocator has not returned yet, in ~2 MB blocks), so a line through single readings
has a standard error near 2 MB per 1000 steps, above the target; a leak raises the floor, the swings do
not. ``slope_last_mb_per_1000_steps`` is the same line through the last reading of each window.

    .venv/bin/python benchmarks/bench_soak.py --steps 1000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PATTERNS = ("inline", "reused")


def slope_mb_per_1000(steps: list[int], rss: list[int]) -> float:
    """Least-squares slope of RSS against step, in MB per 1000 steps."""
    n = len(steps)
    mx, my = sum(steps) / n, sum(rss) / n
    sxx = sum((x - mx) ** 2 for x in steps)
    sxy = sum((x - mx) * (y - my) for x, y in zip(steps, rss, strict=True))
    return (sxy / sxx) * 1000 / 1e6 if sxx else 0.0


def run_pattern(pattern: str, steps: int, warmup: int, every: int, batch: int) -> dict:
    """Train a small CNN for ``steps`` steps with ``pattern``; RSS samples after warm-up (this process)."""
    import torch
    from torch import nn

    import daftrain
    from daftrain.rss import current_rss_bytes

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    reused = daftrain.compress(bits=2, model=model)
    samples: list[tuple[int, int]] = []
    last: list[tuple[int, int]] = []
    window: list[int] = []
    for step in range(steps):
        ctx = reused if pattern == "reused" else daftrain.compress(bits=2, model=model)
        with ctx:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        del ctx, loss
        if step >= warmup:
            window.append(current_rss_bytes())
            if len(window) == every:
                samples.append((step, min(window)))
                last.append((step, window[-1]))
                window = []
    xs, ys = [s for s, _ in samples], [r for _, r in samples]
    return {"pattern": pattern, "steps": steps, "warmup": warmup, "batch": batch, "every": every,
            "rss_first_mb": ys[0] / 1e6, "rss_last_mb": ys[-1] / 1e6,
            "slope_mb_per_1000_steps": slope_mb_per_1000(xs, ys),
            "slope_last_mb_per_1000_steps": slope_mb_per_1000([s for s, _ in last], [r for _, r in last]),
            "samples": samples, "samples_last": last}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.json"))
    ap.add_argument("--worker", choices=PATTERNS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_pattern(args.worker, args.steps, args.warmup, args.every, args.batch)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from common import write_json

    results = []
    for pattern in PATTERNS:  # each in a fresh process
        cmd = [sys.executable, __file__, "--worker", pattern, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--every", str(args.every), "--batch", str(args.batch)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy()).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        verdict = "met" if r["slope_mb_per_1000_steps"] < 1.0 else "NOT met"
        print(f"{r['pattern']:>7}: RSS floor {r['rss_first_mb']:.1f} -> {r['rss_last_mb']:.1f} MB over "
              f"{r['steps'] - r['warmup']} steps after warm-up; slope {r['slope_mb_per_1000_steps']:+.3f} MB per "
              f"1000 steps (target < 1: {verdict}); through single readings {r['slope_last_mb_per_1000_steps']:+.3f}")
    write_json(args.out, {"command": " ".join(sys.argv), "results": results})


if __name__ == "__main__":
    main()
