"""``torch.compile`` with and without ``daftrain.compress``: saved bytes, step time, peak RSS.

Three configurations per model: ``eager`` (plain PyTorch), ``compiled`` (``torch.compile``, inductor) and
``compiled_2bit`` (the compiled model run under ``daftrain.compress(bits=2)``: the hooks are inlined into
the compiled graphs, see ``NOTE [ Hooks inside compiled graphs ]`` in ``saved/compiled.py``).

* Saved bytes: eager, what autograd saves (``SavedBytesCounter``, parameters left out); compiled, the
  saved intermediates the compiled graphs hold per step and what compress stores for them
  (``CompressionStats.compiled_raw_bytes`` / ``compiled_stored_bytes``, recorded when the graphs are
  compiled; inputs and parameters are not offered to the hooks and not counted).
* Step time (forward, backward, SGD update): one process, the configurations interleaved within every
  repeat, medians over ``--repeats`` timed steps after two warm-up steps (compilation included there).
* Peak RSS: each configuration in a fresh process; the kernel's high-water mark is reset after warm-up
  (so compilation's own memory is not counted) and read after ``--rss-steps`` steps.

ResNet-18 (CIFAR-style, 3x32x32, batch 64) and GPT-2 small (from a config, seq 256, batch 4).

    flock /tmp/daftrain-bench.lock python benchmarks/bench_compile.py [--models resnet18,gpt2_small]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
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
from daftrain.rss import peak_rss_bytes, reset_peak_rss

CONFIGS = ("eager", "compiled", "compiled_2bit")
BITS = 2


def resnet_case():
    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    return model, lambda m: F.cross_entropy(m(x), y)


def gpt2_case():
    model = gpt2_lm(seed=0)
    ids = torch.randint(0, 50257, (4, 256), generator=torch.Generator().manual_seed(0))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


CASES = {"resnet18": resnet_case, "gpt2_small": gpt2_case}


def _setup(name: str):
    model, loss_fn = CASES[name]()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    compiled = torch.compile(model)
    ctx = daftrain.compress(bits=BITS, model=model)
    runs = {"eager": (model, None), "compiled": (compiled, None), "compiled_2bit": (compiled, ctx)}

    def step(config: str) -> None:
        module, context = runs[config]
        opt.zero_grad(set_to_none=True)
        with context if context is not None else contextlib.nullcontext():
            loss = loss_fn(module)
        loss.backward()
        opt.step()

    return model, loss_fn, ctx, step


def run_timing(name: str, repeats: int) -> dict:
    model, loss_fn, ctx, step = _setup(name)
    for config in CONFIGS:  # warm-up: compilation, allocator, kernel caches
        for _ in range(2):
            step(config)
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for r in range(repeats):
        for config in CONFIGS if r % 2 == 0 else reversed(CONFIGS):
            times[config].append(timed(lambda c=config: step(c)))
        print(f"  {name} repeat {r + 1}/{repeats}: " + ", ".join(f"{c} {times[c][-1]:.3f}s" for c in CONFIGS),
              flush=True)
    counter = SavedBytesCounter(model=model)
    with counter:
        loss = loss_fn(model)
    del loss
    stats = ctx.stats
    eager_time = median(times["eager"])
    compiled_time = median(times["compiled"])
    rows = {
        c: {"step_time_median_s": median(times[c]), "step_times_s": times[c],
            "vs_eager": median(times[c]) / eager_time, "vs_compiled": median(times[c]) / compiled_time}
        for c in CONFIGS
    }
    rows["eager"]["saved_bytes"] = counter.saved_bytes
    rows["compiled"]["saved_bytes"] = stats.compiled_raw_bytes  # the same saved set, before the hooks
    rows["compiled_2bit"]["saved_bytes"] = stats.compiled_stored_bytes
    rows["compiled_2bit"]["stats"] = stats.summary()
    rows["compiled_2bit"]["compiled_quantized"] = stats.compiled_quantized
    rows["compiled_2bit"]["compiled_saved"] = stats.compiled_saved
    rows["compiled_2bit"]["compiled_graphs"] = stats.compiled_graphs
    rows["compiled_2bit"]["eager_tensors_seen"] = stats.tensors_seen
    return rows


def child(name: str, config: str, steps: int) -> None:
    """One configuration in this (fresh) process: print its steady-state peak RSS as JSON."""
    _, _, _, step = _setup(name)
    for _ in range(2):
        step(config)
    reset = reset_peak_rss()
    for _ in range(steps):
        step(config)
    print(json.dumps({"peak_rss_bytes": peak_rss_bytes(), "peak_reset": reset}))


def run_rss(name: str, steps: int) -> dict:
    out = {}
    for config in CONFIGS:
        proc = subprocess.run([sys.executable, __file__, "--child", name, config, "--rss-steps", str(steps)],
                              capture_output=True, text=True, check=True)
        out[config] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"  {name} {config}: peak RSS {out[config]['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,gpt2_small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rss-steps", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile.json"))
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.rss_steps)
        return
    results = {}
    for name in args.models.split(","):
        print(f"{name}:", flush=True)
        rows = run_timing(name, args.repeats)
        for config, rss in run_rss(name, args.rss_steps).items():
            rows[config].update(rss)
        results[name] = rows
    print(f"\n{'model':<11} {'config':<14} {'saved MB':>9} {'step s':>7} {'vs eager':>9} {'vs compiled':>12} "
          f"{'peak RSS MiB':>13}")
    for name, rows in results.items():
        for config, row in rows.items():
            print(f"{name:<11} {config:<14} {row['saved_bytes'] / 1e6:>9.1f} {row['step_time_median_s']:>7.3f} "
                  f"{row['vs_eager']:>9.2f} {row['vs_compiled']:>12.2f} {row['peak_rss_bytes'] / 2**20:>13.0f}")
        ratio = rows["compiled"]["saved_bytes"] / max(rows["compiled_2bit"]["saved_bytes"], 1)
        c2 = rows["compiled_2bit"]
        print(f"{name}: compiled 2-bit stores {ratio:.1f}x fewer saved bytes than compiled "
              f"({c2['compiled_quantized']} of {c2['compiled_saved']} saved tensors quantized)")
    write_json(args.out, {"command": "python " + " ".join(sys.argv), "bits": BITS, "results": results})


if __name__ == "__main__":
    main()
