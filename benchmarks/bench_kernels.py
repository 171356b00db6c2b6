"""Throughput of the fast kernels against the reference and against ``copy_`` (the memory limit).

    PYTHONPATH=src python benchmarks/bench_kernels.py [--sizes 16] [--bits 1 2 4 8] [--out PATH]
    PYTHONPATH=src python benchmarks/bench_kernels.py --device cuda     # the Triton kernels on a GPU

For each size (millions of values) it measures, as medians over repeats, in one process:

* ``copy_`` of the input into a preallocated tensor of the same size: the physical limit, GB/s of
  input read (it also writes as many bytes); timed alternately with each fast op (this machine may
  be shared: a burst of load then slows both), so each row has its own copy figure;
* ``quantize_pack``: reference and fast (the registered ``daftrain::`` op), GB/s of input read;
* ``unpack_dequantize_into``: reference and fast decoding into a preallocated output, GB/s of output
  written. This is what backward runs (it decodes into reused buffers, ``NOTE [ Decode buffers ]``),
  so the unpack targets apply to it;
* the write limit of ``unpack_dequantize_into``, which reads a few bits per value and writes the
  whole output: ``fill_`` of that output (timed alternately with the decode) and, on CPU, libc's
  ``memset`` of it (which streams past the caches for large sizes), and a numba loop that stores one
  constant into it with the decode's threads (the fastest pure write the kernels' compiler emits,
  timed alternately with the decode), and ``fill_`` right after a ``copy_``, in the cache state the
  decode itself is timed in (``fill_after_copy_ms``). ``reference_over_fill_after_copy`` is the
  speed-up over the reference that a decode as fast as a pure write would have;
* on CPU a float32 decode of at least ``STREAMING_BYTES`` (32 MiB) stores non-temporally
  (``NOTE [ Streaming stores ]`` in ``kernels/cpu.py``; ``streaming_stores`` in the row): its output is
  then not in cache afterwards, so the ``fill_`` timed alternately with it is a cold one too;
* ``unpack_dequantize``: reference and fast, each allocating its output (first-touch page faults are
  then part of the cost): what a caller without a buffer pays, shown for comparison;
* every reference is timed alternately with ``copy_`` too, like its fast op: the speed-up compares
  the two under one protocol and cache state (the copy evicts a decode's output, so both write to
  cold memory). ``reference_alone_ms`` and ``fast_alone_ms`` are their back-to-back medians (warm
  caches, as in a loop over one buffer), and ``speedup_alone`` (the ``alone`` column) their ratio;
* with ``--grid`` (2 and 4 bits), quantize and decode on the fitted grid ``fit_grid`` gives the input
  (``NOTE [ Fitted grids ]`` in ``kernels/grids.py``), reference and fast alike;
* ``group_minmax`` with each reduction strategy (``per_group``, ``two_level``) and the registered op
  (whatever the ``ReductionSelector`` calibrated).

``--device cpu`` (default) measures the numba kernels, ``--device cuda`` the Triton kernels (the
reference then runs on the GPU too, and ``copy_`` is a device-to-device copy); on CUDA every timed
call ends with ``torch.cuda.synchronize()``.

and the ratios fast / copy (fraction of the memory bandwidth) and fast / reference (speed-up). The
targets, printed PASS/FAIL: quantize_pack and unpack_dequantize_into at 2 and 4 bits reach >= 50 % of the
copy bandwidth and are >= 15x faster than the reference. Threads: ``torch.get_num_threads()`` (or
``--threads``); the numba kernels follow it. JSON goes to ``--out`` (default ``benchmarks/results/kernels.json``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from daftrain.kernels import (
    cpu,
    ops,  # noqa: F401
    reference,
    registry,
)
from daftrain.kernels.grids import fit_grid

TARGET_COPY_FRACTION = 0.5
TARGET_SPEEDUP = 15.0
TARGET_BITS = (2, 4)
TARGET_OPS = ("quantize_pack", "unpack_dequantize_into")
DEFAULT_OUT = {"cpu": "kernels.json", "cuda": "kernels_cuda.json"}
DEFAULT_SIZES = {"cpu": [16.0], "cuda": [64.0, 256.0]}


_BEST: dict[int, float] = {}  # id(fn) -> best time of its last measurement (reported beside the median)


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    _BEST[id(fn)] = min(times)
    return statistics.median(times)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(median, best) seconds."""
    med = median_seconds(fn, repeats)
    return med, _BEST[id(fn)]


def paired(copy: Callable[[], Any], fn: Callable[[], Any], repeats: int) -> tuple[float, float, float]:
    """Medians of ``copy`` and ``fn`` timed alternately (so that a burst of load on this shared
    machine hits both alike), and the best time of ``fn``."""
    copy()
    fn()
    t_copy, t_fn = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        t_copy.append(t1 - t0)
        t_fn.append(t2 - t1)
    return statistics.median(t_copy), statistics.median(t_fn), min(t_fn)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def paired_and_alone(
    copy: Callable[[], Any], fn: Callable[[], Any], repeats: int
) -> tuple[float, float, float, float]:
    """``paired(copy, fn)`` (medians of ``copy`` and ``fn`` timed alternately, best of ``fn``), then the
    median of ``fn`` back to back (warm caches). Fast ops and references are timed alike: the speed-up
    compares them under one protocol and cache state."""
    t_copy, t_fn, best = paired(copy, fn, repeats)
    return t_copy, t_fn, best, median_seconds(fn, repeats, warmup=0)


def synchronized(device: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` that returns only when the device has finished its work (CUDA launches are asynchronous)."""
    if device != "cuda":
        return fn

    def call() -> Any:
        out = fn()
        torch.cuda.synchronize()
        return out

    return call


def store_loop() -> Callable[[torch.Tensor, int], None]:
    """A parallel numba loop storing a constant into a float32 tensor: a decode's write limit."""
    import numpy as np
    from numba import njit, prange

    # NOTE: each task stores through a slice indexed from 0. Indexing ``out`` itself from
    # ``c * per`` (a signed index numba wraps around) was 2-3x slower than ``fill_`` at 1-16 Mi values,
    # which made this a wrong limit in earlier runs; the slice form runs at ``fill_``'s speed.
    @njit(parallel=True, nogil=True, cache=False)
    def store(out, value, nchunks):  # type: ignore[no-untyped-def]
        n = out.shape[0]
        per = (n + nchunks - 1) // nchunks
        for c in prange(nchunks):
            part = out[c * per : min(n, (c + 1) * per)]
            for i in range(part.shape[0]):
                part[i] = value

    def call(out: torch.Tensor, threads: int) -> None:
        store(out.numpy(), np.float32(1.0), threads)

    return call


def run(args: argparse.Namespace) -> dict[str, Any]:
    status = registry.load_fast_kernels(warmup=True)
    device = args.device
    if device == "cuda":
        if status.cuda != "triton":
            raise SystemExit(f"the Triton kernels did not load: {status}")
        from daftrain.kernels import triton as backend
    else:
        if status.cpu != "numba":
            raise SystemExit(f"the numba kernels did not load: {status}")
        backend = cpu
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    store = store_loop() if device == "cpu" else None
    rows: list[dict[str, Any]] = []
    minmax_rows: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)

    def sync(fn: Callable[[], Any]) -> Callable[[], Any]:
        return synchronized(device, fn)

    for size_m in args.sizes:
        numel = int(size_m * (1 << 20))
        x = torch.randn(numel, generator=gen)
        x = (torch.relu(x) if args.input == "relu" else x).to(dtype).to(device)
        nbytes = numel * x.element_size()
        dst = torch.empty_like(x)
        copy = sync(partial(dst.copy_, x))
        t_copy, best_copy = timed(copy, args.repeats)
        copy_gbps = gbps(nbytes, t_copy)
        G = args.group_size
        for bits in args.bits:
            grid = fit_grid(x, bits, G) if args.grid else None
            if args.grid and grid is None:
                raise SystemExit(f"--grid: the uniform grid fits this input best at {bits} bits")
            _, t_ref_q, _, alone_q = paired_and_alone(
                copy, sync(partial(reference.quantize_pack, x, bits, G, 1, grid)), args.ref_repeats
            )
            copy_q, t_fast_q, best_q, fast_alone_q = paired_and_alone(
                copy, sync(partial(torch.ops.daftrain.quantize_pack, x, bits, G, 1, grid)), args.repeats
            )
            codes, lo, scale = torch.ops.daftrain.quantize_pack(x, bits, G, 1, grid)
            out = torch.empty_like(x)
            _, t_ref_i, _, alone_i = paired_and_alone(
                copy, sync(partial(reference.unpack_dequantize_into, out, codes, lo, scale, bits, G, grid)),
                args.ref_repeats,
            )
            decode = sync(partial(torch.ops.daftrain.unpack_dequantize_into, out, codes, lo, scale, bits, G, grid))
            copy_i, t_fast_i, best_i, fast_alone_i = paired_and_alone(copy, decode, args.repeats)
            # the write limit of a decode: it reads a few bits per value and writes the whole output
            fill = sync(partial(out.fill_, 1.0))
            fill_i, t_fast_fill, _ = paired(fill, decode, args.repeats)
            # the same write after a copy_, in the cache state the decode is timed in above
            _, cold_fill_i, _ = paired(copy, fill, args.repeats)
            t_memset = store_i = t_fast_store = None
            if device == "cpu":
                t_memset, _ = timed(partial(ctypes.memset, out.data_ptr(), 0, nbytes), args.repeats)
                if dtype == torch.float32:
                    store_i, t_fast_store, _ = paired(partial(store, out, threads), decode, args.repeats)
            _, t_ref_u, _, alone_u = paired_and_alone(
                copy, sync(partial(reference.unpack_dequantize, codes, lo, scale, bits, G, numel, dtype, grid)),
                args.ref_repeats,
            )
            copy_u, t_fast_u, best_u, fast_alone_u = paired_and_alone(
                copy,
                sync(partial(torch.ops.daftrain.unpack_dequantize, codes, lo, scale, bits, G, numel, dtype, grid)),
                args.repeats,
            )
            for op, t_ref, t_ref_alone, t_fast, t_fast_alone, best, t_pair_copy in (
                ("quantize_pack", t_ref_q, alone_q, t_fast_q, fast_alone_q, best_q, copy_q),
                ("unpack_dequantize_into", t_ref_i, alone_i, t_fast_i, fast_alone_i, best_i, copy_i),
                ("unpack_dequantize", t_ref_u, alone_u, t_fast_u, fast_alone_u, best_u, copy_u),
            ):
                fast_gbps = gbps(nbytes, t_fast)
                pair_copy_gbps = gbps(nbytes, t_pair_copy)
                row = {
                    "op": op,
                    "size_mvalues": size_m,
                    "numel": numel,
                    "dtype": args.dtype,
                    "bits": bits,
                    "fitted_grid": grid is not None,
                    "group_size": G,
                    "copy_ms": t_pair_copy * 1e3,
                    "copy_first_ms": t_copy * 1e3,
                    "copy_first_best_ms": best_copy * 1e3,
                    "copy_gbps": pair_copy_gbps,
                    "reference_ms": t_ref * 1e3,
                    "reference_gbps": gbps(nbytes, t_ref),
                    "reference_alone_ms": t_ref_alone * 1e3,
                    "fast_ms": t_fast * 1e3,
                    "fast_best_ms": best * 1e3,
                    "fast_gbps": fast_gbps,
                    "fraction_of_copy": fast_gbps / pair_copy_gbps,
                    "speedup_vs_reference": t_ref / t_fast,
                    "fast_alone_ms": t_fast_alone * 1e3,
                    "speedup_alone": t_ref_alone / t_fast_alone,
                }
                if op == "unpack_dequantize_into":
                    row["streaming_stores"] = device == "cpu" and cpu.streams(out)
                    row.update({
                        "fill_ms": fill_i * 1e3, "fast_paired_with_fill_ms": t_fast_fill * 1e3,
                        "fraction_of_fill": fill_i / t_fast_fill, "reference_over_fill": t_ref / fill_i,
                        "fill_after_copy_ms": cold_fill_i * 1e3, "fraction_of_fill_after_copy": cold_fill_i / t_fast,
                        "reference_over_fill_after_copy": t_ref / cold_fill_i,
                        "memset_ms": t_memset * 1e3 if t_memset is not None else None,
                        "reference_over_memset": t_ref / t_memset if t_memset is not None else None,
                        "store_loop_ms": store_i * 1e3 if store_i is not None else None,
                        "fast_paired_with_store_loop_ms": t_fast_store * 1e3 if t_fast_store is not None else None,
                        "fraction_of_store_loop": store_i / t_fast_store if store_i is not None else None,
                    })
                if bits in TARGET_BITS and op in TARGET_OPS:
                    row["pass_copy"] = row["fraction_of_copy"] >= TARGET_COPY_FRACTION
                    row["pass_speedup"] = row["speedup_vs_reference"] >= TARGET_SPEEDUP
                rows.append(row)
        t_ref_mm = median_seconds(sync(partial(reference.group_minmax, x, G)), args.ref_repeats)
        flat = x.reshape(-1)
        entry: dict[str, Any] = {
            "size_mvalues": size_m,
            "group_size": G,
            "copy_gbps": copy_gbps,
            "reference_gbps": gbps(nbytes, t_ref_mm),
            "strategies": list(backend.STRATEGIES),
        }
        for name, fn in backend.STRATEGIES.items():
            entry[f"{name}_gbps"] = gbps(nbytes, median_seconds(sync(partial(fn, flat, G)), args.repeats))
        entry["op_gbps"] = gbps(
            nbytes, median_seconds(sync(partial(torch.ops.daftrain.group_minmax, x, G)), args.repeats)
        )
        minmax_rows.append(entry)
    return {
        "device": device,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": threads,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "kernels": registry.kernel_report(),
        "targets": {"fraction_of_copy": TARGET_COPY_FRACTION, "speedup": TARGET_SPEEDUP, "bits": list(TARGET_BITS),
                    "ops": list(TARGET_OPS)},
        "rows": rows,
        "group_minmax": minmax_rows,
    }


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(f"{result['device']}{' (' + m['gpu'] + ')' if m['gpu'] else ''}: torch {m['torch']}, "
          f"{m['torch_threads']} threads, {m['cpu_count']} CPUs, load {m['load_average']}")
    head = (
        f"{'op':<23}{'MiV':>5}{'bits':>5}{'copy GB/s':>10}{'ref GB/s':>9}{'fast GB/s':>10}"
        f"{'fast ms':>9}{'%copy':>7}{'x ref':>7}{'alone':>7}  target"
    )
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        verdict = ""
        if "pass_copy" in r:
            verdict = (
                f"{'PASS' if r['pass_copy'] else 'FAIL'} >=50% copy, "
                f"{'PASS' if r['pass_speedup'] else 'FAIL'} >=15x"
            )
        print(
            f"{r['op']:<23}{r['size_mvalues']:>5g}{r['bits']:>5}{r['copy_gbps']:>10.2f}{r['reference_gbps']:>9.2f}"
            f"{r['fast_gbps']:>10.2f}{r['fast_ms']:>9.2f}{100 * r['fraction_of_copy']:>6.0f}%"
            f"{r['speedup_vs_reference']:>6.1f}x{r['speedup_alone']:>6.1f}x  {verdict}"
        )
    print()
    print("write limit of unpack_dequantize_into: fill_ of its output, alternating with the decode (warm) and")
    print("after a copy_ (cold, as the decode and the reference are timed above); ref/cold: the most a decode")
    print("with cached stores could gain over the reference there (from 32 MiB of output the decode streams")
    print("past the cache instead: NOTE [ Streaming stores ], and the fill_ beside it is cold too)")
    print(f"{'':<23}{'MiV':>5}{'bits':>5}{'fill ms':>9}{'decode/fill':>12}{'cold ms':>9}{'decode/cold':>12}"
          f"{'ref/cold':>9}{'memset ms':>10}{'store ms':>9}{'decode/store':>13}")
    nan = float("nan")
    for r in result["rows"]:
        if "fill_ms" in r:
            memset, store = r["memset_ms"], r["store_loop_ms"]
            print(f"{'':<23}{r['size_mvalues']:>5g}{r['bits']:>5}{r['fill_ms']:>9.2f}"
                  f"{100 * r['fraction_of_fill']:>11.0f}%{r['fill_after_copy_ms']:>9.2f}"
                  f"{100 * r['fraction_of_fill_after_copy']:>11.0f}%{r['reference_over_fill_after_copy']:>8.1f}x"
                  f"{memset if memset is not None else nan:>10.2f}"
                  f"{store if store is not None else nan:>9.2f}"
                  f"{100 * r['fraction_of_store_loop'] if store is not None else nan:>12.0f}%")
    print()
    names = result["group_minmax"][0]["strategies"]
    strategies = "".join(f"{k:>11}" for k in names)
    print(f"{'group_minmax':<23}{'MiV':>5}{'copy':>8}{'ref':>8}{strategies}{'op':>8}  (GB/s)")
    for e in result["group_minmax"]:
        print(
            f"{'':<23}{e['size_mvalues']:>5g}{e['copy_gbps']:>8.2f}{e['reference_gbps']:>8.2f}"
            + "".join(f"{e[f'{k}_gbps']:>11.2f}" for k in names)
            + f"{e['op_gbps']:>8.2f}"
        )
    choices = result["kernels"]["reduction"].get(result["device"], {}).get("choices", [])
    for c in choices:
        print(
            f"  selector: {c['dtype']}, {c['groups']} groups, {c['group_size']} G -> {c['strategy']} "
            f"(calibration ms: {c['timings_ms']})"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", type=float, nargs="+", default=None,
                   help="millions (2**20) of values (default 16 on cpu, 64 and 256 on cuda)")
    p.add_argument("--bits", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--group-size", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--input", default="randn", choices=["randn", "relu"],
                   help="relu: every group zero-exact (min exactly 0), as a ReLU output's")
    p.add_argument("--grid", action="store_true",
                   help="2 and 4 bits on the input's fitted grid (NOTE [ Fitted grids ] in kernels/grids.py)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--ref-repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first (numba follows)")
    p.add_argument("--out", default=None, help="default benchmarks/results/kernels.json (kernels_cuda.json)")
    args = p.parse_args(argv)
    args.sizes = args.sizes or DEFAULT_SIZES[args.device]
    args.out = args.out or str(Path(__file__).resolve().parent / "results" / DEFAULT_OUT[args.device])
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
