"""The main job: train ResNet-18 on real Fashion-MNIST, plain PyTorch vs daftrain, side by side.

Each method runs in a fresh Python process so that its peak resident memory is its own.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..budget.memory import SavedBytesCounter
from ..config import CompressionConfig
from ..errors import InvalidArgumentError
from ..layout import MAX_GROUP_SIZE, MIN_GROUP_SIZE, SUPPORTED_BITS
from ..rss import peak_rss_bytes, reset_peak_rss
from ..saved.hooks import compress
from .data import image_dataset
from .models.resnet import resnet18

TEST_IMAGES = 10_000
"""Images in Fashion-MNIST's test split."""


def check_demo_arg(name: str, value: object) -> None:
    """Raise ``InvalidArgumentError`` naming ``name`` if ``value`` is not a valid ``DemoArgs`` field value."""
    if name == "lr":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        rule = "a finite number > 0"
    else:
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
        rules = {
            "steps": (value >= 1, "an integer >= 1"),
            "batch_size": (value >= 1, "an integer >= 1"),
            "bits": (value in SUPPORTED_BITS, f"one of {SUPPORTED_BITS}"),
            "group_size": (MIN_GROUP_SIZE <= value <= MAX_GROUP_SIZE and value % 32 == 0,
                           f"a multiple of 32 in [{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}]"),
            "eval_samples": (1 <= value <= TEST_IMAGES, f"an integer in [1, {TEST_IMAGES}]"),
            "width": (value >= 1, "an integer >= 1"),
            "seed": (0 <= value < 2**63, "an integer in [0, 2**63)"),
            "threads": (value >= 0, "an integer >= 0 (0: torch's default)"),
        }
        ok, rule = rules[name]
    if not ok:
        raise InvalidArgumentError(f"{name} must be {rule}, got {value!r}")


@dataclass(frozen=True)
class DemoArgs:
    """The demo's settings, validated on construction (``check_demo_arg``)."""

    steps: int = 60
    """Training steps per method."""
    batch_size: int = 64
    """Training batch size."""
    bits: int = 2
    """daftrain's bits per activation value (1, 2, 4 or 8)."""
    group_size: int = 256
    """Values per quantization group."""
    eval_samples: int = 2000
    """Test images used for the accuracy (of 10,000)."""
    lr: float = 0.05
    """SGD learning rate (momentum 0.9)."""
    width: int = 64
    """ResNet-18 base width (64 is the standard model)."""
    seed: int = 0
    """Seed for the model initialisation and the batch order (the same for both methods)."""
    threads: int = 0
    """Torch threads per run (0: torch's default)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            check_demo_arg(f.name, getattr(self, f.name))


@dataclass(frozen=True)
class DemoResult:
    method: str
    saved_activation_bytes: int
    peak_rss_bytes: int
    step_time_s: float
    final_loss: float
    test_accuracy: float
    data_source: str
    first_step_time_s: float = 0.0
    stats_summary: str = ""
    """daftrain only: ``ctx.stats.summary()`` of the last step, the process peak included."""


def run_method(method: str, args: DemoArgs) -> DemoResult:
    """Train with one method (``plain`` or ``daftrain``) in this process and measure it."""
    if args.threads:
        torch.set_num_threads(args.threads)
    train = image_dataset("train", limit=args.steps * args.batch_size)
    test = image_dataset("test", limit=args.eval_samples)
    torch.manual_seed(args.seed)
    model = resnet18(num_classes=train.num_classes, width=args.width)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps)
    order = torch.randperm(len(train.labels), generator=torch.Generator().manual_seed(args.seed))
    cfg = CompressionConfig(bits=args.bits, group_size=args.group_size)
    compressor = compress(cfg, model=model) if method == "daftrain" else None
    reset_peak_rss()
    saved, times, losses = 0, [], []
    model.train()
    bar = tqdm(range(args.steps), desc=f"{method:>9}", unit="step", file=sys.stderr, dynamic_ncols=True)
    for step in bar:
        # A run longer than the training set starts over (another epoch, same order).
        idx = order[torch.arange(step * args.batch_size, (step + 1) * args.batch_size) % len(order)]
        x, y = train.images[idx], train.labels[idx]
        start = time.perf_counter()
        ctx = compressor or SavedBytesCounter(exclude=model.buffers())
        with ctx:
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        times.append(time.perf_counter() - start)
        saved = max(saved, ctx.stats.stored_bytes if isinstance(ctx, compress) else ctx.saved_bytes)
        del ctx
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", saved_MB=f"{saved / 1e6:.1f}")
    peak = peak_rss_bytes()
    summary = compressor.stats.summary() if compressor is not None else ""
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(test.labels), 500):
            correct += (model(test.images[i : i + 500]).argmax(1) == test.labels[i : i + 500]).sum().item()
    steady = sorted(times[1:] or times)
    tail = losses[-10:]
    return DemoResult(
        method=method,
        saved_activation_bytes=saved,
        peak_rss_bytes=peak,
        step_time_s=steady[len(steady) // 2],
        final_loss=sum(tail) / len(tail),
        test_accuracy=correct / len(test.labels),
        data_source=train.source,
        first_step_time_s=times[0],
        stats_summary=summary,
    )


def _run_in_subprocess(method: str, args: DemoArgs) -> DemoResult:
    cmd = [sys.executable, "-m", "daftrain.demo.run", method, json.dumps(asdict(args))]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=os.environ.copy()).stdout
    return DemoResult(**json.loads(out.strip().splitlines()[-1]))


def format_table(results: list[DemoResult]) -> str:
    base = results[0]
    rows = [("", *(r.method for r in results))]
    rows.append(("saved activations (MB)", *(f"{r.saved_activation_bytes / 1e6:.1f}" for r in results)))
    rows.append(("  vs plain", *(f"{base.saved_activation_bytes / max(r.saved_activation_bytes, 1):.1f}x less"
                                 for r in results)))
    rows.append(("process peak RSS (MB)", *(f"{r.peak_rss_bytes / 1e6:.0f}" for r in results)))
    rows.append(("  vs plain", *(f"{base.peak_rss_bytes / max(r.peak_rss_bytes, 1):.2f}x less" for r in results)))
    rows.append(("median step time (s)", *(f"{r.step_time_s:.3f}" for r in results)))
    rows.append(("  vs plain", *(f"{r.step_time_s / base.step_time_s:.2f}x" for r in results)))
    rows.append(("first step (s)", *(f"{r.first_step_time_s:.2f}" for r in results)))
    rows.append(("final train loss", *(f"{r.final_loss:.3f}" for r in results)))
    rows.append(("test accuracy", *(f"{100 * r.test_accuracy:.1f}%" for r in results)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines + [f"{r.method}, last step: {r.stats_summary}" for r in results if r.stats_summary])


def prepare_json_path(out_json: str | os.PathLike[str]) -> Path:
    """Check that the results can be written to ``out_json`` (creating its directory if missing), before
    any training runs; raises ``InvalidArgumentError`` naming the path otherwise."""
    path = Path(out_json)
    if path.is_dir():
        raise InvalidArgumentError(f"out_json {str(path)!r} is a directory; pass a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidArgumentError(
            f"out_json: cannot create the directory of {str(path)!r} ({exc.strerror or exc}); pass a path in a "
            "writable directory"
        ) from None
    if not os.access(path.parent, os.W_OK):
        raise InvalidArgumentError(f"out_json: the directory of {str(path)!r} is not writable; pass another path")
    return path


def demo(args: DemoArgs, out_json: str | None = None) -> list[DemoResult]:
    """Run both methods, each in a fresh process, and print the comparison. ``out_json`` is checked (and
    its directory created) before training."""
    path = prepare_json_path(out_json) if out_json else None
    print(f"daftrain demo: CIFAR-style ResNet-18 on Fashion-MNIST, {args.steps} steps of batch {args.batch_size}, "
          f"daftrain at {args.bits} bits / group {args.group_size}", flush=True)
    results = [_run_in_subprocess(m, args) for m in ("plain", "daftrain")]
    print(f"data: {results[0].data_source}")
    print(format_table(results))
    if path is not None:
        with open(path, "w") as f:
            json.dump({"args": asdict(args), "results": [asdict(r) for r in results]}, f, indent=2)
    return results


if __name__ == "__main__":  # the per-method worker process
    result = run_method(sys.argv[1], DemoArgs(**json.loads(sys.argv[2])))
    print(json.dumps(asdict(result)))
