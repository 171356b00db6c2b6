"""``compress``: the saved-tensor hooks that store every activation quantized and bit-packed."""

from __future__ import annotations

import dataclasses
import weakref
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .config import CompressionConfig
from .layout import PackedLayout, record_seed
from .policy import Decision, ParameterRegistry, Treatment, decide
from .records import BoolRecord, ExactRecord, QuantizedRecord, Record, SavedHandle
from .stats import CompressionStats

__all__ = ["compress"]


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` consecutive elements of its storage (any dim order)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1),
                               key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


# NOTE [ One record per storage span ]
# Autograd often saves one storage several times: ReLU saves its output and the next convolution
# saves the same tensor as its input; ``linear`` saves a reshaped view of a [B, T, D] activation that
# LayerNorm saved too. Plain PyTorch holds such a storage once, so daftrain packs it once:
#   1. a dense view (one covering ``numel`` consecutive elements, in any dimension order, e.g.
#      channels_last or a transpose) is packed as that memory span, in memory order, and restored
#      with ``as_strided``; every dense view of the same span shares the record;
#   2. any other view (a slice with gaps) is packed from its contents and restored into a tensor
#      with its own strides;
#   3. the key holds the storage by ``StorageWeakRef`` (never a bare address, which is reused once
#      freed) and the version counter, so a storage modified in place between two saves is packed
#      again, with its new values.
_Key = tuple[Any, ...]


class compress(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 (a context manager, like torch's)
    """Store every tensor autograd saves for backward quantized and bit-packed.

    Args:
        config: a ``CompressionConfig``; keyword arguments override its fields
            (``daftrain.compress(bits=4)``).
        model: optional; its parameters and buffers (and any view of them) are then never compressed,
            recognised by storage. Without it parameters are still recognised, see ``policy.py``.

    Example::

        ctx = daftrain.compress(bits=2)
        for x, y in loader:
            with ctx:
                loss = loss_fn(model(x), y)
            loss.backward()
            print(ctx.stats.ratio)

    The object can be re-entered once per step; ``stats`` describes the latest forward pass. As with
    every saved-tensor hook, the innermost context wins: inside ``torch.utils.checkpoint`` regions
    (``use_reentrant=False``) checkpointing decides, outside them daftrain does.
    """

    def __init__(self, config: CompressionConfig | None = None, /, *, model: nn.Module | None = None,
                 **overrides: Any) -> None:
        config = config if config is not None else CompressionConfig()
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"config must be a CompressionConfig, got {type(config).__name__}")
        self.config = dataclasses.replace(config, **overrides) if overrides else config
        self.registry = ParameterRegistry(model)
        base = self.config.seed if self.config.seed is not None else torch.initial_seed()
        self._base_seed = base & ((1 << 64) - 1)
        self.step = -1
        self.stats = CompressionStats()
        self._records: weakref.WeakValueDictionary[_Key, Record] = weakref.WeakValueDictionary()
        self._raw_storages: set[StorageWeakRef] = set()
        self._kept_storages: set[StorageWeakRef] = set()
        self._num_records = 0
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> compress:  # type: ignore[override]
        self.step += 1
        self.stats = CompressionStats()
        self._records = weakref.WeakValueDictionary()
        self._raw_storages, self._kept_storages = set(), set()
        self._num_records = 0
        super().__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        super().__exit__(exc_type, exc, tb)
        # The dedup table only matters within one forward pass; drop its keys (and their weak refs).
        self._records = weakref.WeakValueDictionary()
        self._raw_storages, self._kept_storages = set(), set()

    # -- the hooks ---------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor | SavedHandle:
        stats = self.stats
        stats.tensors_seen += 1
        stats.by_dtype[str(t.dtype).removeprefix("torch.")] += 1
        decision = decide(t, self.config, self.registry)
        if decision.reason == "parameter":
            stats.parameters += 1
            return t.detach()
        storage = StorageWeakRef(t.untyped_storage())
        if storage not in self._raw_storages:
            self._raw_storages.add(storage)
            stats.raw_bytes += t.untyped_storage().nbytes()
        if decision.treatment is Treatment.KEEP:
            return self._keep(t, storage, decision)
        dense = is_dense(t)
        key: _Key = (storage, t.dtype, t._version, t.storage_offset(), t.numel())
        if not dense:
            key += (tuple(t.shape), t.stride())
        record = self._records.get(key)
        if record is not None:
            stats.deduplicated += 1
        else:
            flat = t.as_strided((t.numel(),), (1,)) if dense else t.contiguous().view(-1)
            record = self._make_record(flat, decision)
            self._records[key] = record
        return SavedHandle(record, t.shape, t.stride(), dense)

    def _unpack(self, packed: torch.Tensor | SavedHandle) -> torch.Tensor:
        return packed if isinstance(packed, torch.Tensor) else packed.restore()

    # -- helpers -----------------------------------------------------------------------------------
    def _keep(self, t: torch.Tensor, storage: StorageWeakRef, decision: Decision) -> torch.Tensor:
        self.stats.kept += 1
        self.stats.kept_reasons[decision.reason] += 1
        if storage not in self._kept_storages:
            self._kept_storages.add(storage)
            self.stats.kept_bytes += t.untyped_storage().nbytes()
        # NOTE: detach(), not t: for a saved *output*, t's grad_fn owns the saved variable, and
        # returning t itself would form a reference cycle that is never freed. Unpacking restores
        # the grad_fn, and no data is copied.
        return t.detach()

    def _make_record(self, flat: torch.Tensor, decision: Decision) -> Record:
        stats = self.stats
        if decision.treatment is Treatment.PACK_BOOL:
            record: Record = BoolRecord(torch.ops.daftrain.pack_bool(flat), flat.numel())
            stats.bool_packed += 1
        elif decision.treatment is Treatment.QUANTIZE_IF_LOSSLESS:
            record = self._pack_if_lossless(flat)
        else:
            record = self._quantize(flat, self.config.bits)
        if isinstance(record, ExactRecord):
            stats.kept += 1
            stats.kept_reasons[record.reason] += 1
            stats.kept_bytes += record.nbytes
        else:
            stats.compressed += isinstance(record, QuantizedRecord)
            stats.packed_bytes += record.nbytes
        return record

    def _pack_if_lossless(self, flat: torch.Tensor) -> Record:
        # See NOTE [ Constants are stored losslessly or kept ] in policy.py.
        stats = torch.ops.daftrain.group_minmax(flat, self.config.group_size)
        mn, mx, min_pos = stats.unbind(1)
        if bool(((mn == mx) | ((mn == 0) & (min_pos == mx))).all()):
            return self._quantize(flat, 1)
        return ExactRecord(flat, "constant")

    def _quantize(self, flat: torch.Tensor, bits: int | None) -> Record:
        group_size = self.config.group_size
        assert bits is not None  # decide() keeps tensors when bits is None
        seed = record_seed(self._base_seed, self.step, self._num_records)
        self._num_records += 1
        codes, lo, scale = torch.ops.daftrain.quantize_pack(flat, bits, group_size, seed)
        # NOTE [ Non-finite activations ]: a NaN or Inf anywhere in a group shows in that group's lo or
        # scale. Such a tensor is kept exact, so backward sees exactly what plain PyTorch would: values
        # are never silently replaced. The check reads num_groups values, not the tensor.
        if not bool(torch.isfinite(lo).all() and torch.isfinite(scale).all()):
            return ExactRecord(flat, "nonfinite")
        return QuantizedRecord(codes, lo, scale, PackedLayout(bits, group_size, flat.numel()), flat.dtype)
