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


_SLACK_CHILD = """
import json, torch
from daftrain.allocator import HeapTrimmer, glibc, heap_slack_bytes
from daftrain.rss import current_rss_bytes
glibc().mallopt(-3, 16 << 20)  # M_MMAP_THRESHOLD: 1 MiB blocks come from the heap
glibc().mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: only an explicit malloc_trim returns memory
trimmer = HeapTrimmer(every=16 << 20)
trimmer.trim()
out = {"slack": [heap_slack_bytes()]}
blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(48)]
out["slack"].append(heap_slack_bytes())
with_blocks = current_rss_bytes()
del blocks
out["slack"].append(heap_slack_bytes())
trimmer.note(1 << 20)  # traffic far below ``every``; the slack, read now, grew by 48 MiB
out["released"] = with_blocks - current_rss_bytes()
out["slack"].append(heap_slack_bytes())
print(json.dumps(out))
"""


def test_the_trimmer_returns_memory_freed_between_hooks_once_the_heap_slack_grew() -> None:
    """Memory a backward frees between two hooks (gradients, kernels' buffers) is no traffic the hooks count;
    the heap's slack, read at a hook's call, sees it: 48 MiB freed and kept by glibc are returned at the next
    read, after 1 MiB of traffic against a 16 MiB threshold. A fresh process (glibc's settings)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SLACK_CHILD], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    after_trim, with_blocks, freed, trimmed = got["slack"]
    mib = 1 << 20
    assert abs(with_blocks - after_trim) < 8 * mib, got  # live blocks are no slack
    assert freed - with_blocks > 40 * mib, got  # freed into the heap and kept: slack
    assert got["released"] > 40 * mib and trimmed - after_trim < 8 * mib, got


def test_the_trimmer_trims_on_slack_grown_from_its_lowest_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    readings = iter([1000, 900, 900 + 1599, 900 + 1600, 500, 500])
    monkeypatch.setattr(allocator, "_malloc_trim_fn", lambda: calls.append)
    monkeypatch.setattr(allocator, "heap_slack_bytes", lambda: next(readings))
    monkeypatch.setattr(allocator, "_SLACK_READ_INTERVAL", 0.0)  # read at every note,
    monkeypatch.setattr(allocator, "_SLACK_READ_SHARE", float("inf"))  # however long a read takes
    trimmer = allocator.HeapTrimmer(every=1600)
    trimmer.trim()  # reads 1000
    assert calls == [0]
    trimmer.note(1)  # reads 900: the lowest since the trim
    trimmer.note(1)  # reads 2499: grown by 1599 from 900
    assert calls == [0]
    trimmer.note(1)  # reads 2500: grown by 1600; trims and reads 500
    assert calls == [0, 0]
    trimmer.note(1)  # reads 500
    assert calls == [0, 0]
    assert next(readings, None) is None


def _slack_reads_on_a_clock(monkeypatch: pytest.MonkeyPatch, times: list[float]) -> list[int]:
    """The slack reads (each reads 0) of a trimmer trimmed once (one read) and then noted four times, its clock
    giving ``times`` in turn: each note reads the clock, and a note that reads the slack reads it again after."""
    readings: list[int] = []
    monkeypatch.setattr(allocator, "_malloc_trim_fn", lambda: lambda pad: 0)
    monkeypatch.setattr(allocator, "heap_slack_bytes", lambda: readings.append(0) or 0)
    clock = iter(times)
    monkeypatch.setattr(allocator.time, "perf_counter", lambda: next(clock))
    trimmer = allocator.HeapTrimmer(every=1 << 30)
    trimmer.trim()
    assert len(readings) == 1
    for _ in range(4):
        trimmer.note(1)
    assert next(clock, None) is None
    return readings


def test_the_trimmer_reads_the_slack_at_most_once_an_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = _slack_reads_on_a_clock(monkeypatch, [10.0, 10.0, 10.0005, 10.0011, 10.0011, 10.0012])
    assert len(readings) == 3  # at 10.0 and 10.0011; not at 10.0005 or 10.0012


def test_a_slow_slack_read_spaces_the_next_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that took 1 ms (a large, fragmented heap) is followed by none for 50 ms: reads take at most 2 % of
    the time between them."""
    readings = _slack_reads_on_a_clock(monkeypatch, [10.0, 10.001, 10.03, 10.0505, 10.052, 10.052])
    assert len(readings) == 3  # the trim's, at 10.0 (1 ms long) and at 10.052; not at 10.03 or 10.0505


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
import ctypes, gc, json, torch
import daftrain
from daftrain.allocator import HeapTrimmer, glibc
from daftrain.saved.live_saves import LiveSaves

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

def advised(end):
    below = [hg for lo, hi, hg in heap_areas() if hi <= end]
    return bool(below) and all(below)

def none_advised():
    return not any(hg for _, _, hg in heap_areas())

libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: these blocks come from the heap
out = {"mode": open("/sys/kernel/mm/transparent_hugepage/enabled").read()}
trimmer = HeapTrimmer()
trimmer.trim()
out["outside_a_step"] = none_advised()
blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(16)]
trimmer.begin()
out["begin"] = advised(libc.sbrk(0))
first_end = libc.sbrk(0)
more = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(64)]  # the heap grows past what was advised
trimmer.trim()
out["grown"] = libc.sbrk(0) >= first_end + (48 << 20) and advised(libc.sbrk(0))

class Handle:
    pass

handle = Handle()
LiveSaves([trimmer.saves_held]).hold(handle)
trimmer.end()
out["held_after_end"] = advised(libc.sbrk(0))
del handle
gc.collect()
out["released"] = none_advised()

# Through compress: advised during backward, not once backward has released what the forward saved.
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
during = []
model[2].register_full_backward_hook(lambda *args: during.append(not none_advised()))  # backward goes on
with daftrain.compress(bits=2, model=model):
    loss = model(torch.randn(256, 512, requires_grad=True)).square().mean()
loss.backward()
del loss
gc.collect()
out["during_backward"] = during
out["after_backward"] = none_advised()
print(json.dumps(out))
"""


def test_the_heap_is_advised_huge_pages_while_a_step_uses_it() -> None:
    """From a forward's start until what it saved is released, each trim advises transparent huge pages
    for the heap as far as it then reaches (where the kernel allows advice), so what the step's
    allocations fault in again comes 2 MiB at a time; an idle heap is advised back to none, since
    khugepaged would fill the holes trims made."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HUGE_PAGE_CHILD], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if "[never]" in got["mode"]:
        assert not any(got[k] for k in ("begin", "grown", "held_after_end")), got
        return
    assert got["outside_a_step"] and got["begin"] and got["grown"], got
    assert got["held_after_end"] and got["released"], got
    assert got["during_backward"] == [True] and got["after_backward"], got
