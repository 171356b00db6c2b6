"""Shared helpers for the benchmark scripts: timing, JSON output, environment description."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
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


ZOOS = ("transformers", "torch")
"""The zoo benchmarks' architectures: ``TINY_ZOO`` of ``demo/models/transformers_zoo.py`` (Hugging Face
models from tiny configs) or ``TORCH_ZOO`` of ``demo/models/torch_zoo.py`` (``torch.nn`` alone)."""


def zoo_entries(zoo: str) -> list[tuple[str, str, dict[str, Any]]]:
    """``(model_type, kind, overrides)`` of every architecture of ``zoo`` (one of ``ZOOS``)."""
    if zoo == "torch":
        from daftrain.demo.models.torch_zoo import TORCH_ZOO

        return [(name, "torch", {}) for name in TORCH_ZOO]
    from daftrain.demo.models.transformers_zoo import TINY_ZOO

    return list(TINY_ZOO)


def build_zoo_model(model_type: str, kind: str, overrides: dict[str, Any],
                    device: str = "cpu") -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model of one zoo entry and its keyword inputs, from the same seeds every time: built on the CPU and
    moved to ``device``."""
    if kind == "torch":
        from daftrain.demo.models.torch_zoo import zoo_inputs, zoo_model

        model, inputs = zoo_model(model_type), zoo_inputs(model_type)
    else:
        from daftrain.demo.models.transformers_zoo import tiny_inputs, tiny_model

        model = tiny_model(model_type, overrides)
        inputs = tiny_inputs(model, kind)
    return model.to(device), {k: v.to(device) for k, v in inputs.items()}


@contextlib.contextmanager
def recorded(row: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Measure one zoo model into ``row``: ``status`` "ok", or "error" with the exception's message and
    trace (a crash is a row of the table, and a target miss, not the end of the run); ``seconds``."""
    t0 = time.perf_counter()
    try:
        yield row
        row["status"] = "ok"
    except Exception as exc:
        row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300], trace=traceback.format_exc()[-800:])
    row["seconds"] = time.perf_counter() - t0


def measured(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows ``recorded`` measured without an error, and a summary's head: how many models ran and
    which raised."""
    ok = [r for r in rows if r["status"] == "ok"]
    return ok, {"models": len(rows), "errors": [r["model"] for r in rows if r["status"] != "ok"]}


def ratio_to_plain(plain_bytes: int, stats: Any) -> float:
    """Plain PyTorch's saved bytes (``plain_bytes``: ``raw_bytes`` of an exact-mode run, which saves what plain
    saves) over what a context stored. ``stats.ratio`` divides the bytes of what was saved *under* the context,
    which op-level savings (attention that saves only its inputs, the loss over a head) make fewer."""
    return plain_bytes / stats.stored_bytes if stats.stored_bytes else 1.0

