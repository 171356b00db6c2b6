"""The handle of a record stored in a ``PagePool`` (``PooledRecord``) and the pool's own state of it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .config import RecordState
from .pages import Payload, Run, _PayloadSpec

if TYPE_CHECKING:
    from .store import PagePool

__all__ = ["PooledRecord"]

DemoteFn = Callable[[Payload], "Sequence[torch.Tensor] | None"]


class _Entry:
    """A record's state; owned by the pool, guarded by its lock. The user holds a ``PooledRecord``."""

    __slots__ = (
        "crc", "demote", "demotions", "device", "importance", "npages", "parts", "payload_nbytes", "pins",
        "release_requested", "runs", "seq", "spill_path", "state", "stream_nbytes",
    )

    def __init__(self, seq: int, importance: float, spec: _PayloadSpec, demote: DemoteFn | None) -> None:
        self.seq, self.importance, self.demote = seq, importance, demote
        self.parts, self.stream_nbytes = spec.parts, spec.stream_nbytes
        self.payload_nbytes, self.device = spec.payload_nbytes, spec.device
        self.runs: list[Run] = []
        self.npages = 0
        self.state = RecordState.RESIDENT
        self.demotions = 0
        self.spill_path: Path | None = None
        self.crc = 0
        self.pins = 0  # open borrow() blocks: not evictable, release deferred
        self.release_requested = False

    @property
    def key(self) -> tuple[float, int]:
        return (self.importance, self.seq)



class PooledRecord:
    """The handle of one stored record. ``load`` it, ``release`` it when backward no longer needs it."""

    __slots__ = ("__weakref__", "_entry", "_pool")

    def __init__(self, pool: PagePool, entry: _Entry) -> None:
        self._pool, self._entry = pool, entry

    @property
    def importance(self) -> float:
        return self._entry.importance

    @property
    def state(self) -> RecordState:
        return self._entry.state

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors (after any demotion)."""
        return self._entry.payload_nbytes

    @property
    def num_pages(self) -> int:
        """Pages held now (0 when spilled or released)."""
        return self._entry.npages

    @property
    def demotions(self) -> int:
        return self._entry.demotions

    def load(self, *, page_in: bool = True) -> Payload:
        """Fresh tensors bit-equal to what was stored (or to the latest demoted payload).

        Pages are read, not freed. A spilled record is read back from its file (its CRC checked,
        ``PoolError`` on corruption) and, with ``page_in``, paged back in when that fits without
        evicting anything. Pass ``page_in=False`` when the record is released right after (backward's
        last use): paging it in would only copy it into pages that are freed at once.
        """
        return self._pool._load(self._entry, page_in)

    @contextlib.contextmanager
    def borrow(self) -> Iterator[Payload]:
        """Zero-copy access for the duration of a ``with`` block::

            with rec.borrow() as (codes, lo, scale):
                x = decode(codes, lo, scale)   # reads the pool's pages directly
            rec.release()

        A resident record held in one run of pages (the usual case) yields views of its pages and is
        pinned meanwhile: not evicted, and a ``release`` inside the block takes effect at its end.
        A record spread over several runs, or spilled, is gathered (read) into a scratch buffer that
        the pool reuses from block to block (NOTE [ Scratch buffers ] in ``pool/pages.py``). Either
        way the tensors must not be used after the block. Records stored from a device yield a fresh
        copy on that device.
        """
        payload, pinned, scratch = self._pool._borrow_begin(self._entry)
        try:
            yield payload
        finally:
            if pinned or scratch is not None:
                self._pool._borrow_end(self._entry, pinned, scratch)

    def release(self) -> None:
        """Give the record's pages (or spill file) back to the pool. Idempotent."""
        self._pool._release(self._entry)

    def __del__(self) -> None:
        try:
            self._pool._release(self._entry, blocking=False)
        except Exception:
            pass

    def __repr__(self) -> str:
        e = self._entry
        return (
            f"PooledRecord(seq={e.seq}, importance={e.importance}, state={e.state.value}, "
            f"nbytes={e.payload_nbytes}, pages={e.npages}, demotions={e.demotions})"
        )
