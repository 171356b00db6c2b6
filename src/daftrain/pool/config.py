"""A ``PagePool``'s configuration, its statistics snapshot and the states of a pooled record."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError
from .growth import KIB, AdaptiveGrowth, GrowthPolicy, _check_int

__all__ = ["PoolConfig", "PoolStats", "RecordState"]


@dataclass(frozen=True)
class PoolConfig:
    """How a ``PagePool`` reserves, caps and spills memory.

    Example::

        PoolConfig(page_size=64 * 2**10, max_bytes=2 * 2**30, growth=FixedGrowth(100 * 2**20))
    """

    page_size: int = 64 * KIB
    """Bytes per page: a power of two >= 4 KiB. A record wastes on average half a page."""

    initial_bytes: int = 0
    """Bytes reserved (allocated and touched) up front, rounded up to pages; 0 reserves lazily."""

    max_bytes: int | None = None
    """Most bytes of pages the pool may hold in use *and* reserve; ``None`` is unlimited. Whole pages
    count, so the effective cap is ``max_bytes // page_size`` pages. ``PagePool.set_max_bytes``
    changes it (after lowering it, chunks still in use stay reserved until they are entirely free)."""

    growth: GrowthPolicy = field(default_factory=AdaptiveGrowth)
    """How the pool grows and shrinks: ``FixedGrowth(...)``, ``AdaptiveGrowth(...)`` (the default:
    headroom kept between steps) or ``TrackingGrowth(...)`` (the reservation follows each step's peak)."""

    spill: bool = True
    """Whether records may be spilled to files when demotion is not enough. Without spilling a store
    that cannot fit raises ``PoolBudgetError``."""

    spill_dir: str | os.PathLike[str] | None = None
    """Directory in which the pool makes its private spill directory (mode 0700, removed with the
    pool; ``spill_dir`` is created if missing); ``None`` uses the system's temporary directory."""

    pin_memory: bool = False
    """Allocate chunks in page-locked host memory when a CUDA device is present (fast, asynchronous
    device <-> pool copies). Ignored on CPU-only systems, see NOTE [ Host memory ] in ``pool/pages.py``."""

    def __post_init__(self) -> None:
        ps = self.page_size
        if isinstance(ps, bool) or not isinstance(ps, int) or ps < 4096 or ps & (ps - 1) or ps > 1 << 30:
            raise InvalidArgumentError(f"page_size must be a power of two in [4096, 2**30], got {ps!r}")
        _check_int("initial_bytes", self.initial_bytes, 0)
        if self.max_bytes is not None:
            _check_int("max_bytes", self.max_bytes, 1)
            if self.initial_bytes > self.max_bytes:
                raise InvalidArgumentError(
                    f"initial_bytes ({self.initial_bytes}) must not exceed max_bytes ({self.max_bytes})"
                )
        if not isinstance(self.growth, GrowthPolicy):
            raise InvalidArgumentError(
                f"growth must be a FixedGrowth, AdaptiveGrowth, TrackingGrowth or GrowthPolicy, got {self.growth!r}"
            )
        if not isinstance(self.spill, bool):
            raise InvalidArgumentError(f"spill must be a bool, got {self.spill!r}")
        if self.spill_dir is not None and not isinstance(self.spill_dir, (str, os.PathLike)):
            raise InvalidArgumentError(f"spill_dir must be None or a path, got {self.spill_dir!r}")
        if not isinstance(self.pin_memory, bool):
            raise InvalidArgumentError(f"pin_memory must be a bool, got {self.pin_memory!r}")


@dataclass(frozen=True)
class PoolStats:
    """A consistent snapshot of a pool's accounting (taken under its lock)."""

    page_size: int
    total_pages: int
    free_pages: int
    chunks: int
    reserved_bytes: int
    """Bytes of all chunks (``total_pages * page_size``)."""
    used_bytes: int
    """Bytes of pages in use (``(total_pages - free_pages) * page_size``)."""
    payload_bytes: int
    """Bytes of the resident records' tensors (what is actually stored; padding and page tails not)."""
    peak_used_bytes: int
    peak_reserved_bytes: int
    max_bytes: int | None
    """The pool's byte cap (``PoolConfig.max_bytes``, or the last ``set_max_bytes``)."""
    records: int
    """Live records: resident plus spilled."""
    resident_records: int
    spilled_records: int
    spilled_bytes: int
    """Bytes of the spill files of live spilled records."""
    scratch_bytes: int
    """Bytes of the scratch buffers kept for ``borrow`` (not part of ``reserved_bytes``)."""
    demotions: int
    spills: int
    page_ins: int
    grow_events: int
    shrink_events: int
    steps: int

    @property
    def evictions(self) -> int:
        """Demotions plus spills."""
        return self.demotions + self.spills

    @property
    def occupancy(self) -> float:
        """Pages in use over pages reserved."""
        return self.used_bytes / self.reserved_bytes if self.reserved_bytes else 1.0

    @property
    def efficiency(self) -> float:
        """Payload bytes over reserved bytes: page-internal waste and free pages both count."""
        return self.payload_bytes / self.reserved_bytes if self.reserved_bytes else 1.0


class RecordState(enum.Enum):
    """Where a pooled record's bytes are."""

    RESIDENT = "resident"
    """In pages, as stored."""
    DEMOTED = "demoted"
    """In pages, re-encoded at fewer bits by its demote callback."""
    SPILLED = "spilled"
    """In a spill file (possibly after demotion); ``load`` reads it back."""
    RELEASED = "released"
    """Given back; its bytes are gone."""
