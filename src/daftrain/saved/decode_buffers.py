"""Reusable host buffers for backward's decodes, so that decoding does not fault in fresh memory."""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

import numpy as np
import torch

from ..errors import InvalidArgumentError

__all__ = ["DecodeBuffers"]


# NOTE [ Decode buffers ]
# Every decode in backward needs a fresh multi-MB output. On CPU a fresh allocation of that size is
# a fresh ``mmap``, and faulting its 4 KiB pages in costs more than the decode kernel that fills them
# (ResNet-18, batch 128: decoding into fresh memory ran at 4-10x the reference, into reused memory at
# 13-26x). Backward frees each decoded tensor right after the node that used it, so the next decode
# of the same size can take over its memory:
#   1. a buffer is a numpy array; the tensor handed to autograd is ``torch.from_numpy`` of a *view*
#      of it, so the tensor's storage holds that view alive, and nothing else does;
#   2. when autograd frees the last tensor or view of that storage, the view dies and its
#      ``weakref.finalize`` returns the buffer to the free list. No tensor in use is ever handed out
#      again, whatever the consumer keeps (a user's hook holding a saved tensor keeps its buffer busy);
#   3. memory stays bounded: the free list keeps at most ``max_free_per_size`` buffers of each size;
#      ``release()`` (called when the next forward begins) drops them all, so free buffers never sit on
#      top of the forward pass's peak, and so does the release of the last saved tensor the context held
#      (``saves_held(False)``: backward has decoded everything), after which buffers that come back are
#      dropped until the next ``take``: none sits on top of the optimizer step either (a language model's
#      decoded logits, hundreds of MB, did).
# Buffers serve CPU decodes only: CUDA's caching allocator already reuses device memory.
class DecodeBuffers:
    """A free list of host buffers, keyed by byte size, for decoded saved tensors."""

    def __init__(self, max_free_per_size: int = 2) -> None:
        if isinstance(max_free_per_size, bool) or not isinstance(max_free_per_size, int) or max_free_per_size < 0:
            raise InvalidArgumentError(f"max_free_per_size must be a non-negative int, got {max_free_per_size!r}")
        self.max_free_per_size = max_free_per_size
        self._free: defaultdict[int, list[np.ndarray]] = defaultdict(list)
        self._lock = threading.Lock()
        self._keeping = True
        self.allocated = 0
        """Buffers allocated fresh (a take that found no free buffer of its size)."""
        self.reused = 0
        """Takes served from the free list."""

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous 1-D CPU tensor of ``numel`` values of ``dtype``."""
        nbytes = numel * dtype.itemsize
        with self._lock:
            self._keeping = True
            free = self._free.get(nbytes)
            buffer = free.pop() if free else None
            if buffer is None:
                self.allocated += 1
            else:
                self.reused += 1
        if buffer is None:
            buffer = np.empty(nbytes, dtype=np.uint8)
        view = buffer.view()
        weakref.finalize(view, self._give_back, buffer)
        return torch.from_numpy(view).view(dtype)

    def _give_back(self, buffer: np.ndarray) -> None:
        with self._lock:
            free = self._free[buffer.nbytes]
            if self._keeping and len(free) < self.max_free_per_size:
                free.append(buffer)

    def saves_held(self, held: bool) -> None:
        """Whether saved tensors are still held (``saved/live_saves.py``); once none is, free buffers are
        dropped (``NOTE [ Decode buffers ]``)."""
        if not held:
            with self._lock:
                self._keeping = False
                self._free.clear()

    @property
    def free_bytes(self) -> int:
        """Bytes held in the free list now."""
        with self._lock:
            return sum(b.nbytes for free in self._free.values() for b in free)

    def release(self) -> None:
        """Drop every free buffer (buffers in use return to the list when their tensors die)."""
        with self._lock:
            self._free.clear()
