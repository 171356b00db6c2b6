"""Shared helpers for the benchmark scripts: timing, JSON output, environment description."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def environment() -> dict[str, Any]:
    import daftrain
    from daftrain.kernels.registry import kernel_report

    return {
        "daftrain": daftrain.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "kernels": kernel_report(),
        "load_average": list(os.getloadavg()),
    }


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2, default=str))
    print(f"wrote {path}")
