"""``compress``: the saved-tensor hooks that store every activation quantized and bit-packed."""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..auto.calibration import CalibrationPass, squared_distance
from ..auto.importance import AllocationReport, AutoBits
from ..config import CompressionConfig
from ..errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError
from ..layout import record_seed
from ..params import ParameterRegistry
from ..pool.store import PagePool
from .decide import Decision, Treatment, decide
from .decode_buffers import DecodeBuffers
from .packer import AsyncPacker
from .records import (
    BoolRecord,
    ExactRecord,
    PagedBoolRecord,
    PagedQuantizedRecord,
    PendingRecord,
    QuantizedRecord,
    Record,
    SavedHandle,
    encode,
    into_pool,
)
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
#
# NOTE [ One decode per shared record ]
# A record that several saves share is decoded once per backward, not once per consumer: its
# ``_SharedDecode`` holds the decoded tensor from the first unpack until the last of its ``uses``
# (the consumers are adjacent in backward: ReLU's backward runs right after the next convolution's),
# then lets it go. Plain PyTorch hands its consumers the very same tensor too. With
# ``retain_graph=True`` the count starts over for the next backward. In ResNet-18, a third of the
# decodes were such repeats.
_Key = tuple[Any, ...]


class _SharedDecode:
    """The decode of a record that ``uses`` saves share; see ``NOTE [ One decode per shared record ]``."""

    __slots__ = ("flat", "unpacked", "uses")

    def __init__(self) -> None:
        self.uses, self.unpacked, self.flat = 2, 0, None


class compress(torch.autograd.graph.saved_tensors_hooks):
    """Store every tensor autograd saves for backward quantized and bit-packed.

    Args:
        config: a ``CompressionConfig``; keyword arguments override its fields
            (``daftrain.compress(bits=4)``).
        model: optional; its parameters and buffers (and any view of them) are then never compressed,
            recognised by storage. Without it parameters are still recognised, see ``policy.py``.
        pool: optional ``PagePool``; packed records then live in its pages (no allocation per
            record in steady state) and, under its byte budget, the least important are demoted to
            fewer bits or spilled to disk. Entering the context marks a step boundary for the pool.

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
                 pool: PagePool | None = None, **overrides: Any) -> None:
        config = config if config is not None else CompressionConfig()
        if not isinstance(config, CompressionConfig):
            raise ArgumentTypeError(f"config must be a CompressionConfig, got {type(config).__name__}")
        self.config = dataclasses.replace(config, **overrides) if overrides else config
        self.registry = ParameterRegistry(model)
        if pool is not None and not isinstance(pool, PagePool):
            raise ArgumentTypeError(f"pool must be a PagePool or None, got {type(pool).__name__}")
        self.pool = pool
        base = self.config.seed if self.config.seed is not None else torch.initial_seed()
        self._base_seed = base & ((1 << 64) - 1)
        self.step = -1
        self._stats = CompressionStats()
        self._stats_lock = threading.Lock()
        self._packer = AsyncPacker() if self.config.asynchronous else None
        self._records: weakref.WeakValueDictionary[_Key, Record | PendingRecord] = weakref.WeakValueDictionary()
        self._raw_storages: set[StorageWeakRef] = set()
        self._kept_storages: set[StorageWeakRef] = set()
        self._num_records = 0
        # Records saved more than once; entries go with their records (after backward frees the graph).
        self._shared: weakref.WeakKeyDictionary[Any, _SharedDecode] = weakref.WeakKeyDictionary()
        self._bit_policy = AutoBits(self.config, model) if self.config.auto else None
        self._decode_buffers = DecodeBuffers() if self.config.decode_buffers else None
        # bits="auto": each quantized record's forward position (its slot index), for the saves that share
        # it and for calibrate(); entries go with their records.
        self._record_index: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._calibration_pass: CalibrationPass | None = None
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> compress:  # type: ignore[override]
        self.step += 1
        self._stats = CompressionStats()
        if self.pool is not None and self.step > 0:
            self.pool.end_step()
        if self._packer is not None:
            self._packer.new_step()
        if self._decode_buffers is not None:
            self._decode_buffers.release()
        self._records = weakref.WeakValueDictionary()
        self._raw_storages, self._kept_storages = set(), set()
        self._num_records = 0
        super().__enter__()
        if self._bit_policy is not None:
            self._bit_policy.enter(self.step)
        return self

    @property
    def stats(self) -> CompressionStats:
        """What the latest forward pass saved (waits for the packer to finish its queued jobs)."""
        if self._packer is not None:
            self._packer.drain()
            self._stats.peak_pending_bytes = self._packer.peak_pending_bytes
        return self._stats

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bit_policy is not None:
            self._bit_policy.exit()
        super().__exit__(exc_type, exc, tb)
        # The dedup table only matters within one forward pass; drop its keys (and their weak refs).
        self._records = weakref.WeakValueDictionary()
        self._raw_storages, self._kept_storages = set(), set()

    # -- the hooks ---------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor | SavedHandle:
        stats = self._stats
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
            shared = self._shared.get(record)
            if shared is None:
                self._shared[record] = _SharedDecode()
            else:
                shared.uses += 1
            index = self._record_index.get(record) if self._bit_policy is not None else None
            if index is not None:
                self._bit_policy.note_saved_again(self.step, index, t)
        else:
            flat = t.as_strided((t.numel(),), (1,)) if dense else t.contiguous().view(-1)
            index = self._num_records
            record = self._make_record(flat, decision, t)
            if self._bit_policy is not None and decision.treatment is Treatment.QUANTIZE:
                self._record_index[record] = index
            self._records[key] = record
        return SavedHandle(record, t.shape, t.stride(), dense)

    def _unpack(self, packed: torch.Tensor | SavedHandle) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if self._calibration_pass is not None:
            flat = packed.record.decode()
            index = self._record_index.get(packed.record)
            return packed.restore(self._calibration_pass.perturb(index, flat))
        shared = self._shared.get(packed.record)
        if shared is not None and shared.flat is not None:
            flat = shared.flat
        else:
            buffers = self._decode_buffers
            flat = (self._packer.decode(packed.record, buffers) if self._packer is not None
                    else packed.record.decode(buffers))
        if shared is not None:
            shared.unpacked += 1
            shared.flat = flat if shared.unpacked % shared.uses else None
        return packed.restore(flat)

    # -- helpers -----------------------------------------------------------------------------------
    def _keep(self, t: torch.Tensor, storage: StorageWeakRef, decision: Decision) -> torch.Tensor:
        self._stats.kept += 1
        self._stats.kept_reasons[decision.reason] += 1
        if storage not in self._kept_storages:
            self._kept_storages.add(storage)
            self._stats.kept_bytes += t.untyped_storage().nbytes()
        # NOTE: detach(), not t: for a saved *output*, t's grad_fn owns the saved variable, and
        # returning t itself would form a reference cycle that is never freed. Unpacking restores
        # the grad_fn, and no data is copied.
        return t.detach()

    def _make_record(self, flat: torch.Tensor, decision: Decision,
                     source: torch.Tensor | None = None) -> Record | PendingRecord:
        kind = _KINDS[decision.treatment]
        bits = self.config.bits if isinstance(self.config.bits, int) else 1
        if self._bit_policy is not None and decision.treatment is Treatment.QUANTIZE:
            bits = self._bit_policy.bits_for(self.step, self._num_records, source, flat, decision.min_bits)
            if bits is None:  # bits="auto" found this tensor worth its full bytes: kept exact
                self._num_records += 1
                exact = ExactRecord(flat, "auto")
                self._account(self._stats, exact)
                return exact
        if kind == "quantize":
            bits = max(bits, decision.min_bits)
        index = self._num_records
        seed = record_seed(self._base_seed, self.step, index)
        self._num_records += 1
        job = functools.partial(encode, kind=kind, bits=bits, group_size=self.config.group_size, seed=seed)
        if self.pool is not None:
            importance = None
            if self._bit_policy is not None and decision.treatment is Treatment.QUANTIZE:
                importance = self._bit_policy.importance_of(index, flat)
            if importance is None:
                importance = float(index)
            job = functools.partial(_encode_into_pool, job, pool=self.pool, importance=importance, seed=seed)
        if self._packer is None:
            record = job(flat)
            self._account(self._stats, record)
            return record
        pending = self._packer.submit(flat, job)
        stats = self._stats
        pending.future.add_done_callback(lambda f: f.exception() is None and self._account(stats, f.result()))
        return pending

    def _account(self, stats: CompressionStats, record: Record) -> None:
        with self._stats_lock:
            if isinstance(record, ExactRecord):
                stats.kept += 1
                stats.kept_reasons[record.reason] += 1
                stats.kept_bytes += record.nbytes
            else:
                stats.compressed += isinstance(record, (QuantizedRecord, PagedQuantizedRecord))
                stats.bool_packed += isinstance(record, (BoolRecord, PagedBoolRecord))
                stats.packed_bytes += record.nbytes

    # -- bits="auto" ------------------------------------------------------------------------------
    def report(self) -> AllocationReport | None:
        """``bits="auto"``: each saved tensor's importance and bits; ``str()`` is a table, ``.to_json()``
        JSON. ``None`` until the first step's backward has run, or with fixed bits."""
        return self._bit_policy.report() if self._bit_policy is not None else None

    def calibrate(self, loss: torch.Tensor) -> dict[str, float]:
        """``bits="auto"``: measure how much gradient variance each class of saved tensors really adds,
        with one extra backward pass per class on this step's graph, and correct the importance
        estimate (and the allocation in force) by it; see ``NOTE [ Calibration ]`` in ``calibration.py``.

        Call it between the forward (under this context) and ``loss.backward()``, on a step after the
        first one, every few hundred steps (each call costs a backward per class). Needs ``model``.
        Returns each measured class's correction factor; ``ctx.report()`` shows them.
        """
        policy = self._bit_policy
        if policy is None:
            raise UnsupportedError("calibrate() corrects bits='auto''s importance estimate; this context has fixed bits")
        if not policy.params:
            raise UnsupportedError("calibrate() measures parameter gradients: create the context with compress(model=...)")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise InvalidArgumentError("calibrate() needs the scalar loss of a forward run under this context, "
                             "before its backward")
        targets = policy.calibration_targets()
        group, seed = self.config.group_size, self._base_seed ^ _CALIBRATION_SEED

        def gradients(indices: dict[int, int]) -> tuple[list[torch.Tensor | None], CalibrationPass]:
            calibration_pass = CalibrationPass(indices, group, seed, self.step)
            self._calibration_pass, policy.calibrating = calibration_pass, True
            try:
                grads = torch.autograd.grad(loss, policy.params, retain_graph=True, allow_unused=True)
            finally:
                self._calibration_pass, policy.calibrating = None, False
            return list(grads), calibration_pass

        base, _ = gradients({})
        factors: dict[str, float] = {}
        perturbed = False
        for cls, members in targets.items():
            grads, done = gradients({key.index: key.numel for key, _ in members})
            perturbed = perturbed or bool(done.noise)
            predicted = math.fsum(s * done.noise.get(key.index, 0.0) for key, s in members)
            measured = squared_distance(grads, base)
            if predicted > 0 and measured > 0 and math.isfinite(measured):
                factors[cls] = measured / predicted
        if not perturbed:
            raise UnsupportedError("calibrate() found none of the allocation's saved tensors in this loss's graph: "
                               "compute the loss under this context, and call calibrate() before loss.backward()")
        policy.set_calibration(factors)
        return factors

    def state_dict(self) -> dict[str, Any]:
        """The step counter and (``bits="auto"``) the bit allocation and its estimates, as plain Python
        values, so that a resumed run decides the same bits. Call it between steps."""
        if self._bit_policy is not None:
            return self._bit_policy.state_dict(self.step)
        return AutoBits.fixed_state_dict(self.config, self.step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a state from another model or config, or a corrupted one, raises
        ``StateDictError`` and changes nothing."""
        if self._bit_policy is not None:
            self.step = self._bit_policy.load_state_dict(state)
        else:
            self.step = AutoBits.load_fixed_state_dict(self.config, state)

    def close(self) -> None:
        """Stop the packer thread (asynchronous mode); the context cannot pack afterwards."""
        if self._packer is not None:
            self._packer.close()


# NOTE [ Importance of a record in the pool ]
# With ``bits="auto"`` a quantized record's importance is the gradient variance its slot adds at
# its allocated bits (``AutoBits.importance_of``): demoting any record scales its variance by the
# same factor, so the records adding least variance go first. Otherwise (fixed bits, or before the
# first allocation) the pool orders records by forward position: the earliest saved is the least
# important. Backward needs it last, so a record demoted or spilled first is also the one with the
# most time to be paged back in.
def _encode_into_pool(job: functools.partial[Record], flat: torch.Tensor, *, pool: PagePool, importance: float,
                      seed: int) -> Record:
    return into_pool(job(flat), pool, importance, seed)


_CALIBRATION_SEED = 0x5EEDCA1B  # calibrate()'s noise draws differ from the records' rounding draws

_KINDS = {Treatment.QUANTIZE: "quantize", Treatment.QUANTIZE_IF_LOSSLESS: "lossless", Treatment.PACK_BOOL: "bool"}
