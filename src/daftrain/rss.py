"""The process's resident memory (RSS): now, its peak, and resetting the peak.

Read from ``/proc/self/status`` (Linux), else ``getrusage`` or psutil. What a user sees in ``top`` and what
an OOM killer or a cgroup limit acts on; the meters in ``budget/memory.py`` and ``CompressionStats`` read
it from here.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

from .allocator import malloc_trim
from .errors import UnsupportedError

__all__ = ["current_rss_bytes", "peak_rss_bytes", "reset_peak_rss"]

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def _read_status_kb(field: str) -> int | None:
    """Return ``field`` (e.g. ``"VmHWM"``) from /proc/self/status in kB, or None."""
    try:
        text = _PROC_STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            parts = line.split()
            # Format: "VmHWM:	  123456 kB"
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1])
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes.

    Reads ``VmHWM`` from /proc/self/status (resettable by :func:`reset_peak_rss`),
    falling back to ``getrusage(RUSAGE_SELF).ru_maxrss`` (never resettable).
    """
    kb = _read_status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # NOTE [ ru_maxrss units ]
    # Linux reports ru_maxrss in kilobytes, macOS in bytes.
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def current_rss_bytes() -> int:
    """Current resident set size of this process in bytes (``VmRSS``)."""
    kb = _read_status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    try:
        import psutil  # optional fallback for non-Linux systems
    except ImportError as exc:  # pragma: no cover - Linux always has /proc
        raise UnsupportedError(
            "cannot read the current RSS: /proc/self/status is unavailable and psutil is not installed; "
            "install psutil (pip install psutil)"
        ) from exc
    return int(psutil.Process().memory_info().rss)  # pragma: no cover


def reset_peak_rss(*, trim: bool = True) -> bool:
    """Reset the kernel's peak-RSS counter (``VmHWM``) to the current RSS.

    With ``trim``, first returns freed heap memory to the OS with glibc ``malloc_trim(0)`` (if
    available) so the new baseline is as low as possible, then writes ``"5"``
    to /proc/self/clear_refs (Linux >= 4.0). Returns False where resetting is
    not possible (non-Linux, no permission); ``peak_rss_bytes`` is then the
    peak since process start.
    """
    # NOTE [ Why malloc_trim before clear_refs ]
    # glibc keeps freed memory in its arenas, so RSS (and thus the new VmHWM
    # baseline) would still include memory of earlier, already freed runs.
    # Trimming first makes consecutive measurements in one process comparable. It has a price: the
    # pages it returns are faulted in (and zeroed) again by the next allocations, so a training step
    # meters without it (NOTE [ Metering a planned step ] in budget/step.py).
    if trim:
        malloc_trim()
    try:
        with _PROC_CLEAR_REFS.open("w") as f:
            f.write("5")
    except OSError:
        return False
    return True
