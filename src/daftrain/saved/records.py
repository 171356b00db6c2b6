"""Packed records of saved tensors, and the handles that restore each saved view from them."""

from __future__ import annotations

import abc
import contextlib
import functools
import math
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Self

import torch

from ..errors import InPlaceModificationError, InvalidArgumentError
from ..kernels import ops as kernel_ops
from ..kernels.reference import columns_first
from ..layout import GRID_BITS
from .checks import Checks, DeviceVerdict, all_finite, first_failed

if TYPE_CHECKING:
    from ..pool import PagePool, PooledRecord
    from .decode_buffers import DecodeBuffers


Grids = Callable[[torch.Tensor, int], "torch.Tensor | None"]
"""The fitted grid (``NOTE [ Fitted grids ]`` in ``kernels/grids.py``) for the values a record quantizes at
some bits."""


def _dequantize(payload: tuple[torch.Tensor, ...], grid: torch.Tensor | None, group_size: int, numel: int,
                dtype: torch.dtype, buffers: DecodeBuffers | None, cols: int = 0) -> torch.Tensor:
    """Decode ``(codes, lo, scale)`` (on ``grid`` where it is for the codes' bits, see ``PackedRecord``) into a
    buffer from ``buffers`` (CPU; see ``NOTE [ Decode buffers ]``), else into fresh memory; with ``cols``, codes
    in groups down the columns of a ``[-1, cols]`` tensor (``ByColumns``), restored row after row."""
    codes, lo, scale = payload
    bits = bits_of(codes, group_size)
    if grid is not None and grid.numel() != 1 << bits:
        grid = None
    if buffers is not None and codes.device.type == "cpu":
        out = buffers.take(numel, dtype)
    elif cols:
        out = torch.empty(numel, dtype=dtype, device=codes.device)
    else:
        return kernel_ops.unpack_dequantize(codes, lo, scale, bits, group_size, numel, dtype, grid)
    if cols:
        kernel_ops.unpack_dequantize_columns_into(out, codes, lo, scale, cols, bits, group_size, grid)
    else:
        kernel_ops.unpack_dequantize_into(out, codes, lo, scale, bits, group_size, grid)
    return out


def bits_of(codes: torch.Tensor, group_size: int) -> int:
    """The bit-width of quantized ``codes`` ([num_groups, group_size * bits / 8] bytes, ``layout.py``)."""
    return codes.shape[1] * 8 // group_size


class InMemory:
    """A record's payload tensors, held as they are."""

    __slots__ = ("parts",)

    def __init__(self, parts: tuple[torch.Tensor, ...]) -> None:
        self.parts = parts

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def borrow(self) -> contextlib.AbstractContextManager[tuple[torch.Tensor, ...]]:
        return contextlib.nullcontext(self.parts)  # nothing to pin or release: no generator frame per decode


class Paged:
    """A record's payload in a ``PagePool``'s pages; the pool may demote or spill it (``PooledRecord``).
    Its pages return to the pool when the record is freed."""

    __slots__ = ("pooled",)

    def __init__(self, pooled: PooledRecord) -> None:
        self.pooled = pooled

    @property
    def nbytes(self) -> int:
        return self.pooled.nbytes

    def borrow(self) -> contextlib.AbstractContextManager[tuple[torch.Tensor, ...]]:
        return self.pooled.borrow()


Storage = InMemory | Paged


class PackedRecord:
    """One saved region packed in the unified layout (``layout.py``): quantized ``(codes, lo, scale)``
    or, for bool tensors, a bitmap ``(packed,)``; its bytes in memory or in pool pages (``storage``).

    A paged quantized record may be demoted by the pool to fewer bits: the bit-width is read from the
    stored codes at each decode, so decoding always matches what the storage holds. ``grid`` is the
    fitted grid its codes were made on (``NOTE [ Fitted grids ]`` in ``kernels/grids.py``), shared with
    the other records of its forward position and held by the context's ``GridChoice``, so not counted in
    its bytes; a demoted payload is on the uniform grid (the grid's size no longer matches its bits).
    """

    __slots__ = ("__weakref__", "dtype", "grid", "group_size", "is_bool", "numel", "storage")

    def __init__(self, storage: Storage, *, is_bool: bool, numel: int, dtype: torch.dtype,
                 group_size: int = 0, grid: torch.Tensor | None = None) -> None:
        self.storage, self.is_bool, self.numel = storage, is_bool, numel
        self.dtype, self.group_size, self.grid = dtype, group_size, grid

    @classmethod
    def quantized(cls, payload: tuple[torch.Tensor, torch.Tensor, torch.Tensor], numel: int, group_size: int,
                  dtype: torch.dtype, grid: torch.Tensor | None = None) -> PackedRecord:
        """The record of ``(codes, lo, scale)`` as ``quantize_pack`` wrote them (the op checked their layout)."""
        return cls(InMemory(payload), is_bool=False, numel=numel, dtype=dtype, group_size=group_size, grid=grid)

    @classmethod
    def bitmap(cls, packed: torch.Tensor, numel: int) -> PackedRecord:
        return cls(InMemory((packed,)), is_bool=True, numel=numel, dtype=torch.bool)

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        with self.storage.borrow() as parts:
            if self.is_bool:
                return kernel_ops.unpack_bool(parts[0], self.numel)
            return _dequantize(parts, self.grid, self.group_size, self.numel, self.dtype, buffers)

    def to_pool(self, pool: PagePool, importance: float, seed: int) -> PackedRecord:
        """The same record with its bytes copied into ``pool``'s pages (NOTE [ Importance of a record in
        the pool ] in ``hooks.py``); a quantized record can then be demoted by ``demote_payload``."""
        with self.storage.borrow() as parts:
            if self.is_bool:
                pooled = pool.store(parts, importance)
            else:
                demote = functools.partial(demote_payload, group_size=self.group_size, numel=self.numel, seed=seed,
                                           grid=self.grid)
                pooled = pool.store(parts, importance, demote=demote)
        return PackedRecord(Paged(pooled), is_bool=self.is_bool, numel=self.numel, dtype=self.dtype,
                            group_size=self.group_size, grid=self.grid)


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

    def to_pool(self, pool: PagePool, importance: float, seed: int) -> ExactRecord:
        return self  # exact records stay where they are




# NOTE [ Integer tensors in their narrowest type ]
# The integer tensors autograd saves are indices, which backward reads exactly: a max pool's argmax
# positions (int64, one per output value: in an ImageNet-style CNN as many bytes as the float output of the
# stem, the largest tensor it saves), a gather's or an embedding's indices, a router's choices. Their values
# span little (a pooling plane's positions), so they are stored losslessly as their offset from the
# tensor's minimum in the narrowest type that holds the span (``NARROW_TYPES``: uint8 below 2**8, int16
# offset by 2**15 below 2**16, int32 offset by 2**31 below 2**32), where that is narrower than the tensor's
# own type; else kept. The base (minimum plus offset) is a 0-d tensor on the tensor's device. On a GPU the
# span is not read back at once: the record is made as int16 and its check (the span fits) read later
# (``NOTE [ Checks the host does not wait for ]`` in ``checks.py``); on the CPU the span is read and the
# narrowest type chosen. Packing makes one transient of the tensor's size (its offsets).
NARROW_TYPES = ((torch.uint8, 0, 1 << 8), (torch.int16, 1 << 15, 1 << 16), (torch.int32, 1 << 31, 1 << 32))
"""(type, offset, span it holds) of integer records, narrowest first."""
NARROWABLE_DTYPES = (torch.int64, torch.int32, torch.int16)
"""Integer dtypes whose tensors are stored in a narrower type where their values allow."""


class IntegerRecord:
    """An integer tensor stored losslessly as offsets from a base in a narrower integer type (``NOTE [ Integer
    tensors in their narrowest type ]``)."""

    __slots__ = ("__weakref__", "base", "dtype", "values")
    is_bool = False

    def __init__(self, values: torch.Tensor, base: torch.Tensor, dtype: torch.dtype) -> None:
        self.values, self.base, self.dtype = values, base, dtype

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.base.nbytes

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        return self.values.to(self.dtype).add_(self.base)

    def to_pool(self, pool: PagePool, importance: float, seed: int) -> IntegerRecord:
        return self  # lossless and already small: stays where it is


def narrowed(flat: torch.Tensor) -> tuple[IntegerRecord | ExactRecord, Checks]:
    """``flat`` (a ``NARROWABLE_DTYPES`` dtype) as an ``IntegerRecord`` with the check that its span fits, or kept."""
    lo, hi = torch.aminmax(flat)
    span = hi.long() - lo.long()  # negative where an int64 span wraps around: kept
    narrower = [n for n in NARROW_TYPES if n[0].itemsize < flat.element_size()]
    if reads_wait(flat.device):
        narrow = next((n for n in narrower if n[0] == torch.int16), None)
        checks: Checks = () if narrow is None else ((((span >= 0) & (span < narrow[2])), "integer"),)
    else:
        fits = int(span)
        narrow, checks = next((n for n in narrower if 0 <= fits < n[2]), None), ()
    if narrow is None:
        return ExactRecord(flat, "integer"), ()
    base = lo + narrow[1]
    return IntegerRecord(flat.sub(base).to(narrow[0]), base, flat.dtype), checks


def demote_payload(
    payload: tuple[torch.Tensor, ...], *, group_size: int, numel: int, seed: int, grid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(codes, lo, scale)`` at ``bits`` (on ``grid`` if it is for those bits) -> the same values re-quantized
    at ``bits // 2`` on the uniform grid, or ``None`` at 1 bit. A pure function of the layout: decoding is
    exact and re-quantizing rounds stochastically again, so a demoted record is still an unbiased estimate
    of the activation, with the variance of both roundings."""
    bits = bits_of(payload[0], group_size)
    if bits <= 1:
        return None
    values = _dequantize(payload, grid, group_size, numel, torch.float32, None)
    new = kernel_ops.quantize_pack(values, bits // 2, group_size, seed ^ (0x9E3779B9 * bits))
    if not bool(torch.isfinite(new[1]).all() and torch.isfinite(new[2]).all()):
        return None
    return new


def encode(flat: torch.Tensor, kind: str, bits: int, group_size: int, seed: int,
           encoding: Encoding | None = None, grids: Grids | None = None,
           exact: torch.Tensor | None = None) -> Record | UndecidedRecord:
    """Pack one flat region: ``kind`` is ``"quantize"``, ``"lossless"`` (quantize only where the
    1-bit layout is exact, else keep), ``"bool"`` or ``"integer"`` (``NOTE [ Integer tensors in their
    narrowest type ]``); an op rule's ``encoding`` (``NOTE [ Op-aware encodings ]``) replaces a quantize;
    ``grids`` gives a quantized record its fitted grid; ``exact`` is what is kept where a check fails (``flat``
    by default; a float64 tensor packed from a float32 copy). Runs on the caller's or the packer's thread. On a
    GPU the record may be undecided (``NOTE [ Checks the host does not wait for ]`` in ``checks.py``)."""
    return decided(*pack_candidate(flat, kind, bits, group_size, seed, encoding, grids),
                   flat if exact is None else exact)


def pack_candidate(flat: torch.Tensor, kind: str, bits: int, group_size: int, seed: int,
                   encoding: Encoding | None = None, grids: Grids | None = None) -> tuple[Record, Checks]:
    """``encode``'s packed record of ``flat`` and the checks that must hold for it to be kept."""
    if encoding is not None and kind in ("quantize", "bool", "integer"):
        return encoding.candidate(flat, bits, group_size, seed, grids)
    if kind == "bool":
        return PackedRecord.bitmap(kernel_ops.pack_bool(flat), flat.numel()), ()
    if kind == "integer":
        return narrowed(flat)
    checks: Checks = ()
    if kind == "lossless":
        # See NOTE [ Constants are stored losslessly or kept ] in decide.py.
        mn, mx, min_pos = kernel_ops.group_minmax(flat, group_size).unbind(1)
        checks = ((((mn == mx) | ((mn == 0) & (min_pos == mx))).all(), "constant"),)
        if not reads_wait(flat.device) and first_failed(checks) is not None:  # read at once: skip the packing
            return ExactRecord(flat, "constant"), ()
        bits = 1
    grid = grids(flat, bits) if grids is not None and kind == "quantize" and bits in GRID_BITS else None
    record, finite = quantized(kernel_ops.quantize_pack(flat, bits, group_size, seed, grid), flat, group_size, grid)
    return record, checks + finite


def quantized(payload: tuple[torch.Tensor, torch.Tensor, torch.Tensor], values: torch.Tensor, group_size: int,
              grid: torch.Tensor | None) -> tuple[PackedRecord, Checks]:
    """The record of ``payload`` (``values`` quantized), and the check that it holds finite values."""
    _, lo, scale = payload
    # NOTE [ Non-finite activations ]: a NaN or Inf anywhere in a group shows in that group's lo or
    # scale. Such a tensor is kept exact, so backward sees exactly what plain PyTorch would: values
    # are never silently replaced. The check reads num_groups values, not the tensor (``NOTE [ One sum for
    # every value finite ]`` in ``checks.py``).
    record = PackedRecord.quantized(payload, values.numel(), group_size, values.dtype, grid)
    return record, ((all_finite(lo, scale), "nonfinite"),)


def reads_wait(device: torch.device) -> bool:
    """Whether reading a value computed on ``device`` waits for it (checks there are read later)."""
    return device.type == "cuda"


def decided(record: Record, checks: Checks, flat: torch.Tensor) -> Record | UndecidedRecord:
    """``record`` where every one of ``checks`` holds, else ``flat`` kept with the first failing check's
    reason; on a GPU an ``UndecidedRecord`` of the two (``NOTE [ Checks the host does not wait for ]``)."""
    if not checks:
        return record
    if reads_wait(checks[0][0].device):
        return UndecidedRecord(record, DeviceVerdict(checks), flat)
    reason = first_failed(checks)
    return record if reason is None else ExactRecord(flat, reason)


class UndecidedRecord:
    """A packed record and the values it would keep instead, until a ``DeviceVerdict`` on them is read
    (``NOTE [ Checks the host does not wait for ]``); ``settle()`` gives the record that stays."""

    __slots__ = ("__weakref__", "_flat", "_record", "_settled", "_verdict")

    def __init__(self, record: Record, verdict: DeviceVerdict, flat: torch.Tensor) -> None:
        self._record: Record | None = record
        self._verdict: DeviceVerdict | None = verdict
        self._flat: torch.Tensor | None = flat
        self._settled: Record | None = None

    @property
    def held_bytes(self) -> int:
        """The bytes of the values held beside the packed record until it settles."""
        return 0 if self._flat is None else self._flat.nbytes

    def ready(self) -> bool:
        """Whether settling would not wait for the device."""
        return self._verdict is None or self._verdict.ready()

    def settle(self) -> Record:
        """The packed record, or the values kept as an ``ExactRecord``; waits for the verdict if needed."""
        if self._settled is None:
            assert self._verdict is not None and self._record is not None and self._flat is not None
            reason = self._verdict.failed()
            self._settled = self._record if reason is None else ExactRecord(self._flat, reason)
            self._record = self._verdict = self._flat = None
        return self._settled

    @property
    def nbytes(self) -> int:
        return self.settle().nbytes

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        return self.settle().decode(buffers)

    def to_pool(self, pool: PagePool, importance: float, seed: int) -> Record | UndecidedRecord:
        if self._settled is not None:
            return self._settled.to_pool(pool, importance, seed)
        assert self._verdict is not None and self._record is not None and self._flat is not None
        return UndecidedRecord(self._record.to_pool(pool, importance, seed), self._verdict, self._flat)


class PendingRecord:
    """A record still being packed on the packer thread; ``result()`` waits for it."""

    __slots__ = ("__weakref__", "future", "index")

    def __init__(self, future: Future[Record], index: int) -> None:
        self.future, self.index = future, index

    def result(self) -> Record:
        return self.future.result()

    @property
    def nbytes(self) -> int:
        return self.result().nbytes

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        return self.result().decode(buffers)


def check_version(tensor: torch.Tensor, saved_version: int) -> None:
    """Raise what plain PyTorch raises when a tensor saved for backward was modified in place since."""
    if tensor._version != saved_version:
        raise InPlaceModificationError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected version "
            f"{saved_version} instead. Hint: the tensor was modified in place after autograd saved it (under a "
            "daftrain saved-tensor hook); compute on a clone, or do the in-place operation out of place."
        )


class KeptTensor:
    """What the pack hook returns for a tensor kept as it is: the tensor (detached: see NOTE [ Kept tensors
    are detached ]) and its version when saved, so that unpacking detects an in-place modification."""

    __slots__ = ("__weakref__", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor, self.version = tensor, version

    def restore(self) -> torch.Tensor:
        # The detached tensor shares the original's version counter.
        check_version(self.tensor, self.version)
        return self.tensor


# NOTE [ Expanded views ]
# A saved tensor with a stride of 0 in some dimension of size > 1 (``expand``/``expand_as``, a key/value
# head broadcast over query heads, a mask broadcast over channels) repeats its elements. It is packed
# as its compact form (index 0 along each such dimension) and restored as that form expanded back to
# the saved size: stored at its real size, and restored as a view with the same strides. A view whose
# other strides make elements overlap (a hand-made ``as_strided``) cannot be written element by
# element; it is restored as a contiguous tensor with the same values.
def compact_expanded(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its broadcast dimensions (size 1 where ``t`` has stride 0); ``t`` if it has none."""
    index = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None)
                  for size, stride in zip(t.shape, t.stride(), strict=True))
    return t[index]


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` consecutive elements of its storage (any dim order)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1),
                               key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def is_expanded(t: torch.Tensor) -> bool:
    strides = t.stride()
    return 0 in strides and any(stride == 0 and size > 1 for size, stride in zip(t.shape, strides, strict=True))


def stored_numel(t: torch.Tensor) -> int:
    """The number of values ``t`` is stored as: its compact form's (``compact_expanded``)."""
    return math.prod(1 if stride == 0 else size for size, stride in zip(t.shape, t.stride(), strict=True))


class SavedHandle:
    """What the pack hook returns for a packed tensor: a record plus the view to rebuild from it.

    ``dense`` handles index the record's flat region in memory order (``as_strided``), so one record
    serves every dense view of the same storage span; other views were packed from their contents
    in logical order and are copied back into a tensor with the original strides. ``expand_to`` is the
    saved size of an expanded view packed in its compact form (NOTE [ Expanded views ]). ``source``
    (a weak reference) and ``version`` let unpacking detect an in-place modification of the saved
    tensor, as plain PyTorch does.
    """

    __slots__ = ("__weakref__", "dense", "dtype", "expand_to", "overlapping", "record", "size", "source", "stride",
                 "version")

    def __init__(self, record: Record | PendingRecord, saved: torch.Tensor, dense: bool,
                 source: torch.Tensor, expand_to: torch.Size | None = None) -> None:
        self.record, self.size, self.stride, self.dense = record, saved.shape, saved.stride(), dense
        self.dtype = saved.dtype  # a float64 tensor's record holds float32 (NOTE [ Double precision stored through
        # float32 ] in hooks.py)
        self.overlapping = not dense and torch._debug_has_internal_overlap(saved) == 1
        self.source, self.version, self.expand_to = weakref.ref(source), source._version, expand_to

    def check_version(self) -> None:
        """Raise if the saved tensor, still alive, was modified in place since it was saved."""
        source = self.source()
        if source is not None:
            check_version(source, self.version)

    def restore(self, flat: torch.Tensor) -> torch.Tensor:
        """The saved view, rebuilt from its record's decoded flat region."""
        if flat.dtype != self.dtype:
            flat = flat.to(self.dtype)
        if self.dense:
            out = flat.as_strided(self.size, self.stride)
        elif self.overlapping:
            out = flat.view(self.size)
        else:
            out = torch.empty_strided(self.size, self.stride, dtype=flat.dtype, device=flat.device)
            out.copy_(flat.view(self.size))
        return out if self.expand_to is None else out.expand(self.expand_to)


_CONSTANT_ROW_RSTD = 1e18
"""1/std at or above which a row counts as constant (a variance below ~1e-36)."""


# NOTE [ Op-aware encodings ]
# Three encodings store what an op's backward consumes rather than the saved values as they are (the op
# rules that choose them are in ``op_rules.py``):
#   1. ``Normalized``: the input of a normalisation. Backward re-normalises it with the op's exact
#      statistics, so a rounding error ``e`` reaches it as ``e * rstd``: a row (or channel) whose own
#      spread is small next to its quantization group's range gets its error multiplied by up to
#      ``1 / spread``. The record stores ``x_hat = (x - mean) / std`` quantized, with ``mean`` and
#      ``std`` per row (per channel for BatchNorm) exact, and restores ``x_hat_q * std + mean``:
#      backward re-normalises that back to ``x_hat_q``, whose error is that of a unit-spread row.
#      ``x_hat_q`` is first given its row's exact mean and spread (``NOTE [ Normalised values keep their
#      statistics ]``).
#   2. ``ClipMask``: the input (or, in place, the output) of a clip whose backward reads only which
#      side of its bounds each value lies on (hardtanh, relu6, clamp with number bounds, threshold).
#      The record is that mask, bit-packed, exactly; restoring writes one value strictly inside the
#      bounds where the mask is set and one outside elsewhere, so backward's comparisons give the
#      exact mask. The record is keyed apart from the values other ops save of the same storage. The
#      input of an elementwise maximum or minimum against a 0-d tensor (``torch.max(x, c)``, an
#      attention mask's floor) is read only through ``x > c``, ``x == c`` (a tie splits the gradient
#      in halves) and ``x < c``: it stores the mask and the ties, 2 bits per value, and restores
#      ``c`` at the ties and the neighbouring float on either side elsewhere.
#   3. ``Derivative``: the input of GELU or SiLU, stored as the derivative its backward multiplies by
#      (``NOTE [ Activations stored as their derivative ]``).
#   4. ``Probabilities``: a softmax's output, quantized as it is and restored with each row's sum 1
#      (``NOTE [ Probabilities keep their sums ]``).
class _Encoding(abc.ABC):
    """What an op-aware encoding shares: ``encode`` decides on its ``candidate``."""

    @abc.abstractmethod
    def candidate(self, flat: torch.Tensor, bits: int, group_size: int, seed: int,
                  grids: Grids | None = None) -> tuple[Record, Checks]:
        """The record storing ``flat`` this way, and the checks that must hold for it to be kept."""

    def encode(self, flat: torch.Tensor, bits: int, group_size: int, seed: int,
               grids: Grids | None = None) -> Record | UndecidedRecord:
        """``flat`` stored this way (``encode``'s record, of ``candidate``)."""
        return decided(*self.candidate(flat, bits, group_size, seed, grids), flat)


@dataclass(frozen=True)
class Normalized(_Encoding):
    """Store ``x`` as ``(x - mean) / std`` over ``reduce`` of ``x.view(view)``, ``mean``/``std`` exact;
    without ``center`` ``std`` is the root mean square. The rules build 3-D views with ``reduce`` ``(2,)``
    (rows), ``(0, 2)`` (channels) or ``(1,)`` (``F.normalize``'s vectors); ``in_memory_order`` any."""

    view: tuple[int, ...]
    reduce: tuple[int, ...]
    center: bool = True
    cols: int = 0
    """Where nonzero, x_hat is stored in groups down its ``cols`` columns (``NOTE [ Normalised values down the
    columns ]``)."""

    # NOTE [ Normalising only where groups straddle statistics ]
    # Normalising pays where a quantization group holds values of several rows (channels): their spreads
    # differ, and the group's range is set by the widest. Where every group lies inside one row, x_hat is
    # the group's values times one positive number plus another, so the group's codes, and its error
    # relative to the row's own spread, are those of x itself (the same noise draws, up to float
    # rounding); a normalisation pass then buys nothing and costs more than the quantization it feeds (a
    # read of x for the statistics, a write and a read of x_hat, another pass to restore). Such a tensor
    # (a batch norm over planes of 256 values or a multiple of it, a layer norm over rows of 768) is
    # quantized as it is, in memory order.
    def groups_within_rows(self, group_size: int) -> bool:
        """Whether every run of ``group_size`` values in memory order lies inside one row (one set of values
        sharing a mean and std): the trailing run of reduced dims of ``view`` is a multiple of it."""
        run = 1
        for dim in range(len(self.view) - 1, -1, -1):
            if self.view[dim] == 1:
                continue
            if dim not in self.reduce:
                break
            run *= self.view[dim]
        return run % group_size == 0

    def candidate(self, flat: torch.Tensor, bits: int, group_size: int, seed: int,
                  grids: Grids | None = None) -> tuple[NormalizedRecord | PackedRecord, Checks]:
        if not self.cols and self.groups_within_rows(group_size):
            return pack_candidate(flat, "quantize", bits, group_size, seed, grids=grids)
        return self.normalized_candidate(flat, bits, group_size, seed, grids)

    # NOTE [ Normalised values down the columns ]
    # A normalisation over the rows of a ``[tokens, features]`` input (a layer or RMS norm) is where a
    # pretrained transformer's outlier features are: a few features tens of times larger than the rest in
    # every token, in x and so in x_hat, set the range of every group along the rows that holds one, and the
    # other features are rounded in their steps (on a pretrained MiniLM its last LayerNorm's input carried
    # most of the 4-bit gradient error: docs/zoo.md). Groups down the columns hold one feature over
    # ``group_size`` tokens (``NOTE [ Groups down the columns ]`` in ``grouping.py``); normalising first
    # still pays there, since a column's group holds values of many rows. So x_hat is stored down its
    # columns where the input's ranges say they are clearly narrower (``ColumnChoice``, as for a
    # derivative, chosen on the input), same bytes (the MiniLM before and after: docs/zoo.md).
    def normalized_candidate(self, flat: torch.Tensor, bits: int, group_size: int, seed: int,
                             grids: Grids | None = None) -> tuple[NormalizedRecord, Checks]:
        """``candidate`` as x_hat with exact statistics, wherever the groups lie."""
        with torch.no_grad():
            x_hat, mean, std = self._normalize(flat.view(self.view).float())
            values = x_hat.reshape(-1)
            inner, checks = (ByColumns(self.cols, group_size).candidate(values, bits, group_size, seed, grids)
                             if self.cols else pack_candidate(values, "quantize", bits, group_size, seed, grids=grids))
            finite = all_finite(std, mean)
        record = NormalizedRecord(inner, mean, std, self.view, self.reduce, flat.dtype)
        return record, (*checks, (finite, "nonfinite"))

    def down_columns(self, cols: int) -> Normalized | None:
        """This encoding with x_hat stored down ``cols`` columns, where its statistics are those of rows of
        ``cols`` values (``NOTE [ Normalised values down the columns ]``); else None."""
        rows = self.reduce == (2,) and self.view[1] == 1 and self.view[2] == cols
        return replace(self, cols=cols) if rows else None

    # NOTE [ Normalised records in memory order ]
    # A dense tensor whose dims are permuted in memory (channels_last, a transpose) is packed as its
    # memory span, in memory order (``NOTE [ One record per storage span ]`` in ``hooks.py``), while the
    # rule builds ``view`` and ``reduce`` from its logical shape. The statistics only say which values
    # share a mean and std, and that holds in any order: each logical dim is placed in the view dims that
    # hold it (split where it spans two, as a group norm's channels span its groups and the channels in a
    # group), each part tagged reduced or kept and given its stride; in memory order (strides descending)
    # adjacent parts of the same tag merge, and the runs are the view, the reduced runs ``reduce``. A
    # channels_last batch norm's (N, C, H, W), tagged R K R R, is R R R K in memory: ``(N*H*W, C, 1)``
    # over ``(0, 2)``; a layer norm over the last dim of a transposed (B, C, T) tensor is K R K:
    # ``(B, C, T)`` over ``(1,)``; a channels_last group norm's (N, G, C/G, H, W) is K R K R in memory:
    # ``(N, H*W, G, C/G)`` over ``(1, 3)``. Only a logical dim that straddles view dims unevenly (never
    # built by a rule) has no form.
    def in_memory_order(self, t: torch.Tensor) -> Normalized | None:
        """This encoding of ``t`` (built for its logical order) for ``t``'s memory order, ``t`` dense;
        ``None`` where it has no form there (``NOTE [ Normalised records in memory order ]``)."""
        if math.prod(self.view) != t.numel():
            return None
        parts: list[tuple[int, int, bool]] = []  # (stride, size, reduced)
        place, left = 0, self.view[0]
        for size, stride in zip(t.shape, t.stride(), strict=True):
            split: list[tuple[int, int]] = []  # (view dim, size) of this dim's parts, outermost first
            while size > 1:
                while left == 1:
                    place += 1
                    left = self.view[place]
                taken = math.gcd(size, left)
                if taken == 1 or (taken != size and taken != left):
                    return None
                split.append((place, taken))
                size, left = size // taken, left // taken
            for view_dim, part in reversed(split):
                parts.append((stride, part, view_dim in self.reduce))
                stride *= part
        runs: list[list[Any]] = []  # [reduced, size] of adjacent parts merged, outermost first
        for _, size, reduced in sorted(parts, key=lambda p: -p[0]):
            if runs and runs[-1][0] == reduced:
                runs[-1][1] *= size
            else:
                runs.append([reduced, size])
        pattern = tuple(reduced for reduced, _ in runs)
        sizes = tuple(size for _, size in runs)
        if True not in pattern:
            return None
        # the three-dim layouts PyTorch's fused norms take (NOTE [ Normalising with PyTorch's own kernels ])
        if pattern == (True,):
            return Normalized((1, 1, sizes[0]), (2,), self.center)
        if pattern == (False, True):
            return Normalized((sizes[0], 1, sizes[1]), (2,), self.center)
        if pattern == (True, False):
            return Normalized((sizes[0], sizes[1], 1), (0, 2), self.center)
        return Normalized(sizes, tuple(i for i, reduced in enumerate(pattern) if reduced), self.center)

    # NOTE [ Normalising with PyTorch's own kernels ]
    # The views the normalization rule builds are 3-D with the statistics over the last dimension (layer,
    # group, instance and RMS norms) or over the first and last (batch norm). ``native_layer_norm`` and
    # ``native_batch_norm`` give x_hat, the mean and 1/std from one pass for the statistics and one for the
    # output, where computing them with separate reductions and elementwise ops read the input several
    # times more and made temporaries of its size: more than the quantization the encoding feeds. Their
    # ``eps`` is float32's smallest normal number, which changes no variance above ~1e-30 and keeps the
    # 1/std of a constant row finite. A constant row (a class token of zeros under LayerNorm with eps 1e-12:
    # rstd 1e6 in backward) must restore exactly: its mean is set to one of its values, its std to 0 and
    # its x_hat to 0, whatever rounding the kernel's mean had.
    def _normalize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        return normalized_over(x, self.reduce, self.center)


def normalized_over(x: torch.Tensor, dims: tuple[int, ...], center: bool, *,
                    branch_free: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(x_hat, mean, std)`` of ``x`` over ``dims`` (``mean`` ``None`` without ``center``, ``std`` then the
    root mean square; ``NOTE [ Normalising with PyTorch's own kernels ]``). With ``branch_free`` no value
    is read back, as inside a traced graph (``NOTE [ Normalised values in a compiled graph ]``), nor on a GPU,
    where a read waits for the device (``NOTE [ Checks the host does not wait for ]`` in ``checks.py``)."""
    if not center:  # an RMS norm: the norm in one pass
        count = math.prod(x.shape[dim] for dim in dims)
        std = torch.linalg.vector_norm(x, 2, dims, keepdim=True).div_(torch.sym_sqrt(count))
        return x / torch.where(std > 0, std, 1.0), None, std  # x may be the saved tensor: not in place
    tiny = torch.finfo(torch.float32).tiny
    if x.dim() == 3 and dims == (2,):
        out, mean, rstd = torch.native_layer_norm(x.reshape(-1, x.shape[2]), (x.shape[2],), None, None, tiny)
    elif x.dim() == 3 and dims == (0, 2):  # per channel of (N, C, L)
        out, mean, rstd = torch.native_batch_norm(x, None, None, None, None, True, 0.0, tiny)
    else:  # a permuted tensor's statistics in memory order: no fused kernel takes them
        var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)
        rstd = var.add_(tiny).rsqrt_()
        out = (x - mean).mul_(rstd)
    stats_shape = tuple(1 if dim in dims else size for dim, size in enumerate(x.shape))
    out, mean, rstd = out.view(x.shape), mean.reshape(stats_shape), rstd.reshape(stats_shape)
    constant = rstd >= _CONSTANT_ROW_RSTD
    if branch_free or reads_wait(x.device) or bool(constant.any()):
        first = x
        for dim in dims:
            first = first.narrow(dim, 0, 1)
        mean = torch.where(constant, first, mean)
        out.masked_fill_(constant, 0.0)
    return out, mean, torch.where(constant, 0.0, rstd.reciprocal())


# NOTE [ Normalised values keep their statistics ]
# A normalisation's backward, ``dx = w * rstd * (dy - mean(dy) - x_hat * mean(dy * x_hat))`` per row (an RMS
# norm or ``F.normalize`` without the mean), is ``dy`` with its components along the constant row and along
# x_hat taken out: it sums to zero over the row and is orthogonal to x_hat, whatever ``dy``. Those
# identities need the x_hat backward reads to have mean 0 and mean square 1 over each row. Rounded values
# do not: their row mean is off by the mean of the rounding errors and their mean square by their
# correlation with x_hat. Where ``dy`` lies mostly along 1 and x_hat (a batch norm over few effective
# samples feeding a pooled head: a per-channel gradient that the affine part explains), the true ``dx``
# is a small remainder and those two small offsets, multiplied by the large components they should have
# cancelled, are most of what backward returns; a bias upstream, whose gradient is the row sum of ``dx``
# (exactly zero through such a norm), gets a gradient of rounding alone. So the record restores x_hat_q
# shifted and scaled to mean 0 and mean square 1 over each row before applying the exact statistics:
# the identities hold exactly again and what rounding leaves lies inside the remainder backward keeps.
# It costs two reductions of the decoded values (``restandardized``) and no stored byte. Rows whose decoded values
# are all equal keep the plain restore (no spread to scale to); constant rows restore exactly either way
# (``std`` is 0). The traced unpack does the same (``unpack_traced`` in ``compiled.py``).
def restandardized(values: torch.Tensor, mean: torch.Tensor | None, std: torch.Tensor,
                   dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scale, shift)`` per row of the rounded x_hat ``values`` (statistics over ``dims``) that restore
    ``values * scale + shift`` with each row's exact ``mean`` (an RMS: ``None``, and no shift) and ``std``
    (``NOTE [ Normalised values keep their statistics ]``). One pass for each sum, the innermost reduced
    dim first (``var_mean`` over a batch norm's channels is ten times slower); the moments of x_hat (mean
    near 0, mean square near 1) take the difference ``E[v^2] - E[v]^2`` without cancellation."""
    inner, *outer = sorted(dims, reverse=True)
    count = math.prod(values.shape[dim] for dim in dims)
    square = torch.linalg.vector_norm(values, 2, (inner,), keepdim=True).square()
    spread = (square.sum(outer, keepdim=True) if outer else square) / count
    if mean is None:
        return std * torch.where(spread > 0, spread.rsqrt(), 1.0), None
    total = values.sum(inner, keepdim=True)
    centre = (total.sum(outer, keepdim=True) if outer else total) / count
    spread = (spread - centre.square()).clamp(min=0.0)
    scale = std * torch.where(spread > 0, spread.rsqrt(), 1.0)
    return scale, mean - centre * scale


class NormalizedRecord:
    """A normalisation's input stored as ``x_hat`` (packed) plus exact ``mean``/``std`` over ``reduce`` of
    ``view``; see ``NOTE [ Op-aware encodings ]``."""

    __slots__ = ("__weakref__", "dtype", "inner", "mean", "reduce", "std", "view")
    is_bool = False

    def __init__(self, inner: PackedRecord | ByColumnsRecord, mean: torch.Tensor | None, std: torch.Tensor,
                 view: tuple[int, ...], reduce: tuple[int, ...], dtype: torch.dtype) -> None:
        self.inner, self.mean, self.std, self.view, self.reduce, self.dtype = inner, mean, std, view, reduce, dtype

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.std.nbytes + (self.mean.nbytes if self.mean is not None else 0)

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        flat = self.inner.decode(buffers)  # float32, a fresh decode: restored in place
        values = flat.view(self.view)
        scale, shift = restandardized(values, self.mean, self.std, self.reduce)
        values.mul_(scale)
        if shift is not None:
            values.add_(shift)
        return flat if self.dtype == torch.float32 else flat.to(self.dtype)

    def to_pool(self, pool: PagePool, importance: float, seed: int) -> NormalizedRecord:
        return NormalizedRecord(self.inner.to_pool(pool, importance, seed), self.mean, self.std, self.view,
                                self.reduce, self.dtype)


# NOTE [ Probabilities keep their sums ]
# softmax's backward, ``dx = y * (dy - sum(dy * y))`` over each row of its output ``y``, sums to zero over the
# row whatever ``dy``: adding a constant to a row's logits changes nothing. That needs the ``y`` it reads to
# sum to 1. Rounded values do not: a row's sum is off by the sum of its rounding errors, which grows with the
# row's length, and backward then returns ``(1 - sum(y~)) * sum(dy * y~)`` along the constant row. In
# attention that lands in the logits' gradient, and ``dq = dS k`` turns it into that share of the row's
# summed keys: a bias along the keys' common direction, not noise that averages out. The record restores
# each row divided by its sum, which holds the identity again (rounding keeps values inside their group's
# range: probabilities stay non-negative; a row that decodes to all zeros, as a safe softmax's fully masked
# row is, stays zeros). No stored byte; one read and one write of the decoded values. log_softmax's backward,
# ``dx = dy - exp(y) * sum(dy)``, likewise sums to zero only while ``exp(y)`` sums to 1 over the row: its
# output (at least 8 bits, ``NOTE [ Nonlinear backward ]`` in decide.py) is restored shifted by each row's
# ``logsumexp`` (``log``), which makes it so.
@dataclass(frozen=True)
class ClipMask(_Encoding):
    """Store only where ``lower (<|<=) x (<|<=) upper`` holds; see ``NOTE [ Op-aware encodings ]``.
    ``inside`` and ``outside`` are the values restored (checked by the rule to compare as required).
    With ``tie``, where ``x == tie`` is stored too (one more bit per value) and restored as ``tie``."""

    lower: float | None
    upper: float | None
    inclusive: bool
    inside: float
    outside: float
    tie: float | None = None

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.ones_like(x, dtype=torch.bool)
        if self.lower is not None:
            keep &= (x >= self.lower) if self.inclusive else (x > self.lower)
        if self.upper is not None:
            keep &= (x <= self.upper) if self.inclusive else (x < self.upper)
        return keep

    def candidate(self, flat: torch.Tensor, bits: int, group_size: int, seed: int,
                  grids: Grids | None = None) -> tuple[ClipMaskRecord, Checks]:
        with torch.no_grad():
            mask = self.mask(flat) if self.tie is None else torch.cat([self.mask(flat), flat == self.tie])
            bitmap = PackedRecord.bitmap(kernel_ops.pack_bool(mask), mask.numel())
            # a NaN compares false both ways, and a maximum's backward sends it the gradient on both sides:
            # no ordered value restores it (NOTE [ Non-finite activations ])
            checks: Checks = () if self.tie is None else ((~flat.isnan().any(), "nonfinite"),)
        return ClipMaskRecord(bitmap, self, flat.dtype), checks


class _EncodedRecord:
    """One packed record holding what an op-aware ``encoding`` stored, restored by the subclass's ``decode``
    as a tensor of ``dtype``."""

    __slots__ = ("__weakref__", "dtype", "encoding", "inner")
    is_bool: bool

    def __init__(self, inner: PackedRecord | DerivativeRecord | ByColumnsRecord,
                 encoding: ClipMask | Derivative | ByColumns | Probabilities, dtype: torch.dtype) -> None:
        self.inner, self.encoding, self.dtype = inner, encoding, dtype

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def to_pool(self, pool: PagePool, importance: float, seed: int) -> Self:
        return type(self)(self.inner.to_pool(pool, importance, seed), self.encoding, self.dtype)


class ClipMaskRecord(_EncodedRecord):
    """A clip's backward mask, bit-packed, restored as values that compare the same way."""

    __slots__ = ()
    is_bool = True
    encoding: ClipMask

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        keep, tie, enc = self.inner.decode(), None, self.encoding
        if enc.tie is not None:
            keep, tie = keep.view(2, -1)
        inside = torch.tensor(enc.inside, dtype=self.dtype, device=keep.device)
        values = torch.where(keep, inside, torch.tensor(enc.outside, dtype=self.dtype, device=keep.device))
        return values if tie is None else values.masked_fill_(tie, enc.tie)


# NOTE [ Activations stored as their derivative ]
# GELU (exact or tanh), SiLU, Hardswish and Mish save their input x and compute ``grad * f'(x)`` from it.
# f' is bounded (GELU: [-0.13, 1.13], SiLU: [-0.10, 1.10], Hardswish: [-0.5, 1.5], Mish: [-0.11, 1.09]);
# it increases on an interval [lo, hi] between the zeros of f'' (GELU -lo = hi = sqrt(2), SiLU 2.40;
# Hardswish's is [-3, 3], the linear piece between its two jumps; Mish's about [-2.26, 1.49]), where it
# takes all its values. The record stores d = f'(x) (computed by the op's own backward) quantized:
# backward is linear in d, so the gradient stays unbiased, with a step of ~1.26 / (2**bits - 1) in d
# (Hardswish: 2 / (2**bits - 1)) instead of (the group's range of x) * |f''| (Hardswish: a jump of 0.5
# wherever a rounded x crosses -3 or 3, as a clip's mask flips). Restoring inverts f' on [lo, hi] through
# a table of x at ``_INVERSE_POINTS`` equally spaced values of d (nearest entry): f'(x') is within half a
# table step (2.4e-6) of the decoded d. A decoded d can lie outside f''s range by up to 2**-8 of its
# group's range (the step is rounded up to bfloat16, ``layout.py``); it restores to lo or hi, a bias of
# at most that much. x' is not x (the branches outside [lo, hi] fold onto it); only f'(x'), all that
# backward reads, is kept. The encoding is elementwise, so any memory order will do. It stores what the ops
# save in place (autograd's clone of their input before it is overwritten); out of place the call saves f'(x)
# itself (``NOTE [ Activations that save their derivative ]`` in ``activation_derivative.py``).
_INVERSE_POINTS = (1 << 18) + 1


DERIVATIVE_KINDS = ("gelu", "gelu_tanh", "silu", "hardswish", "mish")
"""The activations whose input a ``Derivative`` stores as ``f'(x)``."""


def derivative_of(kind: str, x: torch.Tensor) -> torch.Tensor:
    """f'(x), as the op's backward computes it."""
    ones = torch.ones((), dtype=x.dtype, device=x.device).expand_as(x)
    if kind == "silu":
        return torch.ops.aten.silu_backward(ones, x)
    if kind == "hardswish":
        return torch.ops.aten.hardswish_backward(ones, x)
    if kind == "mish":
        return torch.ops.aten.mish_backward(ones, x)
    return torch.ops.aten.gelu_backward(ones, x, approximate="tanh" if kind == "gelu_tanh" else "none")


def _extremum(kind: str, lo: float, hi: float, largest: bool) -> float:
    """Where f' is largest (smallest) on [lo, hi], on which it rises to that point and falls after it (falls
    to it and rises after)."""
    a, b = torch.tensor(lo, dtype=torch.float64, device="cpu"), torch.tensor(hi, dtype=torch.float64, device="cpu")
    for _ in range(100):
        m1, m2 = a + (b - a) / 3, b - (b - a) / 3
        rising = derivative_of(kind, m1) < derivative_of(kind, m2)
        a, b = (m1, b) if rising == largest else (a, m2)
    return float((a + b) / 2)


def _inside_hardswish_jumps(dtype: torch.dtype) -> float:
    """The largest ``dtype`` value below 3: Hardswish's derivative jumps at -3 and 3."""
    three, zero = (torch.tensor(v, dtype=dtype, device="cpu") for v in (3.0, 0.0))
    return torch.nextafter(three, zero).item()


def _increasing_interval(kind: str) -> tuple[float, float]:
    """[lo, hi], where f' increases through all its values (``NOTE [ Activations stored as their derivative ]``)."""
    if kind == "hardswish":  # f' jumps at both ends (0 at -3, 1 at 3): the float32 values just inside
        inside = _inside_hardswish_jumps(torch.float32)
        return -inside, inside
    hi = _extremum(kind, 0.0, 4.0, largest=True)
    if kind == "mish":
        return _extremum(kind, -4.0, 0.0, largest=False), hi
    return -hi, hi  # f'(-x) = 1 - f'(x)


# NOTE [ The inverse table ]
# The table is built at the first restore of a kind, in the first backward, next to its peak. It is
# found by bisecting f' on [lo, hi] for every table value at once: a few arrays of ``_INVERSE_POINTS``
# float64 values (2 MiB each). ``_BISECTIONS`` halvings of [lo, hi] (at most 6 wide) leave an interval
# below float32's resolution of x. f' evaluated in float64 increases on [lo, hi] up to its own rounding,
# where bisection still ends on a crossing of the table value.
_BISECTIONS = 40

# NOTE [ The inverse looked up in place ]
# A restore runs in backward, next to the gradient it multiplies, so its transients add to backward's
# peak. Looked up whole, a restore would hold the decoded d, its positions (int32) and the looked-up x at
# once: three tensors of the activation's size. So it goes in slices of ``_LOOKUP_ELEMENTS``, each
# slice's positions made in place and its x written over its d (float32) or into the result (in the
# narrower dtype, from the table in that dtype: the same values as looking up float32 and casting), and
# the restore holds d and x (one tensor in float32) and one slice's positions.
_LOOKUP_ELEMENTS = 1 << 18


@functools.cache
def _inverse_table(kind: str, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, float, float]:
    """x at ``_INVERSE_POINTS`` equally spaced values of f' on [f'(lo), f'(hi)] (in ``dtype``), and those
    two bounds. Found by bisection (``NOTE [ The inverse table ]``)."""
    if dtype != torch.float32:
        table, d_lo, d_hi = _inverse_table(kind, device)
        return table.to(dtype), d_lo, d_hi
    lo, hi = _increasing_interval(kind)
    d_lo, d_hi = (float(v) for v in derivative_of(kind, torch.tensor([lo, hi], dtype=torch.float64, device="cpu")))
    d = torch.linspace(d_lo, d_hi, _INVERSE_POINTS, dtype=torch.float64, device="cpu")
    a, b = torch.full_like(d, lo), torch.full_like(d, hi)
    for _ in range(_BISECTIONS):
        mid = (a + b).mul_(0.5)
        below = derivative_of(kind, mid) < d
        a, b = torch.where(below, mid, a), torch.where(below, b, mid)
    return (a + b).mul_(0.5).float().to(device), d_lo, d_hi


@dataclass(frozen=True)
class Derivative(_Encoding):
    """Store an activation's input ``x`` as ``f'(x)``; see ``NOTE [ Activations stored as their derivative ]``."""

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in DERIVATIVE_KINDS:
            raise InvalidArgumentError(f"Derivative kind must be one of {DERIVATIVE_KINDS}, got {self.kind!r}")

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """What the record stores of ``x``: ``f'(x)``, float32."""
        with torch.no_grad():
            return derivative_of(self.kind, x.detach().float())

    def restored(self, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An input of ``dtype`` whose derivative is ``d`` (float32, overwritten: a float32 input is looked up
        over it, ``NOTE [ The inverse looked up in place ]``)."""
        table, d_min, d_max = _inverse_table(self.kind, d.device, dtype)
        x = d if dtype == torch.float32 else torch.empty(d.shape, dtype=dtype, device=d.device)
        scale = (_INVERSE_POINTS - 1) / (d_max - d_min)
        for part, out in zip(d.split(_LOOKUP_ELEMENTS), x.split(_LOOKUP_ELEMENTS), strict=True):
            pos = part.sub_(d_min).mul_(scale).clamp_(0, _INVERSE_POINTS - 1).round_().to(torch.int32)
            torch.index_select(table, 0, pos, out=out)  # NOTE [ The inverse looked up in place ]
        if dtype == torch.float32:
            return x
        if self.kind == "hardswish":  # the ends of the table round onto the jumps in a narrower dtype
            inside = _inside_hardswish_jumps(dtype)
            x.clamp_(-inside, inside)
        return x

    def candidate(self, flat: torch.Tensor, bits: int, group_size: int, seed: int,
                  grids: Grids | None = None) -> tuple[DerivativeRecord, Checks]:
        inner, checks = pack_candidate(self.stored(flat), "quantize", bits, group_size, seed, grids=grids)
        return DerivativeRecord(inner, self, flat.dtype), checks


class DerivativeRecord(_EncodedRecord):
    """An activation's input stored as its derivative (packed), restored as an input with that derivative."""

    __slots__ = ()
    is_bool = False
    encoding: Derivative

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        return self.encoding.restored(self.inner.decode(buffers), self.dtype)  # a fresh decode: reused in place


@dataclass(frozen=True)
class ByColumns(_Encoding):
    """Store a ``[-1, cols]`` tensor in groups that each hold ``group_size`` rows of one column (``NOTE [ Groups
    down the columns ]`` in ``grouping.py``; the order: ``kernels/reference.py``'s ``columns_first``); with
    ``values``, an elementwise encoding, store what it stores (an activation's derivative) that way."""

    cols: int
    group_size: int
    values: Derivative | None = None

    def stored(self, flat: torch.Tensor) -> torch.Tensor:
        """What the record quantizes, in the order it stores it (a copy)."""
        values = flat if self.values is None else self.values.stored(flat)
        return columns_first(values, self.cols, self.group_size)

    def candidate(self, flat: torch.Tensor, bits: int, group_size: int, seed: int,
                  grids: Grids | None = None) -> tuple[ByColumnsRecord, Checks]:
        with torch.no_grad():
            values = flat if self.values is None else self.values.stored(flat)
            # the grid is fitted on the stored order's groups: a view, copied only when a grid is fitted
            in_groups = values.view(-1, group_size, self.cols).transpose(1, 2)
            grid = grids(in_groups, bits) if grids is not None and bits in GRID_BITS else None
            payload = kernel_ops.quantize_pack_columns(values, self.cols, bits, group_size, seed, grid)
        inner, checks = quantized(payload, values, group_size, grid)
        return ByColumnsRecord(inner, self, flat.dtype), checks


class ByColumnsRecord(_EncodedRecord):
    """A tensor quantized in groups down its columns, restored in its own (row-major) order."""

    __slots__ = ()
    is_bool = False
    encoding: ByColumns
    inner: PackedRecord

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        inner, enc = self.inner, self.encoding
        with inner.storage.borrow() as parts:
            values = _dequantize(parts, inner.grid, inner.group_size, inner.numel, inner.dtype, buffers, enc.cols)
        return values if enc.values is None else enc.values.restored(values, self.dtype)


@dataclass(frozen=True)
class Probabilities(_Encoding):
    """Store a softmax's output quantized as it is (down its columns with ``columns``) and restore each row,
    dim 1 of ``view`` ``(outer, n, inner)``, with its sum 1; with ``log``, a log_softmax's, with its
    ``logsumexp`` 0 (``NOTE [ Probabilities keep their sums ]``)."""

    view: tuple[int, int, int]
    columns: ByColumns | None = None
    log: bool = False

    def candidate(self, flat: torch.Tensor, bits: int, group_size: int, seed: int,
                  grids: Grids | None = None) -> tuple[ProbabilitiesRecord, Checks]:
        inner, checks = (self.columns.candidate(flat, bits, group_size, seed, grids) if self.columns is not None
                         else pack_candidate(flat, "quantize", bits, group_size, seed, grids=grids))
        return ProbabilitiesRecord(inner, self, flat.dtype), checks  # type: ignore[arg-type]  # quantized


class ProbabilitiesRecord(_EncodedRecord):
    """A softmax's output, quantized, restored with rows that sum to 1; see ``Probabilities``."""

    __slots__ = ()
    is_bool = False
    encoding: Probabilities

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        flat = self.inner.decode(buffers)  # a fresh decode: restored in place
        with_row_sums(flat.view(self.encoding.view), 1, self.encoding.log, in_place=True)
        return flat


def with_row_sums(values: torch.Tensor, dim: int, log: bool, *, in_place: bool = False) -> torch.Tensor:
    """Rounded probabilities ``values`` with each row along ``dim`` divided by its sum (``log``: log-probabilities
    shifted by its ``logsumexp``); a row summing to 0 is left as it is (``NOTE [ Probabilities keep their sums
    ]``). The records restore in place; the traced unpack, which may not, out of place."""
    if log:
        shift = torch.logsumexp(values.float(), dim, keepdim=True).to(values.dtype)
        return values.sub_(shift) if in_place else values - shift
    total = values.sum(dim, keepdim=True, dtype=torch.float32)
    factor = torch.where(total > 0, total.reciprocal(), 1.0).to(values.dtype)
    return values.mul_(factor) if in_place else values * factor


# NOTE [ Max-pool indices as window positions ]
# A max pool's indices are flat positions in each input plane (``H * W`` of them: int16 under the
# narrowing above), but each one lies in the window of its output position: ``kernel_size`` positions,
# 4 for a 2 x 2 pool, 9 for 3 x 3. The ``pool_indices`` op rule knows the pool's kernel, stride, padding,
# dilation and input size, so its indices are stored as their position in the window (one uint8 each,
# where the window has at most 256 positions) and restored from the output position's window start.
# The encoding is checked at pack time: the positions must restore every index exactly (a NaN's index, a
# ceil-mode window past the edge), else the indices are narrowed as any integer tensor is. Packing makes a
# few int32 transients of the indices' size.
@dataclass(frozen=True)
class PoolWindows(_Encoding):
    """A max pool's indices (of ``shape``, ``[..., *output]``, packed in the memory order ``order`` of its dims) as
    positions in their windows (``NOTE [ Max-pool indices as window positions ]``)."""

    input_size: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    shape: tuple[int, ...] = ()
    order: tuple[int, ...] = ()

    def _dims(self, device: torch.device) -> list[tuple[torch.Tensor, int, int, int, int, int]]:
        """Per spatial dim: the window starts along it (int32, broadcastable to the indices in memory order),
        the input's size and stride, the kernel's size, the window's stride (of positions) and the dilation."""
        dims, lead = len(self.kernel), len(self.shape) - len(self.kernel)
        found = []
        for i in range(dims):
            along = [1] * len(self.shape)
            along[lead + i] = self.shape[lead + i]
            start = torch.arange(self.shape[lead + i], device=device, dtype=torch.int32) * self.stride[i]
            found.append((start.sub_(self.padding[i]).view(along).permute(self.order), self.input_size[i],
                          math.prod(self.input_size[i + 1:]), self.kernel[i], math.prod(self.kernel[i + 1:]),
                          self.dilation[i]))
        return found

    def positions(self, indices: torch.Tensor) -> torch.Tensor:
        """int32 window positions of flat ``indices`` (values in ``[0, prod(input_size))``)."""
        flat = indices.view([self.shape[d] for d in self.order]).to(torch.int32)
        out = torch.zeros_like(flat)
        for start, size, in_stride, _, window_stride, dilation in self._dims(flat.device):
            out += ((flat // in_stride % size - start) // dilation) * window_stride
        return out.view(-1)

    def indices(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The flat indices, of ``dtype``, of window ``positions`` (any integer type)."""
        pos = positions.view([self.shape[d] for d in self.order]).to(torch.int32)
        out = torch.zeros(pos.shape, dtype=dtype, device=pos.device)
        for start, _, in_stride, kernel, window_stride, dilation in self._dims(pos.device):
            out += (start + pos // window_stride % kernel * dilation) * in_stride
        return out.view(-1)

    def candidate(self, flat: torch.Tensor, bits: int, group_size: int, seed: int,
                  grids: Grids | None = None) -> tuple[Record, Checks]:
        with torch.no_grad():
            positions = self.positions(flat).to(torch.uint8)  # what is stored is what is checked
            restored, record = self.indices(positions, flat.dtype), PoolWindowsRecord(positions, self, flat.dtype)
            if reads_wait(flat.device):
                return record, (((restored == flat).all(), "integer"),)
            return (record, ()) if torch.equal(restored, flat) else narrowed(flat)


class PoolWindowsRecord:
    """A max pool's indices as uint8 positions in their windows, restored as flat indices of ``dtype``."""

    __slots__ = ("__weakref__", "dtype", "encoding", "positions")
    is_bool = False

    def __init__(self, positions: torch.Tensor, encoding: PoolWindows, dtype: torch.dtype) -> None:
        self.positions, self.encoding, self.dtype = positions, encoding, dtype

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes

    def decode(self, buffers: DecodeBuffers | None = None) -> torch.Tensor:
        return self.encoding.indices(self.positions, self.dtype)

    def to_pool(self, pool: PagePool, importance: float, seed: int) -> PoolWindowsRecord:
        return self  # lossless and already small: stays where it is


def on_fitted_grid(record: Record) -> bool:
    """Whether the packed record inside ``record`` (through its encodings) has codes on a fitted grid."""
    inner: Any = record
    while not isinstance(inner, PackedRecord):
        inner = getattr(inner, "inner", None)
        if inner is None:
            return False
    return inner.grid is not None


Encoding = Normalized | ClipMask | Derivative | ByColumns | PoolWindows | Probabilities
Record = (PackedRecord | ExactRecord | NormalizedRecord | ClipMaskRecord | DerivativeRecord | ByColumnsRecord
          | ProbabilitiesRecord
          | IntegerRecord | PoolWindowsRecord)
