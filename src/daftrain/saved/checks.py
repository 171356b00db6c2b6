"""Checks that decide whether a record keeps its packed form, read on a GPU without waiting for the device."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Protocol

import torch

__all__ = ["UNDECIDED_BYTES", "Checks", "DeviceVerdict", "Settling", "all_finite", "first_failed"]

Checks = tuple[tuple[torch.Tensor, str], ...]
"""0-d tensors that must all hold for a record's packed form to be kept, each with the reason its values
are kept as they are where it fails: a bool holds where it is true, a float where it is finite
(``all_finite``; ``NOTE [ Checks the host does not wait for ]``)."""

UNDECIDED_BYTES = 64 << 20
"""The values undecided records may hold beside their packed forms before the context waits for the
oldest verdict: the memory that lets the host run this far ahead of the device."""


# NOTE [ Checks the host does not wait for ]
# Some records are kept only where a check on their values holds: a quantized record only where every
# group's lo and scale are finite (``NOTE [ Non-finite activations ]`` in ``records.py``), a normalised one
# only where its statistics are too, a constant's 1-bit record only where every group is exact at 1 bit.
# On the CPU the answer is there once computed. On a GPU, reading it (``bool(t)``) waits for the device to
# finish all the work queued before it: the host no longer runs ahead, and every kernel launch of the pack
# path is paid in full, once per saved tensor. So on a GPU the checks are copied into pinned host memory
# behind an event (``DeviceVerdict``) and the record is undecided (``UndecidedRecord``): it holds both its
# packed form and the values it would keep instead until the verdict is on the host, then settles on one
# and drops the other. The context settles its undecided records as their events complete, at each pack,
# and all of them when the forward pass ends (one wait per pass, where the device has little queued); it
# waits for the oldest only while the values they hold exceed ``UNDECIDED_BYTES`` (the host far ahead of
# the device, whose queue stays full meanwhile). A record decoded before then waits for its own verdict.
# NOTE [ One sum for every value finite ]
# A NaN or an Inf among values makes their sum NaN or infinite, and so does a sum of finite values that
# overflows float32 (values of 1e33 and more, summed over 1e5 groups): such a record is kept as it is,
# which costs memory, never accuracy. The sums take one launch per tensor where ``isfinite(t).all()``
# takes several, and the pack path pays each launch once per saved tensor.
def all_finite(*tensors: torch.Tensor | None) -> torch.Tensor:
    """A check (float32, 0-d) that holds only where every value of ``tensors`` is finite
    (``NOTE [ One sum for every value finite ]``); ``None`` entries are skipped."""
    total: torch.Tensor | None = None
    for t in tensors:
        if t is not None:
            part = t.sum(dtype=torch.float32)
            total = part if total is None else total.add_(part)
    assert total is not None
    return total


def _holds(value: torch.Tensor | float | bool) -> bool:
    if isinstance(value, torch.Tensor):
        value = value.item()
    return value if isinstance(value, bool) else math.isfinite(value)


def first_failed(checks: Checks) -> str | None:
    """The reason of the first of ``checks`` (computed on the CPU) that fails, else ``None``; reads no
    further than that check."""
    return next((reason for value, reason in checks if not _holds(value)), None)


class DeviceVerdict:
    """``first_failed`` of checks computed on a CUDA device, read on the host once the device has computed
    them (``NOTE [ Checks the host does not wait for ]``)."""

    __slots__ = ("_event", "_reasons", "_values")

    def __init__(self, checks: Checks) -> None:
        self._reasons = tuple(reason for _, reason in checks)
        # one float per check, finite where it holds: a bool's reciprocal is 1 where true, Inf where false
        values = [v.float().reciprocal() if v.dtype == torch.bool else v.float() for v, _ in checks]
        on_device = values[0].reshape(1) if len(values) == 1 else torch.stack(values)
        self._values = torch.empty(on_device.shape, dtype=torch.float32, device="cpu", pin_memory=True)
        self._values.copy_(on_device, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(on_device.device))  # the checks' device, not the current one

    def ready(self) -> bool:
        """Whether the verdict is on the host (reading it would not wait)."""
        return self._event.query()

    def failed(self) -> str | None:
        """The first failing check's reason, else ``None``; waits for the device where it is not ready."""
        self._event.synchronize()
        return next((reason for value, reason in zip(self._values.tolist(), self._reasons, strict=True)
                     if not math.isfinite(value)), None)


class Undecided(Protocol):
    held_bytes: int

    def ready(self) -> bool: ...

    def settle(self) -> Any: ...


class Settling:
    """Undecided records in the order they were made, each with a tag; the settling methods return the
    ``(settled record, tag)`` of those they settle (``NOTE [ Checks the host does not wait for ]``)."""

    def __init__(self, limit_bytes: int = UNDECIDED_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._queue: deque[tuple[Undecided, Any, int]] = deque()
        self.held_bytes = 0

    def add(self, record: Undecided, tag: Any) -> list[tuple[Any, Any]]:
        """Queue ``record``, then settle what is ready."""
        self._queue.append((record, tag, record.held_bytes))
        self.held_bytes += record.held_bytes
        return self.settle_ready()

    def settle_ready(self) -> list[tuple[Any, Any]]:
        """Settle, oldest first, every record whose verdict is on the host, and wait for the oldest while the
        undecided ones hold more than ``limit_bytes``."""
        queue, settled = self._queue, []
        while queue and (self.held_bytes > self.limit_bytes or queue[0][0].ready()):
            settled.append(self._settle_oldest())
        return settled

    def settle_all(self) -> list[tuple[Any, Any]]:
        """Settle every queued record, waiting for the device where needed."""
        return [self._settle_oldest() for _ in range(len(self._queue))]

    def __len__(self) -> int:
        return len(self._queue)

    def _settle_oldest(self) -> tuple[Any, Any]:
        record, tag, held = self._queue.popleft()
        self.held_bytes -= held
        return record.settle(), tag
