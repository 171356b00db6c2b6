"""The saved tensors a context's graphs still hold, counted once for what waits on their release."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable

__all__ = ["LiveSaves"]


class LiveSaves:
    """Counts the live handles of saved tensors and tells each listener whether any is held when the count
    leaves zero or comes back to it (backward has released what the forward saved): the heap trimmer, which
    advises huge pages while a step uses the heap, and the decode buffers, worth keeping only until then."""

    __slots__ = ("_count", "_listeners", "_lock")

    def __init__(self, listeners: Iterable[Callable[[bool], None]]) -> None:
        self._listeners = tuple(listeners)
        self._count = 0
        self._lock = threading.Lock()

    def hold(self, saved: object) -> None:
        """Count ``saved`` (a saved tensor's handle) until it dies."""
        with self._lock:
            self._count += 1
            if self._count == 1:
                self._tell(True)
        weakref.finalize(saved, self._let_go)

    def _let_go(self) -> None:
        with self._lock:
            self._count -= 1
            if not self._count:
                self._tell(False)

    def _tell(self, held: bool) -> None:
        for listener in self._listeners:  # under the lock: listeners hear the changes in their order
            listener(held)
