"""An importance-aware paged memory pool for packed records.

With dynamic bit-widths every training step saves records of different sizes. Allocating each one
from the general allocator fragments memory and, on CPU, pays a page fault for every fresh buffer.
``PagePool`` instead keeps a few large preallocated regions ("chunks"), carves them into fixed-size
pages and stores each record's payload in a *list* of pages, so no record ever needs a contiguous
free run and the same pages are reused step after step::

    pool = PagePool(PoolConfig(max_bytes=512 * 2**20))
    rec = pool.store((codes, lo, scale), importance=0.7)    # copies the bytes into pages
    codes, lo, scale = rec.load()                            # bit-exact copies, pages stay put
    with rec.borrow() as (codes, lo, scale):                 # or: zero-copy views for one block
        ...
    rec.release()                                            # pages go back to the free list
    pool.end_step()                                          # step boundary: adapt, maybe shrink

A payload is any tuple of tensors, returned in the order it was stored (the library stores a
quantized record as ``(codes, lo, scale)``). When a store would exceed ``max_bytes`` the least
important records are first *demoted* (re-encoded at fewer bits by a callback given at store time)
and then *spilled* to files, and paged back in on ``load()`` / ``prefetch()``. Nothing is ever
dropped: ``load()`` returns the stored bytes (or, after a demotion, the demoted payload) or raises
``PoolError``.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections import deque
from collections.abc import Sequence

import torch
from sortedcontainers import SortedList

from ..errors import ArgumentTypeError, InvalidArgumentError
from .config import PoolConfig, PoolStats, RecordState
from .errors import PoolBudgetError, PoolError
from .growth import Demand, GrowthPolicy, _check_int
from .pages import Payload, Run, _describe, _PageTable, _PayloadSpec, _spill_pieces, _unflatten, _unflatten_sources
from .record import DemoteFn, PooledRecord, _Entry
from .spill import _SpillFiles

__all__ = ["PagePool"]


# NOTE [ Page lifetime rules ]
#   1. A page is either on exactly one chunk's free stack or owned by exactly one record (its runs);
#      ``used_pages + sum(len(chunk.free)) == total_pages`` at every lock release.
#   2. Pages are taken for a record under the lock *before* its bytes are copied; the copy itself
#      runs outside the lock (the record is not yet in the importance index, so nothing can evict or
#      move it), then the record is published in the index under the lock.
#   3. ``load`` reads pages, never frees them. ``release`` (explicit, from ``__del__`` as a safety
#      net, or from ``close``) gives them back and is idempotent.
#   4. Freed pages are pushed so that the next pops return them in ascending order: a record usually
#      gets one run of consecutive pages, and ``store``/``load`` copy run by run.
#   5. Allocation takes the pages from the lowest-numbered chunk that can hold the whole record, else
#      spreads it from the lowest chunk up, so trailing chunks drain and can be freed at a step
#      boundary; only a chunk with *all* its pages free is ever freed.
#   6. Demotion rewrites a record into a prefix of its own pages and frees the tail; spilling writes
#      its file first and frees its pages only once the write succeeded. Neither happens to a record
#      more important than (or as important and newer than) the one that needs the room.
#   7. A spilled record is paged back in by ``prefetch`` (which may evict less important records) or
#      by ``load(page_in=True)`` when its pages fit without evicting anything.
#   8. ``borrow`` pins a resident one-run record: while pinned it is never demoted or spilled, and a
#      ``release`` is deferred to the end of the last borrow, so the views it hands out stay valid
#      inside the ``with`` block (and only there: after it the pages may hold another record). The
#      views keep the chunk's storage alive, so even a misuse never touches unmapped memory.

# NOTE [ Eviction order ]
# Records are keyed (importance, insertion number) in a SortedList: equal importance evicts the older
# record first (in a training step the first saved is the last needed by backward). A store that
# would exceed ``max_bytes`` makes room from the records with a smaller key, strictly in key order:
#   1. demote: the least important record, if it has a demote callback, is re-encoded one level down
#      (the callback returns a smaller payload, or None when it cannot go further) into a prefix of
#      its pages; it stays the least important, so it is demoted again until it is at its floor;
#   2. spill: a least important record that cannot be demoted (any more) is spilled; the next one
#      becomes the least important and the loop goes on until enough pages are free.
# So precision is only ever lost on the least important records, and a more important record is
# never demoted to spare a less important one from spilling (spilling is lossless, it only costs
# I/O). If that is not enough, the new record itself is demoted (outside the lock) until it fits; if
# it never fits it is spilled straight to a file as it was given (its demotion would gain nothing).
# With spilling disabled, records that cannot be demoted are skipped and a store that still does not
# fit raises ``PoolBudgetError`` (after the demotions, which leave every record valid). Nothing is
# lost silently. When spilling is enabled but even evicting every less important record could not
# make room, nothing is evicted for it.

# NOTE [ Locking ]
# One ``threading.Lock`` guards the chunks, free stacks, index and counters. Copies into a new
# record's pages run outside it (rule 2); gathers for ``load``, demote callbacks and spill I/O of
# *evicted* records run under it, because the pages they touch could otherwise be evicted or reused
# by another thread; reads of ``borrow``'s views run outside it, the record being pinned (rule 8).
# A demote callback must therefore not call into the pool. ``PooledRecord.__del__``
# may run inside a locked section of the same thread (garbage collection), so it never blocks: if the
# lock is taken it queues the release (a deque append is atomic) and the next locked operation
# performs it.



class PagePool:
    """A paged, byte-capped, importance-aware store for packed records. See the module docstring."""

    def __init__(self, config: PoolConfig | None = None) -> None:
        config = config if config is not None else PoolConfig()
        if not isinstance(config, PoolConfig):
            raise ArgumentTypeError(f"config must be a PoolConfig, got {type(config).__name__}")
        self.config = config
        self._ps = config.page_size
        self._policy: GrowthPolicy = config.growth
        self._pages = _PageTable(config.page_size, bool(config.pin_memory and torch.cuda.is_available()))
        self._spill_files = _SpillFiles(config.spill_dir)
        self._lock = threading.Lock()
        self._pending: deque[_Entry] = deque()
        self._index: SortedList = SortedList()
        self._live: dict[int, _Entry] = {}
        self._max_bytes = config.max_bytes
        self._max_pages: int | None = None if config.max_bytes is None else config.max_bytes // self._ps
        self._demand = Demand()
        self._next_seq = 0
        self._closed = False
        # counters (guarded by the lock)
        self._payload_bytes = self._spilled_bytes = self._spilled_records = 0
        self._demotions = self._spills = self._page_ins = self._steps = 0
        if config.initial_bytes:
            with self._lock:
                self._pages.add_chunk(self._pages.pages_for(config.initial_bytes))

    # -- public API ----------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self._ps

    @property
    def pinned(self) -> bool:
        """Whether chunks live in page-locked host memory."""
        return self._pages.pinned

    def store(self, payload: Sequence[torch.Tensor], importance: float, *,
              demote: DemoteFn | None = None) -> PooledRecord:
        """Copy ``payload`` (a tuple of tensors) into pages and return its handle.

        ``importance`` orders eviction (lower goes first). ``demote``, if given, maps a payload to a
        smaller one at fewer bits (or ``None`` when it cannot go further); the pool calls it when it
        needs room, and ``load`` then returns the demoted payload. Raises ``PoolBudgetError`` when
        the record cannot fit and spilling is disabled.
        """
        spec = _describe(payload)
        importance = self._check_importance(importance)
        if demote is not None and not callable(demote):
            raise ArgumentTypeError(f"demote must be callable or None, got {type(demote).__name__}")
        with self._lock:
            self._check_open()
            self._drain()
            seq = self._next_seq
            self._next_seq += 1
            entry = _Entry(seq, importance, spec, demote)
            runs = self._reserve(self._pages.pages_for(spec.stream_nbytes), entry.key, evict=True)
            if runs is not None:
                self._claim(entry, runs)
                segments = self._pages.segments(runs, spec.stream_nbytes)
        if runs is None and demote is not None:
            spec, runs, segments = self._store_demoted(entry, spec, demote)
        if runs is not None:
            self._pages.copy_in(spec, segments)
            with self._lock:
                if not self._publish(entry):
                    raise PoolError("the pool was closed during the store")
        elif self.config.spill:
            self._spill_new(entry, spec)
        else:
            with self._lock:
                used, cap = self._pages.used * self._ps, self._max_bytes
            raise PoolBudgetError(
                spec.stream_nbytes, cap or 0, used,
                f"{self._pages.pages_for(spec.stream_nbytes)} pages of {self._ps} bytes; nothing less "
                "important can be demoted and spilling is disabled",
            )
        return PooledRecord(self, entry)

    def prefetch(self, record: PooledRecord) -> bool:
        """Page a spilled record back in ahead of ``load`` (evicting less important records if
        ``max_bytes`` needs it). Returns whether the record is resident afterwards."""
        entry = record._entry
        with self._lock:
            self._check_open()
            self._drain()
            if entry.state is RecordState.RELEASED:
                raise PoolError(f"record {entry.seq} was released")
            if entry.state is not RecordState.SPILLED:
                return True
            buf = self._read_spill(entry)
            return self._page_in(entry, buf, evict=True)

    def set_max_bytes(self, max_bytes: int | None) -> None:
        """Change the pool's byte cap. A lower cap makes the next stores evict; trailing free chunks
        above it are freed now."""
        if max_bytes is not None:
            _check_int("max_bytes", max_bytes, 1)
        with self._lock:
            self._drain()
            self._max_bytes = max_bytes
            self._max_pages = None if max_bytes is None else max_bytes // self._ps
            self._pages.shrink(self._pages.total, self._max_pages)

    def end_step(self) -> None:
        """Mark a training-step boundary: the growth policy observes the step's peak usage and
        trailing free chunks beyond what it wants to keep are freed."""
        with self._lock:
            self._check_open()
            self._drain()
            pages, cap = self._pages, self._max_pages
            self._demand = self._policy.observe(self._demand, pages.step_peak * self._ps)
            keep = pages.pages_for(max(0, self._policy.keep_bytes(self._demand)))
            if cap is not None:
                keep = min(keep, cap)
            keep = max(keep, pages.used)
            limit = keep + pages.pages_for(max(0, self._policy.slack_bytes(keep * self._ps)))
            if pages.total > limit or (cap is not None and pages.total > cap):
                pages.shrink(keep, cap)
            pages.end_step()
            self._steps += 1

    def stats(self) -> PoolStats:
        """A consistent snapshot of the accounting."""
        with self._lock:
            self._drain()
            pages, ps = self._pages, self._ps
            return PoolStats(
                page_size=ps,
                total_pages=pages.total,
                free_pages=pages.total - pages.used,
                chunks=len(pages.chunks),
                reserved_bytes=pages.total * ps,
                used_bytes=pages.used * ps,
                payload_bytes=self._payload_bytes,
                peak_used_bytes=pages.peak_used * ps,
                peak_reserved_bytes=pages.peak_total * ps,
                max_bytes=self._max_bytes,
                records=len(self._live),
                resident_records=len(self._live) - self._spilled_records,
                spilled_records=self._spilled_records,
                spilled_bytes=self._spilled_bytes,
                scratch_bytes=sum(b.numel() for b in pages.scratch),
                demotions=self._demotions,
                spills=self._spills,
                page_ins=self._page_ins,
                grow_events=pages.grow_events,
                shrink_events=pages.shrink_events,
                steps=self._steps,
            )

    def check(self) -> None:
        """Verify the page accounting invariants (NOTE [ Page lifetime rules ] 1); raises PoolError."""
        with self._lock:
            self._drain()
            problems = self._pages.problems([e.runs for e in self._live.values()])
            if any(e.npages != sum(r[2] for r in e.runs) for e in self._live.values()):
                problems.append("a record's page count disagrees with its runs")
            if len(self._index) > len(self._live) - self._spilled_records:
                problems.append("more index entries than resident records")
            published = sum(e.payload_nbytes for e in self._live.values() if e.key in self._index)
            if published != self._payload_bytes:
                problems.append(f"payload_bytes {self._payload_bytes} != {published} held by indexed records")
            if problems:
                raise PoolError("pool accounting is inconsistent: " + "; ".join(problems))

    def close(self) -> None:
        """Release every record, free all chunks and remove the pool's spill directory."""
        with self._lock:
            if self._closed:
                return
            self._drain()
            for entry in list(self._live.values()):
                entry.pins = 0
                self._release_locked(entry)
            self._pages.clear()
            self._closed = True
        self._spill_files.close()

    def __enter__(self) -> PagePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"PagePool(page_size={s.page_size}, reserved={s.reserved_bytes}, used={s.used_bytes}, "
            f"records={s.records}, max_bytes={s.max_bytes}, growth={self._policy!r})"
        )

    # -- store helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _check_importance(importance: float) -> float:
        if isinstance(importance, bool) or not isinstance(importance, numbers.Real):
            raise ArgumentTypeError(f"importance must be a number, got {type(importance).__name__}")
        importance = float(importance)
        if not math.isfinite(importance):
            raise InvalidArgumentError(f"importance must be finite, got {importance}")
        return importance

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError("the pool is closed")

    def _store_demoted(self, entry: _Entry, spec: _PayloadSpec, demote: DemoteFn):
        """No room for the new record even after evicting everything less important: demote it
        (outside the lock) until it fits. Returns the original spec and no runs when it never fits:
        it is then spilled as given."""
        current, demotions, pages_for = spec, 0, self._pages.pages_for
        while True:
            new = demote(tuple(_unflatten_sources(current)))
            if new is None:
                return spec, None, None
            new_spec = _describe(tuple(new))
            if pages_for(new_spec.stream_nbytes) >= pages_for(current.stream_nbytes):
                return spec, None, None
            current, demotions = new_spec, demotions + 1
            with self._lock:
                self._check_open()
                runs = self._reserve(pages_for(current.stream_nbytes), entry.key, evict=True)
                if runs is None:
                    continue
                entry.parts, entry.stream_nbytes = current.parts, current.stream_nbytes
                entry.payload_nbytes = current.payload_nbytes
                entry.demotions += demotions
                entry.state = RecordState.DEMOTED
                self._demotions += demotions
                self._claim(entry, runs)
                return current, runs, self._pages.segments(runs, current.stream_nbytes)

    def _claim(self, entry: _Entry, runs: list[Run]) -> None:
        entry.runs = runs
        entry.npages = sum(r[2] for r in runs)
        self._live[entry.seq] = entry

    def _publish(self, entry: _Entry) -> bool:
        if entry.state is RecordState.RELEASED:  # the pool was closed while we copied
            return False
        self._index.add(entry.key)
        self._payload_bytes += entry.payload_nbytes
        return True

    # -- pages and eviction ------------------------------------------------------------------------------
    def _reserve(self, need: int, key: tuple[float, int], *, evict: bool) -> list[Run] | None:
        """Take ``need`` pages under ``max_bytes`` (evicting records with a smaller key when ``evict``)
        and growing if the chunks are short; ``None`` when the cap does not allow it."""
        if need == 0:
            return []
        pages, cap = self._pages, self._max_pages
        if cap is not None and pages.used + need > cap:
            if not evict or not self._make_room(need, key):
                return None
        shortfall = need - (pages.total - pages.used)
        if shortfall > 0:
            sizes = self._policy.plan_growth(shortfall * self._ps, pages.total * self._ps, self._demand)
            pages.grow(sizes, shortfall, cap)
        return pages.take(need)

    def _room(self, need: int) -> bool:
        return self._max_pages is None or self._pages.used + need <= self._max_pages

    def _make_room(self, need: int, key: tuple[float, int]) -> bool:
        """Evict records with a key below ``key`` (NOTE [ Eviction order ]) until ``need`` fits."""
        cap = self._max_pages
        assert cap is not None
        if need > cap:
            return False
        spill = self.config.spill
        if spill:
            candidates = self._index.irange(maximum=key, inclusive=(True, False))
            reclaimable = sum(self._live[seq].npages for _, seq in candidates if not self._live[seq].pins)
            if self._pages.used - reclaimable + need > cap:
                return False  # hopeless: evict nothing for it
        while not self._room(need):
            victim = None
            for _, seq in self._index.irange(maximum=key, inclusive=(True, False)):
                entry = self._live[seq]
                if not entry.pins and (spill or entry.demote is not None):
                    victim = entry
                    break
            if victim is None:
                return False
            if victim.demote is not None:
                self._demote(victim)  # shrinks it, or clears its callback when it cannot
            else:
                self._spill(victim)
        return True

    def _demote(self, entry: _Entry) -> None:
        """Re-encode a resident record one level down, into a prefix of its own pages."""
        pages = self._pages
        payload = _unflatten(pages.gather(entry.runs, entry.stream_nbytes), entry.parts)
        try:
            new = entry.demote(payload)  # type: ignore[misc]
        except Exception as exc:
            entry.demote = None
            raise PoolError(f"the demote callback of record {entry.seq} failed: {exc}") from exc
        if new is None:
            entry.demote = None
            return
        spec = _describe(tuple(new))
        npages = pages.pages_for(spec.stream_nbytes)
        if npages >= entry.npages:
            entry.demote = None  # no progress: it will be spilled if need be
            return
        keep, tail, left = [], [], npages
        for c_id, first, count in entry.runs:
            k = min(left, count)
            if k:
                keep.append((c_id, first, k))
            if count > k:
                tail.append((c_id, first + k, count - k))
            left -= k
        pages.copy_in(spec, pages.segments(keep, spec.stream_nbytes))
        pages.give_back(tail)
        self._payload_bytes += spec.payload_nbytes - entry.payload_nbytes
        entry.parts, entry.stream_nbytes = spec.parts, spec.stream_nbytes
        entry.payload_nbytes = spec.payload_nbytes
        entry.runs, entry.npages = keep, npages
        entry.demotions += 1
        entry.state = RecordState.DEMOTED
        self._demotions += 1

    # -- spilling ------------------------------------------------------------------------------------------
    def _spill(self, entry: _Entry) -> None:
        """Write a resident record's stream to its file, then free its pages (lock held)."""
        pieces = self._pages.pieces(entry.runs, entry.stream_nbytes)
        path, entry.crc = self._spill_files.write(entry.seq, entry.stream_nbytes, pieces)
        self._index.remove(entry.key)
        self._pages.give_back(entry.runs)
        self._payload_bytes -= entry.payload_nbytes
        entry.runs, entry.npages = [], 0
        entry.spill_path, entry.state = path, RecordState.SPILLED
        self._spilled_records += 1
        self._spilled_bytes += entry.stream_nbytes
        self._spills += 1

    def _spill_new(self, entry: _Entry, spec: _PayloadSpec) -> None:
        """Spill a record that never got pages (it is the least important one that does not fit)."""
        with self._lock:
            self._check_open()
        path, entry.crc = self._spill_files.write(entry.seq, spec.stream_nbytes, _spill_pieces(spec))
        with self._lock:
            entry.spill_path, entry.state = path, RecordState.SPILLED
            if self._closed:
                entry.state = RecordState.RELEASED
                self._spill_files.remove(path)
                raise PoolError("the pool is closed")
            self._live[entry.seq] = entry
            self._spilled_records += 1
            self._spilled_bytes += entry.stream_nbytes
            self._spills += 1

    def _read_spill(self, entry: _Entry, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read and verify a spilled record's stream into a fresh buffer or ``out`` (lock held)."""
        assert entry.spill_path is not None
        return self._spill_files.read(entry.spill_path, entry.seq, entry.stream_nbytes, entry.crc, out)

    def _page_in(self, entry: _Entry, buf: torch.Tensor, *, evict: bool) -> bool:
        """Move a verified spilled record back into pages (lock held); False when it does not fit."""
        runs = self._reserve(self._pages.pages_for(entry.stream_nbytes), entry.key, evict=evict)
        if runs is None:
            return False
        self._pages.copy_stream_in(runs, buf[: entry.stream_nbytes])
        assert entry.spill_path is not None
        self._spill_files.remove(entry.spill_path)
        entry.spill_path = None
        entry.runs, entry.npages = runs, sum(r[2] for r in runs)
        entry.state = RecordState.DEMOTED if entry.demotions else RecordState.RESIDENT
        self._spilled_records -= 1
        self._spilled_bytes -= entry.stream_nbytes
        self._index.add(entry.key)
        self._payload_bytes += entry.payload_nbytes
        self._page_ins += 1
        return True

    # -- load / borrow / release ---------------------------------------------------------------------------
    def _check_loadable(self, entry: _Entry) -> None:
        self._check_open()
        self._drain()
        if entry.state is RecordState.RELEASED or entry.release_requested:
            raise PoolError(f"record {entry.seq} was released")

    def _load(self, entry: _Entry, page_in: bool = True) -> Payload:
        with self._lock:
            self._check_loadable(entry)
            if entry.state is RecordState.SPILLED:
                buf = self._read_spill(entry)
                if page_in:
                    self._page_in(entry, buf, evict=False)
            else:
                buf = self._pages.gather(entry.runs, entry.stream_nbytes)
            parts, device = entry.parts, entry.device
        if device.type != "cpu":
            buf = buf.to(device)
        return _unflatten(buf, parts)

    def _borrow_begin(self, entry: _Entry) -> tuple[Payload, bool, torch.Tensor | None]:
        with self._lock:
            self._check_loadable(entry)
            pages, spilled = self._pages, entry.state is RecordState.SPILLED
            if entry.device.type != "cpu":
                buf = self._read_spill(entry) if spilled else pages.gather(entry.runs, entry.stream_nbytes)
                parts, device = entry.parts, entry.device
            elif spilled or len(entry.runs) > 1:
                scratch = pages.scratch_take(entry.stream_nbytes)
                try:
                    if spilled:
                        buf = self._read_spill(entry, out=scratch)
                    else:
                        buf = pages.gather(entry.runs, entry.stream_nbytes, out=scratch)
                except BaseException:
                    pages.scratch_give(scratch)
                    raise
                return _unflatten(buf, entry.parts), False, scratch
            else:
                entry.pins += 1
                return _unflatten(pages.view(entry.runs, entry.stream_nbytes), entry.parts), True, None
        return _unflatten(buf.to(device), parts), False, None

    def _borrow_end(self, entry: _Entry, pinned: bool, scratch: torch.Tensor | None) -> None:
        with self._lock:
            if scratch is not None and not self._closed:
                self._pages.scratch_give(scratch)
            if not pinned or entry.pins == 0:  # (pins == 0: the pool was closed inside the block)
                return
            entry.pins -= 1
            if entry.pins == 0 and entry.release_requested:
                entry.release_requested = False
                self._release_locked(entry)
            self._drain()

    def _release(self, entry: _Entry, *, blocking: bool = True) -> None:
        if entry.state is RecordState.RELEASED:
            return
        if not self._lock.acquire(blocking=blocking):
            self._pending.append(entry)
            return
        try:
            self._drain()
            self._release_locked(entry)
        finally:
            self._lock.release()

    def _drain(self) -> None:
        while self._pending:
            self._release_locked(self._pending.popleft())

    def _release_locked(self, entry: _Entry) -> None:
        if entry.state is RecordState.RELEASED or self._live.get(entry.seq) is not entry:
            entry.state = RecordState.RELEASED
            return
        if entry.pins:  # borrowed: the last borrow to end releases it (NOTE [ Page lifetime rules ] 8)
            entry.release_requested = True
            return
        if entry.state is RecordState.SPILLED:
            if entry.spill_path is not None:
                self._spill_files.remove(entry.spill_path)
            self._spilled_records -= 1
            self._spilled_bytes -= entry.stream_nbytes
        else:
            if entry.key in self._index:
                self._index.remove(entry.key)
                self._payload_bytes -= entry.payload_nbytes
            self._pages.give_back(entry.runs)
            entry.runs, entry.npages = [], 0
        del self._live[entry.seq]
        entry.state = RecordState.RELEASED
