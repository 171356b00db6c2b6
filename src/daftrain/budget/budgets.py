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
from ..rss import current_rss_bytes
from .memory import format_bytes

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
_SHARE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")
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
        share = _SHARE_RE.match(value)
        if share is not None:
            raise BudgetError(f"{value!r} is a share of memory, not a memory size (budget); for a share of what this "
                              f"process may use pass daftrain.Budget.system({float(share.group(1)) / 100:g})")
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
    if 0 < n < 1:  # truncated, it would be a budget of 0 bytes
        raise BudgetError(f"a memory size (budget) of {value!r} is less than one byte; sizes are in bytes (or a "
                          f"string like '600MB'): for a share of what this process may use pass "
                          f"daftrain.Budget.system({value})")
    return int(n)


# -- reading the system ------------------------------------------------------------------------------

@dataclass(frozen=True)
class SystemMemory:
    """What the system says about memory for this process, in bytes (``None`` where unknown).

    ``available`` is what the tightest source allows: the room under the tightest cgroup limit (v2
    or v1, on this process's cgroup or an ancestor) or ``MemAvailable`` (psutil where /proc/meminfo
    cannot be read), whichever is smaller; ``source`` says which one that was.
    """

    process_rss: int
    """Resident memory of this process now."""
    cgroup_max: int | None
    """The binding cgroup limit: v2 ``memory.max`` or v1 ``memory.limit_in_bytes`` of the cgroup (this
    process's or an ancestor) with the least room under its limit; ``None`` when no limit is set."""
    cgroup_current: int | None
    """That cgroup's usage (v2 ``memory.current``, v1 ``memory.usage_in_bytes``): everything charged to
    it, other processes in it and page cache included."""
    mem_available: int | None
    """``MemAvailable`` from /proc/meminfo (or psutil's ``available``)."""
    source: str
    """Which reading decided ``available``: ``"cgroup v2"``, ``"cgroup v1"``, ``"meminfo"``, ``"psutil"``
    or ``"none"``."""
    cgroup_path: Path | None = None
    """The directory of the cgroup whose limit is ``cgroup_max``."""

    @property
    def available(self) -> int:
        """Bytes this process could still allocate, by the tightest source."""
        candidates = []
        if self.cgroup_max is not None and self.cgroup_current is not None:
            candidates.append(max(0, self.cgroup_max - self.cgroup_current))
        if self.mem_available is not None:
            candidates.append(self.mem_available)
        if not candidates:
            raise UnsupportedError("no source of free memory could be read (no cgroup limit, /proc/meminfo or "
                                   "psutil): install psutil, or pass a fixed budget such as Budget('600MB')")
        return min(candidates)


# NOTE [ cgroup v1 and v2 ]
# A process has one cgroup per hierarchy, listed in /proc/self/cgroup as ``id:controllers:path``:
# ``0::path`` is the v2 (unified) hierarchy, ``N:memory:path`` (possibly ``memory`` among other
# controllers) the v1 memory hierarchy. Pure v2 systems mount the unified tree at /sys/fs/cgroup,
# hybrid ones at /sys/fs/cgroup/unified with v1 controllers at /sys/fs/cgroup/<controller>; the memory
# controller is attached to exactly one of the two. The files differ: v2 ``memory.max`` ("max" when
# unlimited) and ``memory.current``; v1 ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``, where
# "unlimited" is the largest page-aligned counter (9223372036854771712 on 64-bit kernels), so any
# value from 2**60 up is read as no limit. Both count page cache, so the room they leave is a lower
# bound: the kernel reclaims clean cache before it fails an allocation.
# A container without a cgroup namespace mounts its own cgroup as the hierarchy's root while
# /proc/self/cgroup still names the full path (/docker/<id>), which does not exist under the mount:
# the directory is the longest tail of that path that does. Limits on ancestors bind too (v1 with
# ``use_hierarchy``, the only mode recent kernels keep), so the walk goes up to the mount.
_V1_UNLIMITED = 2**60
_CGROUP_FILES = {"cgroup v2": ("memory.max", "memory.current"),
                 "cgroup v1": ("memory.limit_in_bytes", "memory.usage_in_bytes")}


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (unlimited) -> None


def _cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """This process's cgroup path in the v2 hierarchy and in the v1 memory hierarchy, where listed."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return {}
    paths = {}
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            paths["cgroup v2"] = path
        elif "memory" in controllers.split(","):
            paths["cgroup v1"] = path
    return paths


def _locate(mount: Path, path: str) -> Path | None:
    """The directory of cgroup ``path`` in a hierarchy mounted at ``mount``: the longest tail of the
    path that exists there (NOTE [ cgroup v1 and v2 ])."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    for i in range(len(parts) + 1):
        d = mount.joinpath(*parts[i:])
        if d.is_dir():
            return d
    return None


def _tightest_cgroup(cgroup_root: Path, proc_cgroup: Path) -> tuple[str, int, int, Path] | None:
    """``(version, limit, usage, directory)`` of the cgroup with the least room under its limit,
    among this process's cgroups and their ancestors in both hierarchies; ``None`` if none is limited."""
    mounts = {"cgroup v2": (cgroup_root, cgroup_root / "unified"), "cgroup v1": (cgroup_root / "memory",)}
    best: tuple[str, int, int, Path] | None = None
    for version, path in _cgroup_paths(proc_cgroup).items():
        limit_file, usage_file = _CGROUP_FILES[version]
        for mount in mounts[version]:
            d = _locate(mount, path)
            while d is not None:
                limit, usage = _read_int(d / limit_file), _read_int(d / usage_file)
                if version == "cgroup v1" and limit is not None and limit >= _V1_UNLIMITED:
                    limit = None
                if limit is not None and usage is not None and (best is None or limit - usage < best[1] - best[2]):
                    best = (version, limit, usage, d)
                d = d.parent if d != mount else None
    return best


def _meminfo_available(meminfo: Path) -> tuple[int | None, str]:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "meminfo"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None, "none"
    return int(psutil.virtual_memory().available), "psutil"


def read_system_memory(*, cgroup_root: str | Path = "/sys/fs/cgroup", proc: str | Path = "/proc") -> SystemMemory:
    """Read this process's cgroup limits (v2 ``memory.max``/``memory.current``, v1
    ``memory.limit_in_bytes``/``memory.usage_in_bytes``, ancestors included) and ``/proc/meminfo``'s
    ``MemAvailable`` (psutil as fallback); the tightest decides ``available`` and ``source``.

    ``cgroup_root`` is where the hierarchies are mounted (v2 there or at ``unified/``, v1 memory at
    ``memory/``) and ``proc`` the proc file system: tests point them at a fake tree.
    """
    # NOTE [ Why cgroup first ]
    # Inside a container /proc/meminfo and psutil report the *host's* memory, while the kernel
    # OOM-kills at the cgroup's limit. The cgroup reading is therefore the binding one when present;
    # we still take the minimum with MemAvailable in case the host itself is tighter.
    cgroup_root, proc = Path(cgroup_root), Path(proc)
    cg = _tightest_cgroup(cgroup_root, proc / "self" / "cgroup")
    avail, source = _meminfo_available(proc / "meminfo")
    if cg is None:
        return SystemMemory(current_rss_bytes(), None, None, avail, source)
    version, limit, usage, path = cg
    if avail is None or max(0, limit - usage) <= avail:
        source = version
    return SystemMemory(current_rss_bytes(), limit, usage, avail, source, path)


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

        On CPU: this process's RSS plus ``fraction`` of what it could still allocate, minus
        ``reserve``: the room under the tightest memory limit of its cgroup or an ancestor's (v2
        ``memory.max`` or v1 ``memory.limit_in_bytes``, less what the cgroup holds, other processes
        in it included), or ``/proc/meminfo``'s ``MemAvailable`` (else psutil) where that is
        smaller (``read_system_memory``). The budget therefore shrinks when another process in the
        same cgroup takes memory and grows when it frees it. On a CUDA device: memory already
        allocated by torch plus ``fraction`` of ``torch.cuda.mem_get_info``'s free memory, or system
        memory on integrated GPUs where that figure misleads.
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

