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
import importlib
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import ops

__all__ = ["BACKENDS", "CPU", "CUDA", "DISABLE_ENV", "Backend", "KernelStatus", "kernel_report", "load_fast_kernels"]

DISABLE_ENV = "DAFTRAIN_DISABLE_FAST_KERNELS"


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


def _describe_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _numba_compile_errors() -> tuple[type[BaseException], ...]:
    from numba.core.errors import NumbaError

    return (NumbaError,)


def _triton_compile_errors() -> tuple[type[BaseException], ...]:
    """Compile errors, ptxas failures, kernels needing more resources than the GPU has."""
    try:
        from triton.errors import TritonError

        return (TritonError,)
    except Exception:  # pragma: no cover - depends on the triton version
        try:
            from triton.compiler.errors import CompilationError

            return (CompilationError,)
        except Exception:
            return ()


def _cuda_missing() -> str | None:
    """Why the Triton backend has nothing to do here ("": no CUDA device), or None when it can load."""
    if not torch.cuda.is_available():
        return ""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # triton not installed: not a failure, the reference serves CUDA
        return f"triton not importable ({_describe_error(exc)})"
    return None


@dataclass(frozen=True)
class Backend:
    """One fast backend: its name (the ``KernelStatus`` value once loaded), the device key it registers
    for (also its ``KernelStatus`` field), the module of this package that holds its kernels
    (``STRATEGIES``, ``make_kernels(selector)``) and how to set up its ``ReductionSelector``."""

    name: str
    key: str
    module: str
    label: str
    """Names the backend in warnings."""
    parallelism: str
    """The module's function giving the parallel units the selector's size classes count."""
    compile_errors: Callable[[], tuple[type[BaseException], ...]]
    missing: Callable[[], str | None] = lambda: None
    """Why the backend cannot run on this machine (not a failure: status "unavailable"), or None."""
    sync: Callable[[], None] | None = None
    warmup: bool = False
    """Whether ``load_fast_kernels(warmup=True)`` calls the module's ``warmup()``."""

    def load(self) -> Any:
        return importlib.import_module(f".{self.module}", __package__)


CPU = Backend("numba", "cpu", "cpu", "numba CPU kernels", "threads", _numba_compile_errors, warmup=True)
CUDA = Backend("triton", "cuda", "triton", "Triton CUDA kernels", "parallelism", _triton_compile_errors,
               missing=_cuda_missing, sync=torch.cuda.synchronize)
BACKENDS = (CPU, CUDA)

_lock = threading.Lock()
_status: KernelStatus | None = None
_selectors: dict[str, Any] = {}
_libraries: list[torch.library.Library] = []

# NOTE [ No Dynamo guard on the kernels ]
# The fast kernels are registered with ``Library.impl``, as the reference is in ``ops.py``, not with
# ``torch.library.register_kernel``: that one wraps each kernel in ``torch._disable_dynamo``, whose first
# call imports ``torch._dynamo``. That import would run inside the first pack hook of a process, and
# one module it imports (``torch.fx``'s ``wrap``) keeps ``inspect.currentframe()`` in a local: a frame
# that refers to itself, freed only by the cyclic garbage collector, and through ``f_back`` it holds
# every caller's frame, the first ``compress`` context's ``_pack`` among them. With the collector off,
# that context (with its pool and buffers) was never freed. The guard buys nothing here: Dynamo never
# runs a custom op's kernel (it records the op and calls it through the dispatcher from a compiled
# graph it does not trace), and a backend kernel is reached only through the dispatcher.


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _guarded(backend: Backend, op: ops.Op, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a backend kernel (its arguments already checked at the op boundary): bump the version of
    what it wrote; on a JIT compile failure at run time, warn once and use the reference."""
    ref, name, mutated = op.reference, op.name, op.mutated
    compile_errors = backend.compile_errors()

    def write_and_bump(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        for i in mutated:  # it wrote through a raw pointer; see NOTE [ Op registration ]
            torch.autograd.graph.increment_version(args[i])
        return out

    run = write_and_bump if mutated else fn

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        status = _status
        if status is not None and getattr(status, backend.key) == "reference":
            return ref(*args, **kwargs)
        try:
            return run(*args, **kwargs)
        except compile_errors as exc:
            with _lock:
                if status is not None and getattr(status, backend.key) != "reference":
                    setattr(status, backend.key, "reference")
                    status.errors[backend.key] = _describe_error(exc)
                    warnings.warn(
                        f"daftrain: the fast {backend.key} kernel {name} failed to compile "
                        f"({_describe_error(exc)}); the pure PyTorch reference kernels run instead",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            return ref(*args, **kwargs)

    return kernel


def _register(backend: Backend, status: KernelStatus) -> str | None:
    """Register ``backend``'s kernels for its device key; returns what failed (for the warning) or None."""
    missing = backend.missing()
    if missing is not None:
        setattr(status, backend.key, "unavailable")
        if missing:
            status.errors[backend.key] = missing
        return None
    try:
        from .reduction import ReductionSelector

        module = backend.load()
        selector = _selectors.get(backend.key) or ReductionSelector(
            backend.key, module.STRATEGIES, threads=getattr(module, backend.parallelism), sync=backend.sync
        )
        kernels = module.make_kernels(selector)
        library = torch.library.Library("daftrain", "FRAGMENT")  # NOTE [ No Dynamo guard on the kernels ]
        for op in ops.OPS.values():
            kernel = op.at_boundary(_guarded(backend, op, kernels[op.name]))
            library.impl(op.name, kernel, torch._C._dispatch_key_for_device(backend.key))
            op.eager_kernels[backend.key] = kernel  # NOTE [ Eager calls skip the dispatcher ] in ops.py
        _libraries.append(library)  # a Library unregisters its kernels when collected
    except Exception as exc:
        setattr(status, backend.key, "reference")
        status.errors[backend.key] = _describe_error(exc)
        return f"{backend.label} ({_describe_error(exc)})"
    _selectors[backend.key] = selector
    setattr(status, backend.key, backend.name)
    return None


def load_fast_kernels(*, warmup: bool = False) -> KernelStatus:
    """Register the fast kernels (idempotent). ``warmup`` also compiles (or loads from numba's cache)
    the CPU kernels now instead of at their first call, so a compile failure shows here."""
    global _status
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
            failures = [f for f in (_register(b, status) for b in BACKENDS) if f]
            _status = status
        else:
            status = _status
            failures = []
        for backend in BACKENDS:
            if not (warmup and backend.warmup and getattr(status, backend.key) == backend.name):
                continue
            try:
                backend.load().warmup()
            except Exception as exc:
                setattr(status, backend.key, "reference")
                status.errors[backend.key] = _describe_error(exc)
                failures.append(f"{backend.label} ({_describe_error(exc)})")
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
