"""Saved tensors under ``min_numel`` values, staged together and packed as one record."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..config import CompressionConfig
from ..layout import PackedLayout
from .decode_buffers import DecodeBuffers
from .records import PendingRecord, Record

__all__ = ["BATCH_CAPACITY", "SMALL_BITS", "SMALL_SHARE", "BatchedSlice", "SmallTensors", "small_tensor_bits",
           "worth_batching"]

BATCH_CAPACITY = 1 << 16
"""Values one staging buffer holds before it is packed (256 KiB of float32)."""

SMALL_BITS = 8
"""The bits small tensors are packed together at, whatever the bits asked for."""

SMALL_SHARE = 0.01
"""Small tensors are kept exact while their bytes are at most this share of what the forward has saved so far."""


# NOTE [ Small tensors packed together ]
# Quantizing a tensor of a few hundred values on its own costs more (a reduction, a kernel call, a record)
# than it saves, so tensors under ``min_numel`` values are kept. A model whose activations are many such
# tensors then kept nearly all of them: a recurrent layer run step by step (``nn.GRU`` on the CPU, a cell in
# a Python loop, RWKV's or a state-space model's per-step states) saves a few per time step and layer. So a
# float32 tensor with a gradient under ``min_numel`` that no op rule treats is copied into a staging buffer
# shared with the small tensors saved after it, from a group boundary and padded to whole groups with its
# own first value: no group spans two tensors, so each keeps its own ranges and unbiased rounding. A full
# buffer, or the last one when the forward ends, is quantized as one record (one grid choice for the
# buffer). Backward decodes that record once, at the first unpack of one of its tensors, and holds it until
# each of its tensors has been read (a second backward through a retained graph decodes it again); a tensor
# read before its buffer was packed (backward inside the context) reads the exact staged copy.
#   * At ``SMALL_BITS`` (8), not the bits asked for: these are typically the per-step states of a recurrence,
#     thousands of tensors whose rounding errors compound over the steps, none of them large; at the bits
#     asked for they took state-space and RWKV models of the zoo far below their cosines, at 8 bits no model
#     moved (docs/saved.md, "Small tensors packed together"). So a float32 tensor is stored ~4x smaller, and a
#     half-precision one, which 8 bits would not halve, is kept.
#   * Only where small tensors matter: they are kept exact while their bytes are at most ``SMALL_SHARE`` of
#     all the forward has saved so far. A CNN's pooled features next to its convolutions are a sliver of the
#     bytes and the head's whole weight gradient: rounding them would save nothing and cost the most
#     sensitive gradient. A model whose saves are mostly small ones passes the share at its first saves.
#   * A tensor whose padded groups would not take at most half its bytes (under ~130 values) is kept.
#   * bits="auto": with a target in average bits they are packed the same way, outside the allocation (so
#     its bytes compare with fixed bits' as before); under ``packed_bytes`` or ``error_share`` they are kept,
#     as that budget and that variance estimate do not count them.
def small_tensor_bits(config: CompressionConfig) -> int | None:
    """``SMALL_BITS`` where this configuration packs small tensors together, else ``None`` (kept exact; ``NOTE
    [ Small tensors packed together ]``)."""
    if not config.batch_small:
        return None
    if isinstance(config.bits, int) or (config.auto and config.packed_bytes is None and config.error_share is None):
        return SMALL_BITS
    return None


@functools.lru_cache(maxsize=4096)
def worth_batching(numel: int, element_size: int, bits: int, group_size: int) -> bool:
    """Whether a small tensor's padded groups at ``bits`` take at most half its bytes (``NOTE [ Small tensors
    packed together ]``)."""
    groups = -(-numel // group_size)
    return 2 * PackedLayout(bits, group_size, groups * group_size).nbytes <= numel * element_size


# NOTE [ Staged values read back ]
# A member read before its buffer was packed (a backward inside the context) is a copy of its staged values,
# not a view of the staging buffer: a view shares the buffer's version counter, and a backward that builds a
# graph (``create_graph``: a gradient penalty, a Hessian-vector product) saves the restored tensor again, whose
# pack then copies it into that buffer, an in-place write on the tensor being packed, which PyTorch refuses.
# The copy is of a small tensor, freed when its backward node is.
class _Batch:
    """One staging buffer of small tensors, then the record it was packed into."""

    __slots__ = ("__weakref__", "decoded", "members", "record", "staging", "unpacks_left", "used")

    def __init__(self, device: torch.device) -> None:
        self.staging: torch.Tensor | None = torch.empty(BATCH_CAPACITY, dtype=torch.float32, device=device)
        self.used = 0
        self.members = 0
        self.record: Record | PendingRecord | None = None
        self.decoded: torch.Tensor | None = None
        self.unpacks_left = 0

    def seal(self, encode: Callable[[torch.Tensor], Record | PendingRecord]) -> None:
        """Pack what is staged into one record (once)."""
        if self.record is None and self.staging is not None:
            self.record = encode(self.staging[:self.used])
            self.staging, self.unpacks_left = None, self.members

    def values(self, offset: int, numel: int) -> torch.Tensor:
        """One member's float32 values: staged exactly, or from the record's decode (held until every member
        has been read)."""
        if self.record is None:  # NOTE [ Staged values read back ]
            assert self.staging is not None
            return self.staging[offset:offset + numel].clone()
        if self.decoded is None:
            self.decoded = self.record.decode()
        flat = self.decoded[offset:offset + numel]
        self.unpacks_left -= 1
        if self.unpacks_left <= 0:
            self.decoded, self.unpacks_left = None, self.members
        return flat


class BatchedSlice:
    """A small saved tensor's place in a shared record: what its handle decodes."""

    __slots__ = ("__weakref__", "batch", "numel", "offset")

    def __init__(self, batch: _Batch, offset: int, numel: int) -> None:
        self.batch, self.offset, self.numel = batch, offset, numel

    @property
    def nbytes(self) -> int:
        """Nothing of its own: the shared record is counted once, when it is packed."""
        return 0

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        """The tensor's values, flat (``buffers`` unused: the shared decode is held across unpacks, so it is never
        a reused buffer)."""
        return self.batch.values(self.offset, self.numel)


class SmallTensors:
    """The open staging buffer per device of one ``compress`` context (``NOTE [ Small tensors packed together ]``)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._open: dict[torch.device, _Batch] = {}

    def add(self, flat: torch.Tensor, encode: Callable[[torch.Tensor], Record | PendingRecord]) -> BatchedSlice:
        """Stage ``flat`` (float32, fewer than ``BATCH_CAPACITY`` values) and return its slice; a full buffer is
        packed with ``encode`` first."""
        numel = flat.numel()
        padded = -(-numel // self.group_size) * self.group_size
        batch = self._open.get(flat.device)
        if batch is None or batch.used + padded > BATCH_CAPACITY:
            if batch is not None:
                batch.seal(encode)
            batch = self._open[flat.device] = _Batch(flat.device)
        staging, offset = batch.staging, batch.used
        assert staging is not None
        staging[offset:offset + numel].copy_(flat)
        if padded > numel:  # the tensor's own first value: its range, and so its rounding, unchanged
            staging[offset + numel:offset + padded].copy_(flat[:1].expand(padded - numel))
        batch.used += padded
        batch.members += 1
        return BatchedSlice(batch, offset, numel)

    def seal(self, encode: Callable[[torch.Tensor], Record | PendingRecord]) -> None:
        """Pack every open buffer (the forward ended)."""
        batches, self._open = list(self._open.values()), {}
        for batch in batches:
            batch.seal(encode)
