"""allocator.py: the heap trimmer and the mmap threshold, each checked in a fresh process (in this one glibc's
settings may have been changed by other tests)."""

from __future__ import annotations

import pytest

from daftrain import allocator

_TRIM_CHILD = """
import torch
from daftrain.allocator import HeapTrimmer, glibc
from daftrain.rss import current_rss_bytes
trimmer = HeapTrimmer(every=1 << 20)
# What glibc's dynamic threshold does once a large block was freed: 1 MiB blocks come from the heap.
# Its own trimming of the heap's top is turned off, so only an explicit malloc_trim returns memory.
glibc().mallopt(-3, 16 << 20)  # M_MMAP_THRESHOLD
glibc().mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(48)]
with_blocks = current_rss_bytes()
del blocks
trimmer.note(512 << 10)
released = [with_blocks - current_rss_bytes()]
trimmer.note(512 << 10)  # 1 MiB noted: trims
released.append(with_blocks - current_rss_bytes())
print(released)
"""


def test_the_trimmer_returns_the_free_heap_once_enough_bytes_went_by() -> None:
    """A fresh process (in this one the mmap threshold may be fixed already, then nothing stays in the heap)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _TRIM_CHILD], capture_output=True, text=True, check=True)
    before_trim, after_trim = json.loads(out.stdout.strip().splitlines()[-1])
    assert before_trim < 8 << 20, (before_trim, after_trim)  # 48 MiB freed into the heap, kept
    assert after_trim > 40 << 20, (before_trim, after_trim)


def test_the_trimmer_counts_from_zero_after_each_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(allocator, "_malloc_trim_fn", lambda: calls.append)
    trimmer = allocator.HeapTrimmer(every=100)
    for nbytes in (60, 60, 60, 30, 100):
        trimmer.note(nbytes)
    assert calls == [0, 0]  # 60 + 60 trims; then 60 + 30 does not, + 100 does
    trimmer.trim()
    assert calls == [0, 0, 0]


def test_glibc_is_shared_by_the_allocator_helpers() -> None:
    lib = allocator.glibc()
    if lib is None or not hasattr(lib, "mallopt"):
        pytest.skip("no glibc on this system")
    assert allocator.glibc() is lib  # loaded once
    assert allocator.tighten_allocator() is True


def test_compress_returns_freed_memory_to_the_os_in_a_fresh_process() -> None:
    """With ``tune_allocator`` (the default) freed 1 MiB blocks, which glibc's dynamic threshold keeps
    in the heap, go back to the OS when a forward pass starts or ends (``HeapTrimmer``);
    ``tune_allocator=False`` leaves glibc alone."""
    import subprocess
    import sys

    code = """
import sys, torch, daftrain
from daftrain.allocator import glibc
from daftrain.rss import current_rss_bytes
ctx = daftrain.compress(tune_allocator=sys.argv[1] == "1")
# What glibc's dynamic threshold does once a large block was freed: 1 MiB blocks come from the heap.
# Its own trimming of the heap's top is turned off, so only an explicit malloc_trim returns memory.
glibc().mallopt(-3, 16 << 20)  # M_MMAP_THRESHOLD
glibc().mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(48)]
with_blocks = current_rss_bytes()
del blocks
with ctx:
    pass
print(with_blocks - current_rss_bytes())
"""
    released = {}
    for flag in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True, check=True)
        released[flag] = int(out.stdout.strip().splitlines()[-1])
    # 48 MiB were allocated and freed: tuned, they go back to the OS; untuned, glibc keeps them.
    assert released["1"] > 40 << 20, released
    assert released["0"] < 8 << 20, released


_HUGE_PAGE_CHILD = """
import ctypes, json, torch
from daftrain.allocator import HeapTrimmer, advise_huge_pages, glibc

libc = glibc()
libc.sbrk.argtypes, libc.sbrk.restype = [ctypes.c_ssize_t], ctypes.c_void_p

def heap_areas():
    areas, current = [], None
    for line in open("/proc/self/smaps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            current = [lo, hi]
        elif current is not None and line.startswith("VmFlags:"):
            areas.append((*current, "hg" in line.split()))
            current = None
    return areas

libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: these blocks come from the heap
trimmer = HeapTrimmer()
blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(16)]
trimmer.trim()
first_end = libc.sbrk(0)  # the break the trim saw (reading smaps below may grow the heap again)
first = heap_areas()
more = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(64)]
trimmer.trim()
second_end = libc.sbrk(0)
second = heap_areas()
print(json.dumps({"first_end": first_end, "first": first, "second_end": second_end, "second": second,
                  "advised": advise_huge_pages(),
                  "mode": open("/sys/kernel/mm/transparent_hugepage/enabled").read()}))
"""


def test_the_trimmer_advises_huge_pages_for_the_whole_heap() -> None:
    """After each trim the heap, as far as it then reaches, is advised transparent huge pages (where the
    kernel allows advice), so that what the next allocations fault in again comes 2 MiB at a time."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HUGE_PAGE_CHILD], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if "[never]" in got["mode"]:
        assert not got["advised"] and not any(hg for _, _, hg in got["second"]), got
        return
    assert got["advised"], got
    for end, areas in ((got["first_end"], got["first"]), (got["second_end"], got["second"])):
        below = [hg for lo, hi, hg in areas if hi <= end]
        assert below and all(below), got  # every part of the heap below the break the trim saw
    # the 64 MiB allocated after the first trim grew the heap, and the second trim advised that part too
    assert got["second_end"] >= got["first_end"] + (48 << 20), got
