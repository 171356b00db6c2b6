"""Shared fixtures. pytest puts this folder on ``sys.path``, so every test module can import ``helpers``."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator

import pytest
import torch


def _import_triton_interpreted() -> None:
    """Without CUDA, import triton (where installed) in interpreter mode before any test can import it
    otherwise: ``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, triton's own library
    functions included, and other tests (``torch.library.opcheck``, ``torch.compile``) import triton too.
    The variable is set only for that import; ``tests/kernels/test_triton.py`` uses the result."""
    if torch.cuda.is_available() or "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


_import_triton_interpreted()


def _devices() -> list[str]:
    return ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=_devices())
def device(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each device this machine has: ``cpu``, and ``cuda`` where a GPU is present. On CUDA, cuDNN runs its
    deterministic algorithms (and no benchmarking) for the test, so that two runs of one computation agree
    bit for bit, as they do on CPU."""
    if request.param != "cuda":
        yield request.param
        return
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield request.param
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved
