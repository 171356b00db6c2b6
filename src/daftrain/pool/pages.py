"""A pool's pages: host memory regions carved into pages, runs of pages, scratch buffers, and the
byte layout of a record's payload in its pages.

Everything here is package-internal and not thread-safe: the ``PagePool``'s lock guards every call.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..errors import ArgumentTypeError, InvalidArgumentError
from .errors import PoolError

_PART_ALIGN = 16
"""Each payload tensor starts at a multiple of this in a record's byte stream, so that ``load`` can
view one gathered buffer as float32 / bfloat16 / ... tensors (views need aligned offsets)."""

_MAX_SCRATCH = 1
"""Scratch buffers a pool keeps for ``borrow`` (see NOTE [ Scratch buffers ])."""

Payload = tuple[torch.Tensor, ...]
Run = tuple[int, int, int]  # (chunk id, first page in the chunk, page count)
Segment = tuple[torch.Tensor, int, int, int]  # (chunk data, byte offset in the chunk, stream offset, length)


# ---------------------------------------------------------------------------------------------------
# Payload byte layout
# ---------------------------------------------------------------------------------------------------


class _Part(NamedTuple):
    """Where one payload tensor lies in a record's byte stream."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class _PayloadSpec(NamedTuple):
    """A payload (tuple of tensors) described as one byte stream: its parts and their sources."""

    parts: tuple[_Part, ...]
    sources: tuple[torch.Tensor, ...]  # flat uint8 views of the payload tensors
    stream_nbytes: int
    payload_nbytes: int
    device: torch.device


def _describe(payload: Sequence[torch.Tensor]) -> _PayloadSpec:
    """The byte stream of ``payload``: each tensor at an offset aligned to ``_PART_ALIGN``."""
    if isinstance(payload, torch.Tensor) or not isinstance(payload, (tuple, list)):
        raise ArgumentTypeError(f"payload must be a tuple of tensors, got {type(payload).__name__}")
    parts, sources, offset, total, device = [], [], 0, 0, None
    for i, t in enumerate(payload):
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"payload[{i}] must be a tensor, got {type(t).__name__}")
        if t.is_sparse or t.layout != torch.strided:
            raise ArgumentTypeError(f"payload[{i}] must be a strided (dense) tensor, got layout {t.layout}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise InvalidArgumentError(f"all payload tensors must be on one device, got {device} and {t.device}")
        if t.requires_grad:
            t = t.detach()
        flat = (t if t.is_contiguous() else t.contiguous()).view(-1).view(torch.uint8)
        offset = -(-offset // _PART_ALIGN) * _PART_ALIGN
        parts.append(_Part(t.dtype, tuple(t.shape), offset, flat.numel()))
        sources.append(flat)
        offset += flat.numel()
        total += flat.numel()
    return _PayloadSpec(tuple(parts), tuple(sources), offset, total, device or torch.device("cpu"))


def _unflatten(buf: torch.Tensor, parts: tuple[_Part, ...]) -> Payload:
    """The payload tensors as views of a record's byte stream ``buf``."""
    return tuple(buf[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in parts)


def _unflatten_sources(spec: _PayloadSpec) -> Payload:
    """The payload tensors again, from their flat byte views (for a demote callback)."""
    return tuple(src.view(p.dtype).view(p.shape) for p, src in zip(spec.parts, spec.sources, strict=True))


def _spill_pieces(spec: _PayloadSpec) -> list[bytes | torch.Tensor]:
    """The byte stream of a payload that has no pages, piece by piece (alignment gaps as zeros)."""
    pieces: list[bytes | torch.Tensor] = []
    pos = 0
    for part, src in zip(spec.parts, spec.sources, strict=True):
        if part.offset > pos:
            pieces.append(bytes(part.offset - pos))
        pieces.append(src.cpu())
        pos = part.offset + part.nbytes
    return pieces


# ---------------------------------------------------------------------------------------------------
# Host memory
# ---------------------------------------------------------------------------------------------------

# NOTE [ Host memory ]
# On CPU each chunk is its own anonymous ``mmap`` (``MAP_POPULATE`` where the platform has it, else
# written once), wrapped with ``torch.frombuffer``: every page is faulted in when the chunk is
# reserved, never on the hot path, and a freed chunk goes straight back to the OS (the tensor holds
# the mmap object; dropping it unmaps). Going through malloc instead (``torch.zeros``) would leave the
# pool's resident memory to glibc's heuristics: chunks under its dynamic mmap threshold (up to 32 MB)
# come from the heap and stay resident after they are freed. Where ``mmap`` is unavailable the pool
# falls back to ``torch.zeros``.
# Pinned host memory: on a CUDA system with ``pin_memory=True`` the chunks are allocated with
# ``torch.zeros(..., pin_memory=True)`` (page-locked, from CUDA's caching host allocator), so records
# of device tensors are copied device -> pool by DMA and ``load`` copies the gathered bytes back to
# the record's device in one transfer. The pool never holds device memory: GPU activations go to
# pinned host pages.


def _host_region(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of zeroed, resident host memory as a uint8 tensor (NOTE [ Host memory ])."""
    if pinned:
        return torch.zeros(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if not flags:  # not a POSIX mmap (Windows)
        return torch.zeros(nbytes, dtype=torch.uint8, device="cpu")
    populate = getattr(mmap, "MAP_POPULATE", 0)
    region = mmap.mmap(-1, nbytes, flags=flags | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    data = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive; unmapped with it
    if not populate:
        data.zero_()  # fault every page in now, not on the hot path
    return data


class _Chunk:
    __slots__ = ("data", "free", "npages")

    def __init__(self, data: torch.Tensor, npages: int) -> None:
        self.data, self.npages = data, npages
        # A stack whose top is the list's end: pages pop in ascending order from a fresh chunk.
        self.free: list[int] = list(range(npages - 1, -1, -1))


# NOTE [ Scratch buffers ]
# ``borrow`` of a record that is not one run of pages (it spans chunks, or it is spilled) needs
# contiguous bytes for the block's duration only, so instead of a fresh allocation per call (the
# very per-record allocation the pool exists to avoid: malloc keeps such buffers resident) it
# gathers into a scratch buffer: host memory from the same mmap source as the chunks, taken from a
# small free list (the smallest one that fits) and given back at the end of the block. At most
# ``_MAX_SCRATCH`` buffers are kept (the largest), so a pool holds about its largest straddling
# record; another is allocated only while more blocks are open at once (nested or concurrent
# borrows). At ``end_step`` kept buffers larger than twice the step's largest request are freed
# (all of them after a step that needed none), so scratch follows demand like the chunks do.


class _PageTable:
    """The chunks, their free stacks, the page counters and the scratch buffers of one pool.

    Pages are numbered per chunk; a record holds a list of ``Run``s. See NOTE [ Page lifetime rules ]
    in ``pool/store.py`` for the invariants the pool keeps with it.
    """

    def __init__(self, page_size: int, pinned: bool) -> None:
        self.page_size, self.pinned = page_size, pinned
        self.chunks: list[_Chunk] = []
        self.total = self.used = 0  # pages
        self.peak_used = self.peak_total = self.step_peak = 0
        self.grow_events = self.shrink_events = 0
        self.scratch: list[torch.Tensor] = []
        self.scratch_need = 0  # largest scratch request of the current step

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_size)

    def take(self, need: int) -> list[Run]:
        """``need`` free pages (the caller made sure there are), as runs of consecutive pages."""
        # The lowest chunk that holds the whole record, so that most records are one run of pages
        # (a single copy each way, and ``borrow`` can hand out views); else spread from the lowest.
        chunks: list[tuple[int, _Chunk]] = list(enumerate(self.chunks))
        for c_id, chunk in chunks:
            if len(chunk.free) >= need:
                chunks = [(c_id, chunk)]
                break
        runs: list[Run] = []
        left = need
        for c_id, chunk in chunks:
            if not chunk.free:
                continue
            k = min(left, len(chunk.free))
            taken = chunk.free[-k:]
            del chunk.free[-k:]
            for p in reversed(taken):
                if runs and runs[-1][0] == c_id and runs[-1][1] + runs[-1][2] == p:
                    c, f, n = runs[-1]
                    runs[-1] = (c, f, n + 1)
                else:
                    runs.append((c_id, p, 1))
            left -= k
            if left == 0:
                break
        assert left == 0, "free page count out of sync"
        self.used += need
        if self.used > self.step_peak:
            self.step_peak = self.used
            if self.used > self.peak_used:
                self.peak_used = self.used
        return runs

    def give_back(self, runs: list[Run]) -> None:
        n = 0
        for c_id, first, count in reversed(runs):
            self.chunks[c_id].free.extend(range(first + count - 1, first - 1, -1))
            n += count
        self.used -= n

    def add_chunk(self, npages: int) -> None:
        try:
            data = _host_region(npages * self.page_size, self.pinned)
        except (RuntimeError, OSError) as exc:
            raise PoolError(
                f"cannot reserve {npages * self.page_size} bytes for the pool: {exc}; lower PoolConfig.max_bytes "
                "or free host memory"
            ) from exc
        self.chunks.append(_Chunk(data, npages))
        self.total += npages
        self.peak_total = max(self.peak_total, self.total)
        self.grow_events += 1

    def grow(self, sizes_bytes: Sequence[int], shortfall: int, max_pages: int | None) -> None:
        """Add chunks of the planned ``sizes_bytes`` (at least ``shortfall`` pages, within ``max_pages``)."""
        pages = [self.pages_for(max(1, int(s))) for s in sizes_bytes]
        if sum(pages) < shortfall:
            pages.append(shortfall - sum(pages))
        if max_pages is not None:
            allowed = max_pages - self.total  # >= shortfall: the caller checked the cap
            while pages and sum(pages) > allowed:
                excess = sum(pages) - allowed
                if pages[-1] > excess:
                    pages[-1] -= excess
                else:
                    pages.pop()
        for n in pages:
            self.add_chunk(n)

    def shrink(self, keep_pages: int, max_pages: int | None) -> None:
        """Free trailing entirely-free chunks while the rest holds ``keep_pages`` (and ``max_pages``)."""
        while self.chunks:
            last = self.chunks[-1]
            if len(last.free) != last.npages:
                break
            over_cap = max_pages is not None and self.total > max_pages
            if not over_cap and self.total - last.npages < keep_pages:
                break
            self.chunks.pop()
            self.total -= last.npages
            self.shrink_events += 1

    def segments(self, runs: list[Run], nbytes: int) -> list[Segment]:
        """The segments holding the first ``nbytes`` of a stream stored in ``runs``."""
        out, pos, ps = [], 0, self.page_size
        for c_id, first, count in runs:
            if pos >= nbytes:
                break
            n = min(count * ps, nbytes - pos)
            out.append((self.chunks[c_id].data, first * ps, pos, n))
            pos += n
        return out

    @staticmethod
    def copy_in(spec: _PayloadSpec, segments: list[Segment]) -> None:
        """Copy a payload's tensors into the segments of its stream."""
        if len(segments) == 1:  # one run of pages: the common case
            data, doff, _, _ = segments[0]
            for part, src in zip(spec.parts, spec.sources, strict=True):
                if part.nbytes:
                    data[doff + part.offset : doff + part.offset + part.nbytes].copy_(src)
            return
        for part, src in zip(spec.parts, spec.sources, strict=True):
            lo, hi = part.offset, part.offset + part.nbytes
            for data, doff, soff, n in segments:
                a, b = max(lo, soff), min(hi, soff + n)
                if a < b:
                    data[doff + a - soff : doff + b - soff].copy_(src[a - lo : b - lo])

    def copy_stream_in(self, runs: list[Run], buf: torch.Tensor) -> None:
        """Copy a whole byte stream ``buf`` into ``runs``."""
        for data, doff, soff, n in self.segments(runs, buf.numel()):
            data[doff : doff + n].copy_(buf[soff : soff + n])

    def gather(self, runs: list[Run], nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The first ``nbytes`` of a stream stored in ``runs``, copied into a fresh buffer or ``out``."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu") if out is None else out[:nbytes]
        for data, doff, soff, n in self.segments(runs, nbytes):
            buf[soff : soff + n].copy_(data[doff : doff + n])
        return buf

    def view(self, runs: list[Run], nbytes: int) -> torch.Tensor:
        """A view of the first ``nbytes`` of a stream stored in at most one run."""
        if not runs:
            return torch.empty(0, dtype=torch.uint8, device="cpu")
        c_id, first, _ = runs[0]
        start = first * self.page_size
        return self.chunks[c_id].data[start : start + nbytes]

    def pieces(self, runs: list[Run], nbytes: int) -> list[torch.Tensor]:
        """The first ``nbytes`` of a stream stored in ``runs``, as host views (to write to a file)."""
        pieces = [data[doff : doff + n] for data, doff, _, n in self.segments(runs, nbytes)]
        if any(p.device.type != "cpu" for p in pieces):  # pragma: no cover - pool memory is host memory
            pieces = [p.cpu() for p in pieces]
        return pieces

    def scratch_take(self, nbytes: int) -> torch.Tensor:
        self.scratch_need = max(self.scratch_need, nbytes)
        fits = [i for i, b in enumerate(self.scratch) if b.numel() >= nbytes]
        if fits:
            return self.scratch.pop(min(fits, key=lambda i: self.scratch[i].numel()))
        return _host_region(max(1, self.pages_for(nbytes)) * self.page_size, self.pinned)

    def scratch_give(self, buf: torch.Tensor) -> None:
        self.scratch.append(buf)
        self.scratch.sort(key=lambda b: b.numel(), reverse=True)
        del self.scratch[_MAX_SCRATCH:]

    def end_step(self) -> None:
        """Step boundary: trim the scratch buffers and restart the step's peak."""
        self.scratch = [b for b in self.scratch if b.numel() <= 2 * self.scratch_need]
        self.scratch_need = 0
        self.step_peak = self.used

    def problems(self, owned: list[list[Run]]) -> list[str]:
        """What is wrong with the page accounting, given every record's runs (rule 1)."""
        free = sum(len(c.free) for c in self.chunks)
        n_owned = sum(count for runs in owned for _, _, count in runs)
        seen: set[tuple[int, int]] = set()
        for c_id, c in enumerate(self.chunks):
            seen.update((c_id, p) for p in c.free)
        for runs in owned:
            for c_id, first, count in runs:
                seen.update((c_id, p) for p in range(first, first + count))
        problems = []
        if sum(c.npages for c in self.chunks) != self.total:
            problems.append("chunk pages do not add up to total_pages")
        if free + self.used != self.total:
            problems.append(f"free {free} + used {self.used} != total {self.total}")
        if n_owned > self.used:
            problems.append(f"records own {n_owned} pages but only {self.used} are in use")
        if len(seen) != free + n_owned:
            problems.append("a page is both free and owned, or owned twice")
        return problems

    def clear(self) -> None:
        """Drop every chunk and scratch buffer (the pool is closing)."""
        self.chunks.clear()
        self.scratch.clear()
        self.total = 0
