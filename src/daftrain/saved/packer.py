"""Packing off the critical path: a worker thread packs in forward and unpacks ahead in backward.

NOTE [ Asynchronous packing ]
1. In forward the pack hook hands the region to one worker thread and returns at once; the next
   layers compute while the worker quantizes (PyTorch and numba release the GIL). Until its job
   finishes, the raw region stays referenced: ``pending_bytes`` counts it, so memory accounting never
   forgets a tensor that is waiting to be packed.
2. Results do not depend on thread timing: each record's seed is fixed in the pack hook, in the
   order autograd saves tensors, before the job is queued.
3. A tensor modified in place after autograd saved it would be read by the worker with its new
   values. The job checks the tensor's version counter before and after packing, and a change is
   raised at unpack time, as plain PyTorch raises for the same mistake. (The synchronous path packs
   at save time, so it always sees the saved values.)
4. In backward, unpacking record k queues the decode of record k - 1 (saved just before it, so
   usually needed next) on the worker; at most one decoded tensor waits ahead.
5. Every kernel call runs on the single worker thread, never on two threads at once: some numba
   threading layers are not re-entrant.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import InPlaceModificationError
from .decode_buffers import DecodeBuffers
from .records import PendingRecord, Record


class AsyncPacker:
    """One worker thread that packs records in forward and decodes them ahead in backward."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="daftrain-packer")
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self.peak_pending_bytes = 0
        self._records: dict[int, weakref.ref[PendingRecord]] = {}
        self._ahead: dict[int, Future[torch.Tensor]] = {}
        self._next_index = 0
        self._closed = False
        weakref.finalize(self, self._executor.shutdown, wait=False)

    @property
    def pending_bytes(self) -> int:
        """Raw bytes referenced by jobs not finished yet."""
        return self._pending_bytes

    def new_step(self) -> None:
        self._records.clear()
        self._ahead.clear()
        self.peak_pending_bytes = self._pending_bytes

    def submit(self, flat: torch.Tensor, encode: Callable[[torch.Tensor], Record]) -> PendingRecord:
        version = flat._version
        nbytes = flat.nbytes
        with self._lock:
            self._pending_bytes += nbytes
            self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)
        future = self._executor.submit(self._job, flat, version, encode)
        record = PendingRecord(future, self._next_index)
        self._records[self._next_index] = weakref.ref(record)
        self._next_index += 1
        return record

    def _job(self, flat: torch.Tensor, version: int, encode: Callable[[torch.Tensor], Record]) -> Record:
        try:
            if flat._version != version:
                raise InPlaceModificationError(_MODIFIED)
            record = encode(flat)
            if flat._version != version:
                raise InPlaceModificationError(_MODIFIED)
            return record
        finally:
            with self._lock:
                self._pending_bytes -= flat.nbytes

    def decode(self, record: Record | PendingRecord, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        """The decoded flat region of ``record``, and queue the decode of the one saved before it."""
        if not isinstance(record, PendingRecord):
            return self._executor.submit(record.decode, buffers).result()
        ahead = self._ahead.pop(record.index, None)
        flat = ahead.result() if ahead is not None else self._executor.submit(record.decode, buffers).result()
        previous = self._records.get(record.index - 1)
        target = previous() if previous is not None else None
        if target is not None and target.index not in self._ahead:
            self._ahead[target.index] = self._executor.submit(target.decode, buffers)
        return flat

    def drain(self) -> None:
        """Wait until every queued job has finished (after ``close``, they all have)."""
        if not self._closed:
            self._executor.submit(lambda: None).result()

    def close(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=True)


_MODIFIED = (
    "a tensor saved for backward was modified by an in-place operation before daftrain's packer read it; "
    "plain PyTorch raises for the same mistake. Make the operation out-of-place (or clone before "
    "modifying), or use CompressionConfig(asynchronous=False), which packs at save time."
)
