"""Process memory measurement (Linux, CPU) and an independent saved-tensor counter.

Everything here is stateless at module level: RSS readings come straight from
``/proc/self/status`` and the counter keeps its state on the instance.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import UnsupportedError

__all__ = [
    "SavedTensorCounter",
    "current_rss_bytes",
    "format_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
]

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def _read_status_kb(field: str) -> int | None:
    """Return ``field`` (e.g. ``"VmHWM"``) from /proc/self/status in kB, or None."""
    try:
        text = _PROC_STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            parts = line.split()
            # Format: "VmHWM:	  123456 kB"
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1])
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes.

    Reads ``VmHWM`` from /proc/self/status (resettable by :func:`reset_peak_rss`),
    falling back to ``getrusage(RUSAGE_SELF).ru_maxrss`` (never resettable).
    """
    kb = _read_status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # NOTE [ ru_maxrss units ]
    # Linux reports ru_maxrss in kilobytes, macOS in bytes.
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def current_rss_bytes() -> int:
    """Current resident set size of this process in bytes (``VmRSS``)."""
    kb = _read_status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    try:
        import psutil  # optional fallback for non-Linux systems
    except ImportError as exc:  # pragma: no cover - Linux always has /proc
        raise UnsupportedError(
            "cannot read the current RSS: /proc/self/status is unavailable and psutil is not installed"
        ) from exc
    return int(psutil.Process().memory_info().rss)  # pragma: no cover


def _malloc_trim() -> bool:
    """Call glibc ``malloc_trim(0)``; return False if glibc is unavailable."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (``VmHWM``) to the current RSS.

    First returns freed heap memory to the OS with glibc ``malloc_trim(0)`` (if
    available) so the new baseline is as low as possible, then writes ``"5"``
    to /proc/self/clear_refs (Linux >= 4.0). Returns False where resetting is
    not possible (non-Linux, no permission); ``peak_rss_bytes`` is then the
    peak since process start.
    """
    # NOTE [ Why malloc_trim before clear_refs ]
    # glibc keeps freed memory in its arenas, so RSS (and thus the new VmHWM
    # baseline) would still include memory of earlier, already freed runs.
    # Trimming first makes consecutive measurements in one process comparable.
    _malloc_trim()
    try:
        with _PROC_CLEAR_REFS.open("w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def format_bytes(n: int | float) -> str:
    """Human-readable size with decimal SI units (1 kB = 1e3 B, 1 MB = 1e6 B): ``"12.3 MB"``."""
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 1000:
        return f"{sign}{int(value)} B"
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000.0
        if value < 999.95 or unit == "TB":
            return f"{sign}{value:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def _is_parameter_or_view(t: torch.Tensor) -> bool:
    if isinstance(t, nn.Parameter):
        return True
    base = t._base
    return base is not None and isinstance(base, nn.Parameter)


class SavedTensorCounter(torch.autograd.graph.saved_tensors_hooks):
    """Count what plain PyTorch saves for backward inside the ``with`` block.

    Each saved tensor is attributed to its storage; a storage shared by several
    saved tensors (e.g. an input saved by two ops, or views) is counted once.
    ``nn.Parameter`` objects and views of parameters are left out, as are the
    storages of any tensors given in ``exclude`` (e.g. ``model.buffers()``).

    Attributes:
        saved_bytes: sum of ``nbytes`` over the unique counted storages.
        num_tensors: number of counted (non-parameter) saved tensors, with
            repeats, i.e. how many times the pack hook kept an activation.
        num_storages: number of unique counted storages.
        num_skipped: saved tensors left out as parameters / excluded.

    Only the innermost ``saved_tensors_hooks`` context is active, so nesting
    another saved-tensor hook inside this one hides those tensors from it.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        # NOTE [ Keying by StorageWeakRef ]
        # The key is the StorageImpl pointer wrapped in a weak reference. Holding
        # the weak reference keeps the StorageImpl object itself allocated (only
        # its data can be freed), so its address cannot be reused by a new
        # storage while we hold the key: a freed-and-reallocated buffer is never
        # mistaken for one already counted. The weak ref does not keep data alive.
        self._storages: dict[StorageWeakRef, int] = {}
        self._excluded: set[StorageWeakRef] = {
            StorageWeakRef(t.untyped_storage()) for t in exclude
        }
        self._extra_bytes = 0  # tensors without a storage (e.g. sparse)
        self.num_tensors = 0
        self.num_skipped = 0
        super().__init__(self._pack, self._unpack)

    @property
    def saved_bytes(self) -> int:
        """Bytes of unique storages kept alive for backward."""
        return sum(self._storages.values()) + self._extra_bytes

    @property
    def num_storages(self) -> int:
        """Number of unique storages counted."""
        return len(self._storages)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if _is_parameter_or_view(t):
            self.num_skipped += 1
            return t.detach()
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            # Sparse / storage-less tensors: count their logical size, no dedup.
            self.num_tensors += 1
            self._extra_bytes += t.numel() * t.element_size()
            return t.detach()
        ref = StorageWeakRef(storage)
        if ref in self._excluded:
            self.num_skipped += 1
        else:
            self.num_tensors += 1
            if ref not in self._storages:
                self._storages[ref] = storage.nbytes()
        # NOTE [ Pack returns t.detach() ]
        # We keep exactly what plain PyTorch keeps: the same storage, no copy.
        # ``detach()`` rather than ``t`` itself because for a saved *output* the
        # tensor's grad_fn owns this SavedVariable; returning ``t`` would make a
        # reference cycle that is never reclaimed when backward is not run (or
        # retain_graph=True). PyTorch restores grad_fn on unpack, so detaching
        # is lossless (it is what PyTorch itself stores for saved outputs).
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedTensorCounter:
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)

    def __repr__(self) -> str:
        return (
            f"SavedTensorCounter(saved_bytes={self.saved_bytes} ({format_bytes(self.saved_bytes)}), "
            f"num_tensors={self.num_tensors}, num_storages={self.num_storages}, "
            f"num_skipped={self.num_skipped})"
        )
