"""The C library and glibc's allocator settings daftrain applies (heap trimming, the mmap threshold)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time
from collections.abc import Callable

__all__ = ["DEFAULT_TRIM_BYTES", "HeapTrimmer", "advise_huge_pages", "glibc", "heap_slack_bytes", "malloc_trim",
           "tighten_allocator"]

_M_MMAP_THRESHOLD = -3
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
DEFAULT_MMAP_THRESHOLD = 1 << 16
DEFAULT_TRIM_BYTES = 32 << 20
_SLACK_READ_INTERVAL = 1e-3
_SLACK_READ_SHARE = 0.02


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


@functools.cache
def _heap_start() -> int | None:
    """Where the main heap (``[heap]`` in ``/proc/self/maps``) starts; it never moves."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if line.rstrip().endswith("[heap]"):
                    return int(line.split("-", 1)[0], 16)
    except OSError:
        return None
    return None


@functools.cache
def _huge_page_calls() -> tuple[Callable[..., int], Callable[..., int]] | None:
    """``sbrk`` and ``madvise`` where transparent huge pages can be advised (mode ``madvise`` or
    ``always``), else None."""
    try:
        with open(_THP_ENABLED) as f:
            if "[never]" in f.read():
                return None
    except OSError:
        return None
    libc = glibc()
    sbrk, madvise = getattr(libc, "sbrk", None), getattr(libc, "madvise", None)
    if sbrk is None or madvise is None:
        return None
    sbrk.argtypes, sbrk.restype = [ctypes.c_ssize_t], ctypes.c_void_p
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return sbrk, madvise


def advise_huge_pages(huge: bool = True) -> bool:
    """Advise transparent huge pages (or, with ``huge=False``, none) for the main heap as far as it
    reaches now; False where that cannot be done. See ``NOTE [ Freed memory goes back to the OS ]``."""
    calls, start = _huge_page_calls(), _heap_start()
    if calls is None or start is None:
        return False
    sbrk, madvise = calls
    end = sbrk(0)
    advice = _MADV_HUGEPAGE if huge else _MADV_NOHUGEPAGE
    return bool(end and end > start and madvise(start, end - start, advice) == 0)


class _MallInfo2(ctypes.Structure):
    _fields_ = tuple((name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                          "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"))


@functools.cache
def _mallinfo2_fn() -> Callable[[], _MallInfo2] | None:
    info = getattr(glibc(), "mallinfo2", None)  # glibc 2.33 and later
    if info is None:
        return None
    info.argtypes, info.restype = [], _MallInfo2
    return info  # type: ignore[no-any-return]


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def heap_slack_bytes() -> int | None:
    """The process's anonymous resident memory that glibc's allocator holds for no live block (freed memory it
    keeps, with other anonymous memory it does not manage, such as Python's object arenas); None where glibc's
    ``mallinfo2`` or ``/proc/self/statm`` cannot be read. Its growth between two readings is memory freed and
    kept (``NOTE [ Freed memory goes back to the OS ]``)."""
    info = _mallinfo2_fn()
    if info is None:
        return None
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)  # opened each time: a kept descriptor would read the
        try:                                            # parent's figures in a forked child
            fields = os.read(fd, 256).split()
        finally:
            os.close(fd)
    except OSError:
        return None
    heap = info()
    return (int(fields[1]) - int(fields[2])) * _PAGE_BYTES - heap.uordblks - heap.hblkhd


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
#     to the OS, when its forward pass starts and ends, whenever another ``DEFAULT_TRIM_BYTES`` went
#     through the context's pack and unpack hooks, and whenever the heap's slack (resident memory glibc
#     holds for no live block, ``heap_slack_bytes``) grew by that much since its lowest reading after the
#     last trim. The hooks' traffic alone misses what no hook sees: between two unpacks a backward makes
#     and frees gradients, weight-gradient products and kernels' buffers, and the slack they leave
#     between two traffic trims can outgrow the backward's live memory (docs/memory.md). The slack is read
#     (``/proc/self/statm`` and ``mallinfo2``, which walks the allocator's free lists: tens to hundreds
#     of microseconds on a fragmented heap) at a hook's call, at most once a millisecond and no more
#     often than keeps the reads to 2 % of the time between them: a backward's late unpacks are small
#     tensors (biases, statistics) between which its large transients are freed. Blocks freed and
#     allocated again between two trims reuse their pages;
#   * a fixed mmap threshold (``tighten_allocator``, which ``BudgetedStep(tune_allocator=True)``
#     applies; what ``MALLOC_MMAP_THRESHOLD_=65536`` gives from the environment): each block of 64 KiB
#     and more lives in its own mapping, unmapped on free. RSS follows live memory at every moment, but
#     every large allocation faults its pages in and zeroed again, which cost compressed training more
#     kernel time than the trimming for the same peak.
# Either changes where glibc keeps freed memory, never what a program can allocate;
# ``tune_allocator=False`` leaves the allocator alone. Page faults are the cost of both: what a trim
# returned, the next allocations fault in again, 4 KiB at a time. So after each trim the trimmer also
# advises transparent huge pages for the main heap, from its start to the current break
# (``advise_huge_pages``; where the kernel's THP mode is ``madvise`` or ``always``): its wholly freed
# 2 MiB ranges come back in one fault each. It is advice on the heap daftrain trims anyway: the kernel
# may back it with huge pages or not, and a later trim splits a huge page that is only partly free.
# Blocks glibc maps on their own and other threads' arenas keep 4 KiB pages; launching the process
# with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc then advises all it maps) covers those too.
# The advice lasts only while a step uses the heap: from the context's entry until its forward has
# ended and every tensor it saved has been released (backward done, or the graph dropped). An advised
# heap left idle is not left alone: khugepaged collapses its ranges into huge pages at its scan rate,
# filling the holes a trim made in a partly used range (RSS that grows while training pauses; measured
# in docs/memory.md), so an idle heap is advised back to no huge pages.
class HeapTrimmer:
    """Returns glibc's free heap memory to the OS each time ``every`` more bytes were noted or the heap's slack
    grew by ``every``, and on ``trim()``, and advises huge pages for the heap while a step uses it; see
    ``NOTE [ Freed memory goes back to the OS ]``. Does nothing where glibc's ``malloc_trim`` is unavailable."""

    __slots__ = ("_every", "_held", "_in_step", "_read_at", "_read_every", "_seen", "_slack")

    def __init__(self, every: int = DEFAULT_TRIM_BYTES) -> None:
        self._every, self._seen = every, 0
        self._read_at, self._read_every = 0.0, _SLACK_READ_INTERVAL
        self._slack: int | None = None
        self._held, self._in_step = False, False

    def note(self, nbytes: int) -> None:
        """Count ``nbytes`` of traffic (a tensor saved or restored); trim once ``every`` have gone by, or once the
        heap's slack grew by ``every`` since its lowest reading after the last trim. The slack is read at most every
        ``_SLACK_READ_INTERVAL`` seconds, and no more often than keeps its reads to ``_SLACK_READ_SHARE`` of the
        time between them."""
        self._seen += nbytes
        if self._seen >= self._every:
            self.trim()
            return
        now = time.perf_counter()
        if now - self._read_at >= self._read_every:
            slack = heap_slack_bytes()
            self._read_at = time.perf_counter()
            self._read_every = max(_SLACK_READ_INTERVAL, (self._read_at - now) / _SLACK_READ_SHARE)
            if slack is None or self._slack is None:
                return
            if slack - self._slack >= self._every:
                self.trim()
            else:
                self._slack = min(self._slack, slack)

    def trim(self) -> None:
        """``malloc_trim(0)`` now, advise huge pages for the heap if a step uses it, and start counting again."""
        self._seen = 0
        if not malloc_trim():
            return
        if self._in_step or self._held:
            advise_huge_pages()
        self._slack = heap_slack_bytes()

    def begin(self) -> None:
        """A forward starts: the heap is in use (trims advise huge pages) until ``end`` and while what it saved
        is held."""
        self._in_step = True
        self.trim()

    def end(self) -> None:
        """The forward ended: trim; the heap stays in use while what it saved is held."""
        self._in_step = False
        self.trim()
        if not self._held:
            advise_huge_pages(huge=False)

    def saves_held(self, held: bool) -> None:
        """Whether tensors a forward saved are still held (``saved/live_saves.py``): the heap is in use until
        backward has released them."""
        self._held = held
        if not held and not self._in_step:
            advise_huge_pages(huge=False)


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
