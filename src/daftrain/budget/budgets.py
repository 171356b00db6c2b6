"""Memory budgets: how many bytes training may use, fixed, changing, or read from the system.

A budget counts what an operating-system limit counts: the whole process's resident memory on CPU
(model, optimizer state, batch, runtime and activations together), device memory on CUDA. The
planner (``planner.py``) works inside the headroom between what the process already holds and the
budget.

Example::

    Budget("600MB").bytes()               # 600_000_000
    Budget(lambda: limits.current)        # read again before every step
    Budget.system(fraction=0.8)           # 80 % of what this process could hold right now
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import torch

from ..errors import DaftrainError, InvalidArgumentError, UnsupportedError
from .memory import current_rss_bytes, format_bytes

__all__ = [
    "Budget",
    "BudgetError",
    "BudgetTooSmallError",
    "SystemMemory",
    "parse_bytes",
    "read_system_memory",
]


class BudgetError(InvalidArgumentError):
    """A budget that is not a valid number of bytes (bad string, negative, NaN...)."""


class BudgetTooSmallError(DaftrainError, RuntimeError):
    """No plan fits the budget, not even the leanest one.

    ``required_bytes`` really fits under the same prediction: ``plan_step`` computes it with the
    margins it checks against (``PlannerConfig.safety``, the model correction ``alpha``, the
    optimizer step's transient), rounds it up to whole bytes and verifies that a budget of exactly
    that many bytes plans. The message shows it rounded up too (``547.5 MB``, never down), so the
    figure as written is a budget that fits. "The same prediction" means the same measured profile
    and the same memory held at the start of the step: a process that holds more by then needs more.

    Attributes:
        budget_bytes: the budget that was asked for.
        required_bytes: the smallest budget the leanest plan is predicted to fit in.
    """

    def __init__(self, budget_bytes: int, required_bytes: int, detail: str = "") -> None:
        self.budget_bytes = int(budget_bytes)
        self.required_bytes = int(required_bytes)
        msg = (
            f"memory budget {format_bytes(budget_bytes)} is too small: the leanest plan needs "
            f"{format_bytes(required_bytes, round_up=True)} ({required_bytes} bytes). Raise the budget to at least "
            "that"
        )
        if detail:
            msg += f"; {detail}"
        msg += ". (Tip: a smaller model, a smaller batch or fewer optimizer states lower the floor.)"
        super().__init__(msg)


_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float) -> int:
    """Bytes from ``"600MB"``, ``"1.5 GiB"``, ``"2e9"``, ``600_000_000`` (SI units are powers of 1000).

    Raises:
        BudgetError: unknown unit, negative, non-finite or non-numeric values.
    """
    if isinstance(value, bool):
        raise BudgetError(f"a memory size (budget) must be a number of bytes or a string like '600MB', got {value!r}")
    if isinstance(value, int):
        n: float | Decimal = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise BudgetError(f"a memory size (budget) must be finite, got {value!r}; pass bytes or e.g. '600MB'")
        n = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None:
            raise BudgetError(f"cannot read {value!r} as a memory size (budget); write e.g. '600MB', '1.5GiB' or "
                              "'2e9'")
        unit = match.group(2).lower()
        if unit not in _UNITS:
            raise BudgetError(f"unknown unit {match.group(2)!r} in the memory size (budget) {value!r}; use B, kB, "
                              "MB, GB, TB, KiB, MiB, GiB or TiB")
        # NOTE [ Exact decimal sizes ]
        # Decimal, not float: float("547.3") * 10**6 is 547299999.99999994, one byte short of the
        # budget the text names once truncated to whole bytes.
        n = Decimal(match.group(1)) * _UNITS[unit]
    else:
        raise BudgetError(f"a memory size (budget) must be a str, int or float, got {type(value).__name__}; pass "
                          "bytes or a string like '600MB'")
    if n < 0:
        raise BudgetError(f"a memory size (budget) cannot be negative, got {value!r}; pass bytes >= 0")
    return int(n)


# -- reading the system ------------------------------------------------------------------------------

@dataclass(frozen=True)
class SystemMemory:
    """What the system says about memory for this process, in bytes (``None`` where unknown).

    ``limit`` and ``available`` are what the tightest source allows: a cgroup v2 limit wins over
    ``/proc/meminfo``, which wins over psutil.
    """

    process_rss: int
    """Resident memory of this process now."""
    cgroup_max: int | None
    """cgroup v2 ``memory.max`` (``None`` when unlimited or not in a cgroup v2)."""
    cgroup_current: int | None
    """cgroup v2 ``memory.current`` (everything charged to the cgroup, page cache included)."""
    mem_available: int | None
    """``MemAvailable`` from /proc/meminfo (or psutil's ``available``)."""
    source: str
    """Which reading decided ``available``."""

    @property
    def available(self) -> int:
        """Bytes this process could still allocate, by the tightest source."""
        candidates = []
        if self.cgroup_max is not None and self.cgroup_current is not None:
            candidates.append(max(0, self.cgroup_max - self.cgroup_current))
        if self.mem_available is not None:
            candidates.append(self.mem_available)
        if not candidates:
            raise UnsupportedError("no source of free memory could be read (no cgroup v2, /proc/meminfo or psutil): "
                                   "install psutil, or pass a fixed budget such as Budget('600MB')")
        return min(candidates)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (unlimited) -> None


def _cgroup_dir(proc_cgroup: Path, root: Path) -> Path | None:
    """The cgroup v2 directory of this process (``0::/path`` in /proc/self/cgroup)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return None


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def read_system_memory(*, cgroup_root: str | Path = "/sys/fs/cgroup", proc: str | Path = "/proc") -> SystemMemory:
    """Read cgroup v2 ``memory.max``/``memory.current``, ``/proc/meminfo`` (psutil as fallback).

    ``cgroup_root`` and ``proc`` exist for tests (point them at a fake tree).
    """
    # NOTE [ Why cgroup first ]
    # Inside a container /proc/meminfo and psutil report the *host's* memory, while the kernel
    # OOM-kills at the cgroup's memory.max. The cgroup reading is therefore the binding one when
    # present; we still take the minimum with MemAvailable in case the host itself is tighter.
    cgroup_root, proc = Path(cgroup_root), Path(proc)
    cg = _cgroup_dir(proc / "self" / "cgroup", cgroup_root)
    best: tuple[int, int] | None = None
    d = cg
    while d is not None:  # a limit may be set on an ancestor: the tightest one binds
        m, c = _read_int(d / "memory.max"), _read_int(d / "memory.current")
        if m is not None and c is not None and (best is None or m - c < best[0] - best[1]):
            best = (m, c)
        d = d.parent if d != cgroup_root and cgroup_root in d.parents else None
    cg_max, cg_cur = best if best is not None else (None, None)
    avail = _meminfo_available(proc / "meminfo")
    source = "cgroup" if cg_max is not None else ("meminfo" if avail is not None else "none")
    return SystemMemory(current_rss_bytes(), cg_max, cg_cur, avail, source)


def cuda_free_bytes(device: torch.device | int | None = None) -> tuple[int, int, bool]:
    """``(free, total, trusted)`` for a CUDA device.

    On integrated GPUs (Jetson and other unified-memory parts) ``cudaMemGetInfo`` ignores reclaimable
    page cache and swap, so ``trusted`` is False there and callers should use system memory instead.
    """
    free, total = torch.cuda.mem_get_info(device)
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    return int(free), int(total), not bool(getattr(props, "is_integrated", False))


# -- the budget ------------------------------------------------------------------------------------

class Budget:
    """A memory budget in bytes for the whole process (device memory for a CUDA budget).

    Args:
        spec: bytes (``600_000_000``), a string (``"600MB"``, ``"1.5GiB"``) or a callable returning
            either, called before every step so the budget can change at run time.

    Example::

        step = BudgetedStep(model, loss_fn, opt, budget=Budget("600MB"))
        limit = {"now": "800MB"}
        step = BudgetedStep(model, loss_fn, opt, budget=Budget(lambda: limit["now"]))
    """

    def __init__(self, spec: str | int | float | Callable[[], str | int | float]) -> None:
        if isinstance(spec, Budget):
            self._fn: Callable[[], str | int | float] | None = spec._fn
            self._fixed: int | None = spec._fixed
            self.description = spec.description
            return
        if callable(spec):
            self._fn, self._fixed = spec, None
            self.description = getattr(spec, "__name__", "callable")
        else:
            self._fn, self._fixed = None, parse_bytes(spec)
            self.description = format_bytes(self._fixed)

    @classmethod
    def system(cls, fraction: float = 0.9, *, device: torch.device | str | None = None,
               reserve: str | int = 0) -> Budget:
        """A budget read from the system before every step.

        On CPU: this process's RSS plus ``fraction`` of what it could still allocate (cgroup v2
        limit, else ``/proc/meminfo``, else psutil), minus ``reserve``. On a CUDA device: memory
        already allocated by torch plus ``fraction`` of ``torch.cuda.mem_get_info``'s free memory,
        or system memory on integrated GPUs where that figure misleads.
        """
        if not 0 < fraction <= 1:
            raise BudgetError(f"Budget.system fraction must be in (0, 1], e.g. 0.9, got {fraction!r}")
        reserve_b = parse_bytes(reserve)
        dev = torch.device(device) if device is not None else None

        def read() -> int:
            if dev is not None and dev.type == "cuda":
                free, _total, trusted = cuda_free_bytes(dev)
                if trusted:
                    held = torch.cuda.memory_reserved(dev)
                    return max(0, int(held + fraction * free) - reserve_b)
            mem = read_system_memory()
            return max(0, int(mem.process_rss + fraction * mem.available) - reserve_b)

        read.__name__ = f"system({fraction:g})"
        return cls(read)

    @property
    def is_dynamic(self) -> bool:
        """True when the budget is read again before every step."""
        return self._fn is not None

    def bytes(self) -> int:
        """The budget now, in bytes."""
        if self._fixed is not None:
            return self._fixed
        assert self._fn is not None
        return parse_bytes(self._fn())

    def __repr__(self) -> str:
        return f"Budget({self.description})"

