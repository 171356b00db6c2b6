"""Saved-activation bytes and step time: plain PyTorch vs daftrain at 8 / 4 / 2 bits.

ResNet-18 (CIFAR-style, 3x32x32, batch 128) and GPT-2 small (from a config, seq 256, batch 8, eager
attention, dropout 0.1). Plain PyTorch's bytes are counted by an independent hook
(``daftrain.budget.memory.SavedBytesCounter``: unique storages, parameters and buffers left out); daftrain's
are what its records hold plus the tensors it keeps exact. Step time is forward + backward, each
configuration run in turn within every repeat (so machine noise hits all alike), median over repeats.

    python benchmarks/bench_saved_bytes.py [--models resnet18,gpt2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import median, timed, write_json

import daftrain
from daftrain.budget.memory import SavedBytesCounter
from daftrain.demo.models.resnet import resnet18
from daftrain.demo.models.transformers_zoo import gpt2_lm

TARGETS = {"resnet18": 14.0, "gpt2_small": 10.0}  # min saved-bytes ratio at 2 bits


def resnet_case():
    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    x, y = torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))
    return model, lambda: F.cross_entropy(model(x), y)


def gpt2_case():
    model = gpt2_lm(seed=0)  # GPT-2 small: 12 layers, 768 wide, 12 heads
    ids = torch.randint(0, 50257, (8, 256), generator=torch.Generator().manual_seed(0))
    return model, lambda: model(input_ids=ids, labels=ids).loss


CASES = {"resnet18": resnet_case, "gpt2_small": gpt2_case}


def step(model, loss_fn, ctx) -> int:
    """One forward + backward under ``ctx``; returns the saved-activation bytes it measured."""
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = loss_fn()
    loss.backward()
    return ctx.saved_bytes if isinstance(ctx, SavedBytesCounter) else ctx.stats.stored_bytes


def bytes_only(name: str, bits_list: list[int]) -> dict:
    """Saved bytes from one forward per configuration (no backward, no timing): the quick figure."""
    model, loss_fn = CASES[name]()
    model.train()
    rows: dict[str, dict] = {}
    for k, b in {"plain": None, **{f"{b}bit": b for b in bits_list}}.items():
        ctx = SavedBytesCounter(exclude=model.buffers()) if b is None else daftrain.compress(bits=b, model=model)
        with ctx:
            loss_fn()
        rows[k] = {"saved_bytes": ctx.saved_bytes if b is None else ctx.stats.stored_bytes}
        print(f"  {name} {k}: {rows[k]['saved_bytes'] / 1e6:.1f} MB", flush=True)
    for row in rows.values():
        row.update(saved_ratio_vs_plain=rows["plain"]["saved_bytes"] / row["saved_bytes"],
                   step_time_median_s=float("nan"), step_time_ratio_vs_plain=float("nan"))
    return rows


def run_case(name: str, repeats: int, bits_list: list[int]) -> dict:
    model, loss_fn = CASES[name]()
    model.train()
    configs = {"plain": None, **{f"{b}bit": b for b in bits_list}}
    contexts = {k: daftrain.compress(bits=b, model=model) for k, b in configs.items() if b is not None}
    saved: dict[str, int] = {}
    times: dict[str, list[float]] = {k: [] for k in configs}
    for k in configs:  # warm-up (JIT compiles, allocator) and the byte counts
        ctx = contexts.get(k) or SavedBytesCounter(exclude=model.buffers())
        saved[k] = step(model, loss_fn, ctx)
    for r in range(repeats):
        for k in configs:
            ctx = contexts.get(k) or SavedBytesCounter(exclude=model.buffers())
            times[k].append(timed(lambda ctx=ctx: step(model, loss_fn, ctx)))
        print(f"  {name} repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {times[k][-1]:.2f}s" for k in configs),
              flush=True)
    plain_t = median(times["plain"])
    rows = {}
    for k in configs:
        rows[k] = {
            "saved_bytes": saved[k],
            "saved_ratio_vs_plain": saved["plain"] / saved[k],
            "step_time_median_s": median(times[k]),
            "step_time_ratio_vs_plain": median(times[k]) / plain_t,
            "step_times_s": times[k],
        }
        if k in contexts:
            rows[k]["stats"] = contexts[k].stats.summary()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,gpt2_small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bits", default="8,4,2")
    parser.add_argument("--bytes-only", action="store_true", help="one forward per config, no timing")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "saved_bytes.json"))
    args = parser.parse_args()
    bits_list = [int(b) for b in args.bits.split(",")]
    results, verdicts = {}, {}
    for name in args.models.split(","):
        print(f"{name}:", flush=True)
        results[name] = bytes_only(name, bits_list) if args.bytes_only else run_case(name, args.repeats, bits_list)
    print(f"\n{'model':<12} {'config':<7} {'saved MB':>9} {'x less':>7} {'step s':>7} {'x time':>7}")
    for name, rows in results.items():
        for k, row in rows.items():
            print(f"{name:<12} {k:<7} {row['saved_bytes'] / 1e6:>9.1f} {row['saved_ratio_vs_plain']:>7.2f} "
                  f"{row['step_time_median_s']:>7.3f} {row['step_time_ratio_vs_plain']:>7.2f}")
        if "2bit" in rows:
            ratio = rows["2bit"]["saved_ratio_vs_plain"]
            ok = ratio >= TARGETS[name]
            verdicts[name] = {"ratio_2bit": ratio, "target": TARGETS[name], "pass": ok}
            print(f"{name}: 2-bit saved-activation ratio {ratio:.2f}x (target >= {TARGETS[name]}x): "
                  f"{'PASS' if ok else 'FAIL'}")
    write_json(args.out, {"results": results, "targets": verdicts})


if __name__ == "__main__":
    main()
