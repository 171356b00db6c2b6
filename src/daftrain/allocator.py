"""The C library and glibc's allocator settings daftrain applies (heap trimming, the mmap threshold)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["DEFAULT_TRIM_BYTES", "HeapTrimmer", "glibc", "malloc_trim", "tighten_allocator"]

_M_MMAP_THRESHOLD = -3
DEFAULT_MMAP_THRESHOLD = 1 << 16
DEFAULT_TRIM_BYTES = 64 << 20


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The C library (for glibc's ``malloc_trim`` and ``mallopt``), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def _malloc_trim_fn() -> Callable[[int], int] | None:
    trim = getattr(glibc(), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def malloc_trim() -> bool:
    """Hand glibc's free heap memory back to the OS (``malloc_trim(0)``); False where glibc has none."""
    trim = _malloc_trim_fn()
    if trim is None:
        return False
    trim(0)
    return True


# NOTE [ Freed memory goes back to the OS ]
# glibc raises its mmap threshold every time a large mmapped block is freed (up to 32 MiB on 64-bit),
# after which blocks of that size come from the heap and stay resident after ``free``. Activations,
# their gradients and backward's decoded tensors are such blocks: left alone, the process keeps the
# memory of every phase (a forward's activations, a backward's transients) as free heap that later
# phases cannot always reuse, so its peak RSS, what a user and an OOM killer see, sits far above its
# live tensors; compressed activations make that gap larger, not smaller. Two remedies, measured in
# docs/memory.md:
#   * trimming (``HeapTrimmer``, what ``compress`` does: ``CompressionConfig(tune_allocator=True)``, the
#     default, on CPU): glibc's defaults, plus ``malloc_trim(0)``, which hands every free heap page back
#     to the OS, whenever another ``DEFAULT_TRIM_BYTES`` went through the context's pack and unpack
#     hooks, and when its forward pass starts and ends. Blocks freed and allocated again between two
#     trims reuse their pages;
#   * a fixed mmap threshold (``tighten_allocator``, which ``BudgetedStep(tune_allocator=True)``
#     applies; what ``MALLOC_MMAP_THRESHOLD_=65536`` gives from the environment): each block of 64 KiB
#     and more lives in its own mapping, unmapped on free. RSS follows live memory at every moment, but
#     every large allocation faults its pages in and zeroed again, which cost compressed training more
#     kernel time than the trimming for the same peak.
# Either changes where glibc keeps freed memory, never what a program can allocate;
# ``tune_allocator=False`` leaves the allocator alone. Page faults are the cost of both: launching the
# process with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc then asks for transparent huge pages)
# makes them far cheaper; no call made after start-up can do that.
class HeapTrimmer:
    """Returns glibc's free heap memory to the OS each time ``every`` more bytes were noted, and on
    ``trim()``; see ``NOTE [ Freed memory goes back to the OS ]``. Does nothing where glibc's
    ``malloc_trim`` is unavailable."""

    __slots__ = ("_every", "_seen")

    def __init__(self, every: int = DEFAULT_TRIM_BYTES) -> None:
        self._every, self._seen = every, 0

    def note(self, nbytes: int) -> None:
        """Count ``nbytes`` of traffic (a tensor saved or restored); trim once ``every`` have gone by."""
        self._seen += nbytes
        if self._seen >= self._every:
            self.trim()

    def trim(self) -> None:
        """``malloc_trim(0)`` now, and start counting again."""
        self._seen = 0
        malloc_trim()


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
