"""Packed records of saved tensors, and the handles that restore each saved view from them."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from .layout import PackedLayout

if TYPE_CHECKING:
    from .decode_buffers import DecodeBuffers
    from .pool import PagePool, PooledRecord


def _dequantize(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int, numel: int,
                dtype: torch.dtype, buffers: DecodeBuffers | None) -> torch.Tensor:
    """Decode into a buffer from ``buffers`` (CPU; see ``NOTE [ Decode buffers ]``), else into fresh memory."""
    if buffers is None or codes.device.type != "cpu":
        return torch.ops.daftrain.unpack_dequantize(codes, lo, scale, bits, group_size, numel, dtype)
    out = buffers.take(numel, dtype)
    torch.ops.daftrain.unpack_dequantize_into(out, codes, lo, scale, bits, group_size)
    return out


# NOTE [ Channel scaling ]
# Transformer activations have a few *outlier channels* (feature dims) whose values are 10-30x the
# rest, in every token. A group of the unified layout runs along the feature dim, so one outlier sets
# the range of its group and the other values of that token get steps far larger than themselves: at
# 2 bits, all-MiniLM-L6-v2's hidden states carry quantization noise of 1.6-3.6x their own energy.
# With ``CompressionConfig(channel_scaling=True)`` a record of a tensor whose innermost memory dim has
# ``C`` values is first divided, per channel, by a power of two ``2**e_c`` with ``e_c`` the exponent of
# that channel's largest magnitude, then quantized as usual; decoding multiplies back. Every channel's
# values then span at most [-1, 1], a group's step follows its own channels, and the noise on those
# hidden states drops to 0.7-0.8x (exact per-channel maxima instead of powers of two would give
# 0.4-0.7x, groups running along the tokens of one channel 0.3-0.5x, at the price of a transposed
# copy). Scaling by a power of two is exact (values that would fall below the
# dtype's normal range excepted, far under any step), so rounding stays unbiased and the layout and its
# kernels are unchanged; the record keeps ``C`` int8 exponents. The cost is one reduction and one
# multiply over the tensor when packing, and one multiply when decoding.
CHANNEL_SCALING_MIN_CHANNELS = 16
"""Channel scaling applies to tensors with at least this many channels (and at least two rows)."""

_EXPONENT_RANGE = {torch.float16: (-14, 15), torch.bfloat16: (-126, 127), torch.float32: (-126, 127)}


def scaling_channels(t: torch.Tensor, dense: bool) -> int | None:
    """The channel count ``C`` by which a record of ``t`` would be scaled: the size of its innermost
    memory dim (of its last dim when it is packed in logical order), or ``None`` when it has no such
    dim, fewer than ``CHANNEL_SCALING_MIN_CHANNELS`` channels or a single row."""
    if t.dim() < 2 or t.dtype not in _EXPONENT_RANGE:
        return None
    if dense:
        inner = [d for d in range(t.dim()) if t.stride(d) == 1 and t.size(d) > 1]
        if len(inner) != 1:
            return None
        channels = t.size(inner[0])
    else:
        channels = t.size(-1)
    if channels < CHANNEL_SCALING_MIN_CHANNELS or t.numel() < 2 * channels:
        return None
    return channels


def channel_exponents(flat: torch.Tensor, channels: int) -> torch.Tensor | None:
    """Per channel of ``flat`` viewed as ``(-1, channels)``, the int8 exponent ``e`` with
    ``max |x| < 2**e``, clamped so ``2**e`` and ``2**-e`` are normal in ``flat``'s dtype; ``None`` when a
    channel is not finite (the record is then kept exact anyway). See ``NOTE [ Channel scaling ]``."""
    amax = flat.view(-1, channels).abs().amax(0).float()
    if not bool(torch.isfinite(amax).all()):
        return None
    low, high = _EXPONENT_RANGE[flat.dtype]
    return torch.frexp(amax).exponent.clamp(low, high).to(torch.int8)


def channel_factors(exponents: torch.Tensor, sign: int, dtype: torch.dtype) -> torch.Tensor:
    """``2**(sign * e)`` per channel, exactly, in ``dtype``."""
    return torch.exp2(exponents.float() * sign).to(dtype)


class QuantizedRecord:
    """A float region quantized into the unified layout (``layout.py``); with ``channel_exp``, of its
    values divided per channel by ``2**channel_exp`` (``NOTE [ Channel scaling ]``)."""

    __slots__ = ("__weakref__", "channel_exp", "codes", "dtype", "layout", "lo", "scale")

    def __init__(
        self, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, layout: PackedLayout, dtype: torch.dtype,
        channel_exp: torch.Tensor | None = None,
    ) -> None:
        self.codes, self.lo, self.scale, self.layout, self.dtype = codes, lo, scale, layout, dtype
        self.channel_exp = channel_exp

    @property
    def nbytes(self) -> int:
        extra = self.channel_exp.nbytes if self.channel_exp is not None else 0
        return self.codes.nbytes + self.lo.nbytes + self.scale.nbytes + extra

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        ly = self.layout
        out = _dequantize(self.codes, self.lo, self.scale, ly.bits, ly.group_size, ly.numel, self.dtype, buffers)
        return _unscale(out, self.channel_exp)


def _unscale(out: torch.Tensor, channel_exp: torch.Tensor | None) -> torch.Tensor:
    if channel_exp is not None:
        out.view(-1, channel_exp.numel()).mul_(channel_factors(channel_exp, 1, out.dtype))
    return out


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

    __slots__ = ("__weakref__", "channel_exp", "dtype", "group_size", "numel", "pooled")

    def __init__(self, pooled: PooledRecord, group_size: int, numel: int, dtype: torch.dtype,
                 channel_exp: torch.Tensor | None = None) -> None:
        self.pooled, self.group_size, self.numel, self.dtype = pooled, group_size, numel, dtype
        self.channel_exp = channel_exp

    @property
    def nbytes(self) -> int:
        return self.pooled.nbytes + (self.channel_exp.nbytes if self.channel_exp is not None else 0)

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        with self.pooled.borrow() as (codes, lo, scale):
            bits = codes.shape[1] * 8 // self.group_size
            out = _dequantize(codes, lo, scale, bits, self.group_size, self.numel, self.dtype, buffers)
        return _unscale(out, self.channel_exp)


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
        return PagedQuantizedRecord(pooled, ly.group_size, ly.numel, record.dtype, record.channel_exp)
    if isinstance(record, BoolRecord):
        return PagedBoolRecord(pool.store((record.packed,), importance), record.numel)
    return record


def encode(flat: torch.Tensor, kind: str, bits: int, group_size: int, seed: int,
           channels: int | None = None) -> Record:
    """Pack one flat region: ``kind`` is ``"quantize"``, ``"lossless"`` (quantize only where the
    1-bit layout is exact, else keep) or ``"bool"``; ``channels`` scales a quantized region per channel
    first (``NOTE [ Channel scaling ]``). Runs on the caller's or the packer's thread."""
    if kind == "bool":
        return BoolRecord(torch.ops.daftrain.pack_bool(flat), flat.numel())
    if kind == "lossless":
        # See NOTE [ Constants are stored losslessly or kept ] in policy.py.
        mn, mx, min_pos = torch.ops.daftrain.group_minmax(flat, group_size).unbind(1)
        if not bool(((mn == mx) | ((mn == 0) & (min_pos == mx))).all()):
            return ExactRecord(flat, "constant")
        bits = 1
    exponents = channel_exponents(flat, channels) if kind == "quantize" and channels else None
    values = flat
    if exponents is not None:
        values = (flat.view(-1, channels) * channel_factors(exponents, -1, flat.dtype)).view(-1)
    codes, lo, scale = torch.ops.daftrain.quantize_pack(values, bits, group_size, seed)
    # NOTE [ Non-finite activations ]: a NaN or Inf anywhere in a group shows in that group's lo or
    # scale. Such a tensor is kept exact, so backward sees exactly what plain PyTorch would: values
    # are never silently replaced. The check reads num_groups values, not the tensor.
    if not bool(torch.isfinite(lo).all() and torch.isfinite(scale).all()):
        return ExactRecord(flat, "nonfinite")
    return QuantizedRecord(codes, lo, scale, PackedLayout(bits, group_size, flat.numel()), flat.dtype, exponents)


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
