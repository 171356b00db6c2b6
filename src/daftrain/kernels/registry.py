"""Registration of the fast kernels beside the reference, with a graceful fallback.

``load_fast_kernels()`` imports the CPU (numba) backend and, where CUDA and Triton are available, the
Triton backend, and registers their kernels for the ``cpu`` / ``cuda`` device keys of the
``daftrain::`` ops (``ops.py``). Whatever cannot be imported or JIT-compiled is left to the pure
PyTorch reference, which stays registered for every device, and ONE ``warnings.warn`` per call of
``load_fast_kernels`` (or per first failure at run time) says what failed and that the reference runs.
``DAFTRAIN_DISABLE_FAST_KERNELS=1`` skips the registration entirely.

numba compiles lazily (first call of each dtype, then from its on-disk cache), so a compile failure
can also surface at the first call: the registered wrapper then warns once, permanently routes that
backend to the reference and returns the reference's result.

State: this module owns the one ``KernelStatus`` and the one default ``ReductionSelector`` per
backend (documented module-level state; everything else is explicit objects).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DISABLE_ENV", "KernelStatus", "kernel_report", "load_fast_kernels"]

DISABLE_ENV = "DAFTRAIN_DISABLE_FAST_KERNELS"
_OPS = ("group_minmax", "quantize_pack", "unpack_dequantize", "unpack_dequantize_into", "pack_bool", "unpack_bool")


@dataclass
class KernelStatus:
    """What ``load_fast_kernels`` registered.

    ``cpu``: "numba" | "reference" (failed) | "disabled"; ``cuda``: "triton" | "reference" (failed) |
    "unavailable" (no CUDA device or no triton: nothing to do) | "disabled".
    """

    cpu: str = "reference"
    cuda: str = "unavailable"
    errors: dict[str, str] = field(default_factory=dict)
    disabled: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu, "cuda": self.cuda, "errors": dict(self.errors), "disabled": self.disabled}


_lock = threading.Lock()
_status: KernelStatus | None = None
_selectors: dict[str, Any] = {}


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _describe_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _guarded(backend: str, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a backend kernel: validate the arguments; on a JIT compile failure at run time, warn once
    and use the reference."""
    import torch

    from . import ops, reference

    ref = getattr(reference, name)
    check = ops.ARGUMENT_CHECKS[name]
    compile_errors: tuple[type[BaseException], ...] = ()
    if backend == "cpu":
        from numba.core.errors import NumbaError

        compile_errors = (NumbaError,)
    else:
        try:  # compile errors, ptxas failures, kernels needing more resources than the GPU has
            from triton.errors import TritonError

            compile_errors = (TritonError,)
        except Exception:  # pragma: no cover - depends on the triton version
            try:
                from triton.compiler.errors import CompilationError

                compile_errors = (CompilationError,)
            except Exception:
                compile_errors = ()

    mutated = ops.mutated_positions(name)

    def write_and_bump(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        for i in mutated:  # it wrote through a raw pointer; see NOTE [ Op registration ]
            torch.autograd.graph.increment_version(args[i])
        return out

    run = write_and_bump if mutated else fn

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        status = _status
        if status is not None and getattr(status, backend) == "reference":
            return ref(*args, **kwargs)
        try:
            return run(*args, **kwargs)
        except compile_errors as exc:
            with _lock:
                if status is not None and getattr(status, backend) != "reference":
                    setattr(status, backend, "reference")
                    status.errors[backend] = _describe_error(exc)
                    warnings.warn(
                        f"daftrain: the fast {backend} kernel {name} failed to compile "
                        f"({_describe_error(exc)}); the pure PyTorch reference kernels run instead",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            return ref(*args, **kwargs)

    return kernel


def _register_cpu(status: KernelStatus) -> str | None:
    try:
        import torch

        from . import cpu
        from .reduction import ReductionSelector

        selector = _selectors.get("cpu") or ReductionSelector("cpu", cpu.STRATEGIES, threads=cpu.threads)
        kernels = cpu.make_kernels(selector)
        for name in _OPS:
            torch.library.register_kernel(f"daftrain::{name}", "cpu", _guarded("cpu", name, kernels[name]))
    except Exception as exc:
        status.cpu = "reference"
        status.errors["cpu"] = _describe_error(exc)
        return f"numba CPU kernels ({_describe_error(exc)})"
    _selectors["cpu"] = selector
    status.cpu = "numba"
    return None


def _register_cuda(status: KernelStatus) -> str | None:
    import torch

    if not torch.cuda.is_available():
        status.cuda = "unavailable"
        return None
    try:
        import triton  # noqa: F401
    except Exception as exc:  # triton not installed: not a failure, the reference serves CUDA
        status.cuda = "unavailable"
        status.errors["cuda"] = f"triton not importable ({_describe_error(exc)})"
        return None
    try:
        from . import triton as triton_kernels
        from .reduction import ReductionSelector

        selector = _selectors.get("cuda") or ReductionSelector(
            "cuda",
            triton_kernels.STRATEGIES,
            threads=triton_kernels.parallelism,
            sync=torch.cuda.synchronize,
        )
        kernels = triton_kernels.make_kernels(selector)
        for name in _OPS:
            torch.library.register_kernel(f"daftrain::{name}", "cuda", _guarded("cuda", name, kernels[name]))
    except Exception as exc:
        status.cuda = "reference"
        status.errors["cuda"] = _describe_error(exc)
        return f"Triton CUDA kernels ({_describe_error(exc)})"
    _selectors["cuda"] = selector
    status.cuda = "triton"
    return None


def load_fast_kernels(*, warmup: bool = False) -> KernelStatus:
    """Register the fast kernels (idempotent). ``warmup`` also compiles (or loads from numba's cache)
    the CPU kernels now instead of at their first call, so a compile failure shows here."""
    global _status
    from . import ops  # noqa: F401  (defines the custom ops)

    with _lock:
        if _status is not None and not warmup:
            return _status
        if _status is None:
            status = KernelStatus()
            if _disabled():
                status.cpu = status.cuda = "disabled"
                status.disabled = True
                _status = status
                return status
            failures = [f for f in (_register_cpu(status), _register_cuda(status)) if f]
            _status = status
        else:
            status = _status
            failures = []
        if warmup and status.cpu == "numba":
            try:
                from . import cpu

                cpu.warmup()
            except Exception as exc:
                status.cpu = "reference"
                status.errors["cpu"] = _describe_error(exc)
                failures.append(f"numba CPU kernels ({_describe_error(exc)})")
        if failures:
            warnings.warn(
                "daftrain: could not load "
                + "; ".join(failures)
                + " -- the pure PyTorch reference kernels run instead",
                RuntimeWarning,
                stacklevel=2,
            )
        return status


def kernel_report() -> dict[str, Any]:
    """Which backends are loaded, numba version/threads, triton status, reduction choices."""
    import torch

    report: dict[str, Any] = {"status": (_status or KernelStatus(cpu="not loaded", cuda="not loaded")).as_dict()}
    try:
        import numba

        layer: str | None
        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel region has run yet
            layer = None
        report["numba"] = {
            "version": numba.__version__,
            "threads": numba.get_num_threads(),
            "max_threads": numba.config.NUMBA_NUM_THREADS,
            "threading_layer": layer,
        }
    except Exception as exc:
        report["numba"] = {"error": _describe_error(exc)}
    try:
        import triton

        report["triton"] = {"version": triton.__version__, "cuda_available": torch.cuda.is_available()}
    except Exception as exc:
        report["triton"] = {"error": _describe_error(exc), "cuda_available": torch.cuda.is_available()}
    report["torch_threads"] = torch.get_num_threads()
    report["reduction"] = {dev: sel.describe() for dev, sel in _selectors.items()}
    return report
