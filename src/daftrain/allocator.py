"""The C library and the one allocator setting daftrain applies (glibc's mmap threshold)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["glibc", "tighten_allocator"]

_M_MMAP_THRESHOLD = -3
DEFAULT_MMAP_THRESHOLD = 1 << 16


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library (for glibc's ``malloc_trim`` and ``mallopt``), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


# NOTE [ Freed memory goes back to the OS ]
# glibc raises its mmap threshold every time a large mmapped block is freed (up to 32 MiB on 64-bit),
# after which blocks of that size come from the heap and stay resident after ``free``. Activations,
# their gradients and backward's decoded tensors are such blocks: without a fixed threshold the
# process keeps the memory of every phase (a forward's activations, a backward's transients) as free
# heap that later phases cannot always reuse, so its peak RSS, what a user and an OOM killer see,
# sits far above its live tensors; compressed activations make that gap larger, not smaller. Fixing
# ``M_MMAP_THRESHOLD`` (which also disables the dynamic adjustment) keeps each large block in its own
# mapping, unmapped on free. It is the setting ``MALLOC_MMAP_THRESHOLD_=65536`` gives from the
# environment; it changes where glibc places blocks of 64 KiB and more, never what a program can
# allocate. ``compress`` (``CompressionConfig(tune_allocator=True)``, the default) and ``BudgetedStep``
# apply it once, on CPU; ``tune_allocator=False`` leaves the allocator alone. The measurements are in
# docs/memory.md.
@functools.cache
def tighten_allocator(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Make glibc return large freed blocks to the OS at once, so RSS follows live memory.

    Process-wide, applied once (see NOTE [ Freed memory goes back to the OS ]). Returns False where
    glibc's ``mallopt`` is unavailable (nothing changed).
    """
    mallopt = getattr(glibc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
