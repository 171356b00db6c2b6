"""Packed records of saved tensors, and the handles that restore each saved view from them."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..layout import PackedLayout

if TYPE_CHECKING:
    from ..pool.store import PagePool, PooledRecord
    from .decode_buffers import DecodeBuffers


def _dequantize(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int, numel: int,
                dtype: torch.dtype, buffers: DecodeBuffers | None) -> torch.Tensor:
    """Decode into a buffer from ``buffers`` (CPU; see ``NOTE [ Decode buffers ]``), else into fresh memory."""
    if buffers is None or codes.device.type != "cpu":
        return torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, group_size, numel, dtype)
    out = buffers.take(numel, dtype)
    torch.ops.daftrain.unpack_dequantize_into(out, codes, lo, scale, bits, group_size)
    return out


class QuantizedRecord:
    """A float region quantized into the unified layout (``layout.py``)."""

    __slots__ = ("__weakref__", "codes", "dtype", "layout", "lo", "scale")

    def __init__(
        self, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, layout: PackedLayout, dtype: torch.dtype
    ) -> None:
        self.codes, self.lo, self.scale, self.layout, self.dtype = codes, lo, scale, layout, dtype

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.lo.nbytes + self.scale.nbytes

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        ly = self.layout
        return _dequantize(self.codes, self.lo, self.scale, ly.bits, ly.group_size, ly.numel, self.dtype, buffers)


class BoolRecord:
    """A bool region stored 1 bit per value."""

    __slots__ = ("__weakref__", "numel", "packed")

    def __init__(self, packed: torch.Tensor, numel: int) -> None:
        self.packed, self.numel = packed, numel

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        return torch.ops.daftrain.unpack_bool(self.packed, self.numel)


class ExactRecord:
    """A region kept as it is (the lossless fallback, e.g. for non-finite values)."""

    __slots__ = ("__weakref__", "flat", "reason")

    def __init__(self, flat: torch.Tensor, reason: str) -> None:
        self.flat, self.reason = flat, reason

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        return self.flat


class PagedQuantizedRecord:
    """A quantized record whose ``(codes, lo, scale)`` live in a ``PagePool``'s pages.

    The pool may demote it to fewer bits (``demote_payload``) or spill it to a file when memory is
    tight; the bit-width is read back from the stored codes' shape, so decoding always matches what
    the pool holds. Its pages return to the pool when the record is freed (``PooledRecord.__del__``).
    """

    __slots__ = ("__weakref__", "dtype", "group_size", "numel", "pooled")

    def __init__(self, pooled: PooledRecord, group_size: int, numel: int, dtype: torch.dtype) -> None:
        self.pooled, self.group_size, self.numel, self.dtype = pooled, group_size, numel, dtype

    @property
    def nbytes(self) -> int:
        return self.pooled.nbytes

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        with self.pooled.borrow() as (codes, lo, scale):
            bits = codes.shape[1] * 8 // self.group_size
            return _dequantize(codes, lo, scale, bits, self.group_size, self.numel, self.dtype, buffers)


class PagedBoolRecord:
    """A bool record whose packed bits live in a ``PagePool``'s pages (never demoted: it is exact)."""

    __slots__ = ("__weakref__", "numel", "pooled")

    def __init__(self, pooled: PooledRecord, numel: int) -> None:
        self.pooled, self.numel = pooled, numel

    @property
    def nbytes(self) -> int:
        return self.pooled.nbytes

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        with self.pooled.borrow() as (packed,):
            return torch.ops.daftrain.unpack_bool(packed, self.numel)


Record = QuantizedRecord | BoolRecord | ExactRecord | PagedQuantizedRecord | PagedBoolRecord


def demote_payload(
    payload: tuple[torch.Tensor, ...], *, group_size: int, numel: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(codes, lo, scale)`` at ``bits`` -> the same values re-quantized at ``bits // 2``, or ``None``
    at 1 bit. Decoding is exact and re-quantizing rounds stochastically again, so a demoted record
    is still an unbiased estimate of the activation, with the variance of both roundings."""
    codes, lo, scale = payload
    bits = codes.shape[1] * 8 // group_size
    if bits <= 1:
        return None
    values = torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, group_size, numel, torch.float32)
    new = torch.ops.daftrain.quantize_pack(values, bits // 2, group_size, seed ^ (0x9E3779B9 * bits))
    if not bool(torch.isfinite(new[1]).all() and torch.isfinite(new[2]).all()):
        return None
    return new


def into_pool(record: Record, pool: PagePool, importance: float, seed: int) -> Record:
    """Move a freshly packed record's bytes into ``pool`` (exact records stay where they are)."""
    if isinstance(record, QuantizedRecord):
        ly = record.layout

        def demote(payload: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
            return demote_payload(payload, group_size=ly.group_size, numel=ly.numel, seed=seed)

        pooled = pool.store((record.codes, record.lo, record.scale), importance, demote=demote)
        return PagedQuantizedRecord(pooled, ly.group_size, ly.numel, record.dtype)
    if isinstance(record, BoolRecord):
        return PagedBoolRecord(pool.store((record.packed,), importance), record.numel)
    return record


def encode(flat: torch.Tensor, kind: str, bits: int, group_size: int, seed: int) -> Record:
    """Pack one flat region: ``kind`` is ``"quantize"``, ``"lossless"`` (quantize only where the
    1-bit layout is exact, else keep) or ``"bool"``. Runs on the caller's or the packer's thread."""
    if kind == "bool":
        return BoolRecord(torch.ops.daftrain.pack_bool(flat), flat.numel())
    if kind == "lossless":
        # See NOTE [ Constants are stored losslessly or kept ] in policy.py.
        mn, mx, min_pos = torch.ops.daftrain.group_minmax(flat, group_size).unbind(1)
        if not bool(((mn == mx) | ((mn == 0) & (min_pos == mx))).all()):
            return ExactRecord(flat, "constant")
        bits = 1
    codes, lo, scale = torch.ops.daftrain.quantize_pack(flat, bits, group_size, seed)
    # NOTE [ Non-finite activations ]: a NaN or Inf anywhere in a group shows in that group's lo or
    # scale. Such a tensor is kept exact, so backward sees exactly what plain PyTorch would: values
    # are never silently replaced. The check reads num_groups values, not the tensor.
    if not bool(torch.isfinite(lo).all() and torch.isfinite(scale).all()):
        return ExactRecord(flat, "nonfinite")
    return QuantizedRecord(codes, lo, scale, PackedLayout(bits, group_size, flat.numel()), flat.dtype)


class PendingRecord:
    """A record still being packed on the packer thread; ``result()`` waits for it."""

    __slots__ = ("__weakref__", "future", "index", "raw_nbytes")

    def __init__(self, future: Future[Record], index: int, raw_nbytes: int) -> None:
        self.future, self.index, self.raw_nbytes = future, index, raw_nbytes

    def result(self) -> Record:
        return self.future.result()

    @property
    def nbytes(self) -> int:
        return self.result().nbytes

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        return self.result().decode(buffers)


class SavedHandle:
    """What the pack hook returns for a packed tensor: a record plus the view to rebuild from it.

    ``dense`` handles index the record's flat region in memory order (``as_strided``), so one record
    serves every dense view of the same storage span; other views were packed from their contents
    in logical order and are copied back into a tensor with the original strides.
    """

    __slots__ = ("dense", "record", "size", "stride")

    def __init__(self, record: Record | PendingRecord, size: torch.Size, stride: tuple[int, ...], dense: bool) -> None:
        self.record, self.size, self.stride, self.dense = record, size, stride, dense

    def restore(self, flat: torch.Tensor) -> torch.Tensor:
        """The saved view, rebuilt from its record's decoded flat region."""
        if self.dense:
            return flat.as_strided(self.size, self.stride)
        out = torch.empty_strided(self.size, self.stride, dtype=flat.dtype, device=flat.device)
        return out.copy_(flat.view(self.size))
