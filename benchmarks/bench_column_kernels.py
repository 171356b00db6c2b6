"""Groups down the columns: the fused kernels against the reordering they replace and the row kernels.

    PYTHONPATH=src python benchmarks/bench_column_kernels.py [--mvalues 6] [--cols 64 384 1536] [--out PATH]
    PYTHONPATH=src python benchmarks/bench_column_kernels.py --device cuda --out PATH

For each ``[rows, cols]`` float32 tensor of about ``--mvalues`` million values (rows a multiple of the group
size), each bit-width and each grid (evenly spaced, and the input's fitted grid at 2 and 4 bits), it times
three ways of storing the tensor, round-robin within each repeat (so a burst of load on this shared machine
hits all three alike), as medians:

* ``rows``: ``quantize_pack`` / ``unpack_dequantize_into`` in memory order (groups along the rows: what
  ``compress(column_groups=False)`` stores);
* ``reordered``: ``reference.quantize_pack_columns`` / ``reference.unpack_dequantize_columns_into``, the
  stored order made by a copy around the fast row kernels (what a column record cost before the fused
  kernels);
* ``fused``: the ``daftrain::quantize_pack_columns`` / ``unpack_dequantize_columns_into`` ops (the numba
  kernels of ``NOTE [ Column kernels ]`` in ``kernels/cpu.py``; on ``--device cuda`` the Triton kernels of
  ``NOTE [ Groups down the columns on a GPU ]`` in ``kernels/triton.py``), byte-identical to ``reordered``.

On CUDA every call is followed by ``torch.cuda.synchronize()``: the times are the host's launch and the
device's work together.

JSON goes to ``--out`` (default ``benchmarks/results/column_kernels.json``), with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from daftrain.kernels import reference, registry
from daftrain.kernels.grids import fit_grid


def round_robin(fns: dict[str, Callable[[], Any]], repeats: int, device: str) -> dict[str, float]:
    """Median seconds of each function, the functions called in turn within each repeat."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    status = registry.load_fast_kernels(warmup=True)
    fast = {"cpu": "numba", "cuda": "triton"}[args.device]
    if getattr(status, args.device) != fast:
        raise SystemExit(f"the {fast} kernels did not load: {status}")
    G = args.group_size
    rows_out: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    for cols in args.cols:
        rows = max(1, int(args.mvalues * (1 << 20)) // (cols * G)) * G
        x = torch.randn(rows, cols, generator=gen).to(args.device)
        flat = x.view(-1)
        out = torch.empty_like(flat)
        for bits in args.bits:
            for fitted in (False, True) if bits in (2, 4) else (False,):
                grid = fit_grid(reference.columns_first(flat, cols, G), bits, G) if fitted else None
                if fitted and grid is None:
                    continue
                q = {
                    "rows": partial(torch.ops.daftrain.quantize_pack, flat, bits, G, 1, grid),
                    "reordered": partial(reference.quantize_pack_columns, flat, cols, bits, G, 1, grid),
                    "fused": partial(torch.ops.daftrain.quantize_pack_columns, flat, cols, bits, G, 1, grid),
                }
                along, down = q["rows"](), q["fused"]()
                d = {
                    "rows": partial(torch.ops.daftrain.unpack_dequantize_into, out, *along, bits, G, grid),
                    "reordered": partial(reference.unpack_dequantize_columns_into, out, *down, cols, bits, G, grid),
                    "fused": partial(torch.ops.daftrain.unpack_dequantize_columns_into, out, *down, cols, bits, G,
                                     grid),
                }
                for op, fns in (("quantize", q), ("decode", d)):
                    t = round_robin(fns, args.repeats, args.device)
                    row = {"op": op, "rows": rows, "cols": cols, "bits": bits, "fitted_grid": fitted,
                           **{f"{name}_ms": s * 1e3 for name, s in t.items()},
                           "fused_over_rows": t["fused"] / t["rows"],
                           "reordered_over_fused": t["reordered"] / t["fused"]}
                    rows_out.append(row)
                    print(f"{op:<9}{rows:>7} x {cols:<5}{bits:>3} bits {'fitted' if fitted else 'even':<7}"
                          f"rows {row['rows_ms']:7.2f} ms  reordered {row['reordered_ms']:7.2f} ms  "
                          f"fused {row['fused_ms']:7.2f} ms  fused/rows {row['fused_over_rows']:5.2f}x  "
                          f"reordered/fused {row['reordered_over_fused']:5.2f}x", flush=True)
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "kernels": registry.kernel_report(),
        "rows": rows_out,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mvalues", type=float, default=6.0, help="millions (2**20) of values per tensor")
    p.add_argument("--cols", type=int, nargs="+", default=[64, 384, 1536])
    p.add_argument("--bits", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--group-size", type=int, default=256)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "column_kernels.json"))
    args = p.parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2))
    print(f"load average {result['load_average']}\nwrote {out}")


if __name__ == "__main__":
    main()
