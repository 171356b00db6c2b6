"""End-to-end step time: daftrain 2-bit (synchronous and asynchronous packing) vs plain PyTorch.

One process, one model instance, the configurations interleaved within every repeat (so a burst of
load on a shared machine hits all of them alike), medians over repeats. A step is forward, backward
and an SGD update. Plain PyTorch runs with no hooks at all.

* ResNet-18 (CIFAR-style, 3x32x32, batch 128): target overhead <= 10 % (aim 5 %).
* GPT-2 small (from a config, seq 256, batch 8, eager attention): target overhead <= 10 %.

``asynchronous`` packs on a worker thread while forward goes on and decodes one record ahead in
backward (``packer.py``); on a machine with few cores the worker competes with PyTorch's own
threads, which the JSON records (``threads``). ``pool`` stores the records in a ``PagePool`` (no
per-record allocation in steady state): the pooled vs unpooled step time of the page-pool issue.
``fresh_decode`` (CPU) decodes into fresh memory instead of reused buffers (``decode_buffers=False``).

    python benchmarks/bench_overhead.py [--models resnet18,gpt2_small] [--repeats 5] [--bits 2]
    python benchmarks/bench_overhead.py --device cuda --no-pool    # on a GPU (Triton kernels)

On CUDA every step ends with ``torch.cuda.synchronize()`` before its time is read; the page pool
configurations (host-memory pages) are for CPU training and are left out with ``--no-pool``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import median, timed, write_json

import daftrain
from daftrain.demo.models.resnet import resnet18
from daftrain.demo.models.transformers_zoo import gpt2_lm
from daftrain.pool.store import PagePool

TARGET_OVERHEAD = 0.10


def resnet_case(device: str):
    torch.manual_seed(0)
    model = resnet18(num_classes=10).to(device)
    x, y = torch.randn(128, 3, 32, 32).to(device), torch.randint(0, 10, (128,)).to(device)
    return model, lambda: F.cross_entropy(model(x), y)


def gpt2_case(device: str):
    model = gpt2_lm(seed=0).to(device)
    ids = torch.randint(0, 50257, (8, 256), generator=torch.Generator().manual_seed(0)).to(device)
    return model, lambda: model(input_ids=ids, labels=ids).loss


CASES = {"resnet18": resnet_case, "gpt2_small": gpt2_case}


def run_case(name: str, repeats: int, bits: int, pool: bool, device: str = "cpu") -> dict:
    model, loss_fn = CASES[name](device)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    contexts = {
        "plain": None,
        f"{bits}bit_sync": daftrain.compress(bits=bits, model=model),
        f"{bits}bit_async": daftrain.compress(bits=bits, model=model, asynchronous=True),
    }
    pools = []
    if pool:
        pools = [PagePool(), PagePool()]
        contexts[f"{bits}bit_sync_pool"] = daftrain.compress(bits=bits, model=model, pool=pools[0])
        contexts[f"{bits}bit_async_pool"] = daftrain.compress(bits=bits, model=model, asynchronous=True,
                                                             pool=pools[1])
    if device == "cpu":  # the effect of decoding into reused buffers (NOTE [ Decode buffers ])
        fresh_pool = PagePool() if pool else None
        pools += [fresh_pool] if fresh_pool is not None else []
        contexts[f"{bits}bit_sync{'_pool' if pool else ''}_fresh_decode"] = daftrain.compress(
            bits=bits, model=model, pool=fresh_pool, decode_buffers=False)

    def step(ctx) -> None:
        opt.zero_grad(set_to_none=True)
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = loss_fn()
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    for ctx in contexts.values():  # warm-up: JIT caches, allocator, calibration
        step(ctx)
    times: dict[str, list[float]] = {k: [] for k in contexts}
    for r in range(repeats):
        order = list(contexts) if r % 2 == 0 else list(reversed(contexts))
        for k in order:
            times[k].append(timed(lambda ctx=contexts[k]: step(ctx)))
        print(f"  {name} repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {times[k][-1]:.3f}s" for k in contexts),
              flush=True)
    plain = median(times["plain"])
    rows = {}
    for k, ctx in contexts.items():
        rows[k] = {"step_time_median_s": median(times[k]), "overhead_vs_plain": median(times[k]) / plain - 1,
                   "step_times_s": times[k]}
        if ctx is not None:
            rows[k]["stats"] = ctx.stats.summary()
            if ctx.pool is not None:
                rows[k]["pool"] = dataclasses.asdict(ctx.pool.stats())
            ctx.close()
    for p in pools:
        p.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,gpt2_small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--no-pool", action="store_true", help="leave out the pooled configurations")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None, help="default benchmarks/results/overhead.json (overhead_cuda.json)")
    args = parser.parse_args()
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    args.out = args.out or str(Path(__file__).parent / "results" / f"overhead{suffix}.json")
    results, verdicts = {}, {}
    for name in args.models.split(","):
        print(f"{name}:", flush=True)
        rows = run_case(name, args.repeats, args.bits, pool=not args.no_pool, device=args.device)
        results[name] = rows
        best = min((k for k in rows if k != "plain"), key=lambda k: rows[k]["overhead_vs_plain"])
        ok = rows[best]["overhead_vs_plain"] <= TARGET_OVERHEAD
        verdicts[name] = {"best": best, "overhead": rows[best]["overhead_vs_plain"], "target": TARGET_OVERHEAD,
                          "pass": ok}
    print(f"\n{'model':<12} {'config':<28} {'step s':>8} {'overhead':>9}")
    for name, rows in results.items():
        for k, row in rows.items():
            print(f"{name:<12} {k:<28} {row['step_time_median_s']:>8.3f} {row['overhead_vs_plain']:>+9.1%}")
        v = verdicts[name]
        print(f"{name}: best daftrain overhead {v['overhead']:+.1%} ({v['best']}; target <= {TARGET_OVERHEAD:.0%}): "
              f"{'PASS' if v['pass'] else 'FAIL'}")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    write_json(args.out, {"device": args.device, "gpu": gpu, "command": " ".join(sys.argv), "repeats": args.repeats,
                          "bits": args.bits, "results": results, "targets": verdicts})


if __name__ == "__main__":
    main()
