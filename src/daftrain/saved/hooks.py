"""``compress``: the saved-tensor hooks that store every activation quantized and bit-packed."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import warnings
import weakref
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..allocator import HeapTrimmer
from ..auto.calibration import CalibrationPass, LossCatcher, calibrate
from ..auto.policy import Assignment, make_bit_policy
from ..auto.report import AllocationReport
from ..config import CompressionConfig
from ..errors import ArgumentTypeError, DaftrainError, UnsupportedError
from ..kernels import load_fast_kernels
from ..layout import STORED_AS_FLOAT32, record_seed, widest_bits_within
from ..lineage import reached
from ..params import ParameterRegistry
from ..pool import PagePool
from .activation_derivative import DOUBLE_BACKWARD_THROUGH_DERIVATIVE
from .checkpoint import compress_recomputation, restore_recomputation
from .checks import Settling
from .compiled import CompiledHooks, hooks_for, untraceable_reason, warn_untraceable
from .decide import Decision, Treatment, decide, has_storage
from .decode_buffers import DecodeBuffers
from .grid_choice import GridChoice
from .grouping import ColumnChoice
from .live_saves import LiveSaves
from .nesting import (
    CHECKPOINT_INPUT,
    CUSTOM_SHARE_WARNED,
    saving_function,
    warn_custom_functions_kept,
    warn_if_nested,
)
from .op_rules import RULES, AmplifiedRoundingWarning, OpMatch, OpTracer
from .packer import AsyncPacker
from .per_position import PerPosition
from .records import (
    ByColumns,
    Derivative,
    Encoding,
    ExactRecord,
    IntegerRecord,
    KeptTensor,
    Normalized,
    PendingRecord,
    PoolWindowsRecord,
    Probabilities,
    Record,
    SavedHandle,
    UndecidedRecord,
    compact_expanded,
    encode,
    is_dense,
    is_expanded,
    on_fitted_grid,
)
from .singular import (
    HELD_PRODUCERS,
    HELD_SAVES,
    RECENT_SAVE_BYTES,
    RECENT_SAVES,
    SHIFTS,
    SINGULAR_RESULTS,
    after_product,
    caller_level,
    held_inputs,
)
from .small_tensors import SMALL_SHARE, BatchedSlice, SmallTensors, small_tensor_bits
from .stats import CompressionStats

__all__ = ["compress"]


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


class _NoTracer:
    """Exact mode: no op rule applies, nothing is traced."""

    def start(self, step: int = 0) -> None:
        pass

    def stop(self) -> None:
        pass

    def current(self) -> OpMatch | None:
        return None


_NO_TRACER = _NoTracer()

_COMPILED_RECORDS = 1 << 31
"""Where the indices of compiled graphs' records start, apart from the eager records' (``compiled_seed``,
``compiled_grid``)."""

RECOMPUTATION_SHARE_BITS = 8
"""The bits a ``bits="auto", error_share=...`` context's recomputation stores at (``recomputation_context``)."""

# PyTorch refuses its function transforms' own autograd while saved-tensor hooks are active, with this.
_FUNCTORCH_REFUSAL = "don't yet support saved tensor hooks"
_FUNCTORCH_UNDER_COMPRESS = (
    "torch.func's grad / vjp / jacrev / hessian cannot run inside a compress context: PyTorch turns "
    "saved-tensor hooks off for its function transforms and refuses them there. Call the transform "
    "outside the context (its saved tensors then stay exact), or compute the gradient with "
    "loss.backward() / torch.autograd.grad under compress."
)


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
            recognised by storage. Without it parameters are still recognised, see ``policy.py``. With Hugging
            Face gradient checkpointing enabled, its layers are recomputed compressed while the context is
            entered (``daftrain.checkpoint``).
        pool: optional ``PagePool``; packed records then live in its pages (no allocation per
            record in steady state) and, under its byte cap (``max_bytes``), the least important are demoted to
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
    (``use_reentrant=False``) checkpointing decides, outside them daftrain does; a region's inputs are kept exact.
    """

    def __init__(self, config: CompressionConfig | None = None, /, *, model: nn.Module | None = None,
                 pool: PagePool | None = None, **overrides: Any) -> None:
        config = config if config is not None else CompressionConfig()
        if not isinstance(config, CompressionConfig):
            raise ArgumentTypeError(f"config must be a CompressionConfig, got {type(config).__name__}")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(CompressionConfig)})
        if unknown:
            raise ArgumentTypeError(f"compress got unknown keyword arguments {unknown}; it takes config, model, pool "
                                    f"and the CompressionConfig fields "
                                    f"{[f.name for f in dataclasses.fields(CompressionConfig)]}")
        self.config = dataclasses.replace(config, **overrides) if overrides else config
        if model is not None and not isinstance(model, nn.Module):
            raise ArgumentTypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        self.registry = ParameterRegistry(model)
        self._model = model
        self._swaps_checkpointing = True
        self._swapped: list[tuple[nn.Module, Any]] = []
        self._recomputation: compress | None = None
        on_cpu = model is None or any(p.device.type == "cpu" for p in model.parameters())
        # NOTE [ Freed memory goes back to the OS ] in allocator.py
        self._trimmer = HeapTrimmer() if self.config.tune_allocator and on_cpu else None
        if pool is not None and not isinstance(pool, PagePool):
            raise ArgumentTypeError(f"pool must be a PagePool or None, got {type(pool).__name__}")
        self.pool = pool
        if on_cpu:
            load_fast_kernels(warmup=True)  # NOTE [ Kernels load before the first step ] in kernels/cpu.py
        base = self.config.seed if self.config.seed is not None else torch.initial_seed()
        self._base_seed = base & ((1 << 64) - 1)
        self.step = -1
        self._compiled_records = itertools.count()  # this step's, for their seeds (``compiled_seed``)
        self._stats = CompressionStats()
        self._stats_lock = threading.Lock()
        self._packer = AsyncPacker() if self.config.asynchronous else None
        self._settling = Settling()  # NOTE [ Checks the host does not wait for ] in checks.py
        self._records: weakref.WeakValueDictionary[_Key, Record | PendingRecord] = weakref.WeakValueDictionary()
        self._raw_storages: set[StorageWeakRef] = set()
        self._kept_storages: set[StorageWeakRef] = set()
        self._num_records = 0
        # The small tensors' slices of this forward, by key: held until it ends, as their staging buffers are.
        self._small_records: dict[_Key, BatchedSlice] = {}
        self._small = SmallTensors(self.config.group_size)  # NOTE [ Small tensors packed together ]
        self._small_bits = small_tensor_bits(self.config)
        self._small_bytes = 0  # the bytes of the small tensors this forward saved that could be packed together
        # NOTE [ Every save of a value a singular backward reads ]: such values by key, in this forward, and the
        # records made of them before they were kept; entries go with the kept tensors and the records.
        self._exact_saves: weakref.WeakValueDictionary[_Key, KeptTensor] = weakref.WeakValueDictionary()
        self._exact_records: weakref.WeakKeyDictionary[Any, KeptTensor] = weakref.WeakKeyDictionary()
        # The latest rounded saves of ``HELD_PRODUCERS``' outputs, held until ``RECENT_SAVES`` more came.
        self._recent_saves: collections.deque[tuple[Any, Any, torch.Tensor]] = collections.deque(maxlen=RECENT_SAVES)
        # NOTE [ Saves held for a singular backward ] in singular.py: the saves of squares and softplus calls, held for
        # ``HELD_SAVES`` more saves, each with the count of saves when it came, the node that made it and its record.
        self._held_saves: collections.deque[tuple[int, Any, Any, torch.Tensor]] = collections.deque()
        # NOTE [ Saves of custom Functions are kept ] in nesting.py: bytes kept this forward, by Function
        self._custom_kept: collections.Counter[str] = collections.Counter()
        self._custom_warned = False
        self._amplified_warned = False
        # Records saved more than once; entries go with their records (after backward frees the graph).
        self._shared: weakref.WeakKeyDictionary[Any, _SharedDecode] = weakref.WeakKeyDictionary()
        self._bit_policy = make_bit_policy(self.config, model)
        self._decode_buffers = DecodeBuffers() if self.config.decode_buffers else None
        # the heap trimmer and the decode buffers wait on the release of what a forward saved (host memory)
        listeners = [o.saves_held for o in (self._trimmer, self._decode_buffers) if o is not None]
        self._live_saves = LiveSaves(listeners) if listeners else None
        # Each quantized record's forward position (its slot index), for the saves that share it and for
        # calibrate(); entries go with their records.
        self._record_index: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        # The op-aware encoding of each quantized record that has one, for calibrate()'s verification pass.
        self._record_encoding: weakref.WeakKeyDictionary[Any, Encoding] = weakref.WeakKeyDictionary()
        # The bits each quantized record was made at, for the saves that would share it (``_serves``).
        self._record_bits: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._column_choice = ColumnChoice(self.config.group_size)
        self._grid_choice = GridChoice(self.config.group_size) if self.config.fitted_grids else None
        # NOTE [ Constants found not lossless ]: forward positions whose constant was kept exact
        self._not_lossless: PerPosition[bool] = PerPosition()
        self._calibration_pass: CalibrationPass | None = None
        self._loss_catcher: LossCatcher | None = None
        self._calibration_warned = False
        # NOTE [ Hooks inside compiled graphs ] in compiled.py: one hook pair per configuration.
        self._untraceable = untraceable_reason(self.config, pool)
        self._compile_warned = False
        self._hooks: CompiledHooks = hooks_for(self.config, traceable=self._untraceable is None)
        # NOTE [ Tracing the saving op ] in op_rules.py: only while quantizing (never in exact mode).
        # NOTE [ Quotients by a kept divisor ]: the tracer adds to this set, which refers to no context
        self._exact_storages: set[StorageWeakRef] = set()
        rules = RULES if not self.config.double_backward else tuple(
            rule for rule in RULES if rule.name != "activation_derivative")  # NOTE [ A backward differentiated again ]
        self._op_tracer = (OpTracer(rules, linear_cross_entropy=self.config.linear_cross_entropy,
                                    group_size=self.config.group_size,
                                    traffic=self._trimmer.note if self._trimmer is not None else None,
                                    exact_result=functools.partial(_note_storage, self._exact_storages))
                           if self.config.bits is not None else _NO_TRACER)
        # No super().__init__: it would store the hooks, see NOTE [ No reference cycle ].

    # NOTE [ No reference cycle ]
    # ``saved_tensors_hooks.__init__`` stores the two hooks on the object. Stored bound methods of the
    # object itself would make every context a reference cycle, freed only by a full cyclic garbage
    # collection, with its decode buffers and records: a new ``compress`` per step (``with
    # daftrain.compress(bits=2):`` written in the loop) would grow memory step after step. The hooks
    # are the configuration's shared pair (``compiled.hooks_for``), which refers to a context only
    # while it is entered (its per-thread stack of active contexts); each eager record's handle
    # carries its context to the unpack (``compiled._Owned``): the graph's saved tensors hold the
    # context until backward frees them, and nothing else does.
    @property
    def pack_hook(self) -> Any:
        return self._hooks.pack

    @property
    def unpack_hook(self) -> Any:
        return self._hooks.unpack

    def __enter__(self) -> compress:  # type: ignore[override]
        self.step += 1
        self._compiled_records = itertools.count()
        self._stats = CompressionStats()
        if self.pool is not None and self.step > 0:
            self.pool.end_step()
        if self._packer is not None:
            self._packer.new_step()
        if self._decode_buffers is not None:
            self._decode_buffers.release()
        self._small.seal(self._encode_small)
        self._small_bytes = 0
        self._forget_saves()
        self._num_records = 0
        warn_if_nested(self)  # NOTE [ Only the innermost saved-tensor hooks apply ] in nesting.py
        if self._model is not None and self._swaps_checkpointing:
            # NOTE [ Hugging Face layers checkpointed under compress ] in checkpoint.py
            self._swapped = compress_recomputation(self._model, self)
        super().__enter__()
        self._hooks.activate(self)
        self._op_tracer.start(self.step)
        self._bit_policy.enter(self.step)
        if self._bit_policy.wants_calibration(pending=True):  # NOTE [ A variance target ] in auto/policy.py
            self._loss_catcher = LossCatcher()
            self._loss_catcher.__enter__()
        if self._trimmer is not None:
            self._trimmer.begin()
        return self

    @property
    def stats(self) -> CompressionStats:
        """What the latest forward pass saved (waits for the packer to finish its queued jobs)."""
        self._account_settled(self._settling.settle_all())
        if self._packer is not None:
            self._packer.drain()
            self._stats.peak_pending_bytes = self._packer.peak_pending_bytes
        self._hooks.fill(self._stats)
        self._stats.read_peak_memory()
        return self._stats

    def _warn_if_untraceable(self) -> None:
        """Once per context: a graph compiled under it stores its saved tensors exact (compiled.py)."""
        if self._untraceable is not None and not self._compile_warned:
            self._compile_warned = True
            warn_untraceable(self._untraceable)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        restore_recomputation(self._swapped)
        self._swapped = []
        catcher, self._loss_catcher = self._loss_catcher, None
        if catcher is not None:
            catcher.__exit__(None, None, None)
        self._bit_policy.exit()
        self._op_tracer.stop()
        super().__exit__(exc_type, exc, tb)
        self._hooks.deactivate(self)
        self._small.seal(self._encode_small)
        if (not self._custom_warned and self._custom_kept
                and self._custom_kept.total() >= CUSTOM_SHARE_WARNED * self._stats.raw_bytes):
            self._custom_warned = True
            warn_custom_functions_kept(self._custom_kept, self._stats.raw_bytes)
        self._forget_saves()
        self._account_settled(self._settling.settle_all())
        if catcher is not None and exc_type is None and self._bit_policy.wants_calibration():
            self._calibrate_on(catcher.loss())
        if self._trimmer is not None:
            self._trimmer.end()
        if isinstance(exc, RuntimeError) and not isinstance(exc, DaftrainError) and _FUNCTORCH_REFUSAL in str(exc):
            raise UnsupportedError(_FUNCTORCH_UNDER_COMPRESS) from exc

    def _calibrate_on(self, loss: torch.Tensor | None) -> None:
        """Calibrate on the loss computed under the context, when the policy wants it (``error_share``)."""
        if loss is not None:
            try:
                self.calibrate(loss)
                return
            except UnsupportedError:
                pass
        if not self._calibration_warned:
            self._calibration_warned = True
            warnings.warn(
                "daftrain: compress(bits='auto', error_share=...) calibrates its estimate on the loss, and no "
                "scalar loss computed under the context was found in the saved tensors' graph; compute the "
                "loss inside 'with ctx:' or call ctx.calibrate(loss) before loss.backward() (until then every "
                "quantized tensor gets 4 bits)", stacklevel=3)

    def _forget_saves(self) -> None:
        """Drop the dedup table and the storages counted: they only matter within one forward pass."""
        self._records = weakref.WeakValueDictionary()
        self._small_records = {}
        self._exact_saves = weakref.WeakValueDictionary()
        self._exact_storages.clear()
        self._recent_saves.clear()
        self._held_saves.clear()
        self._custom_kept.clear()
        self._raw_storages, self._kept_storages = set(), set()

    def recomputation_context(self) -> compress:
        """The context that stores what ``daftrain.checkpoint`` regions save when backward recomputes them
        (``NOTE [ Compressed recomputation ]`` in ``checkpoint.py``): this one's configuration, at its fixed
        bits, made once. A recomputation is one block, not a forward pass to allocate over, so a
        ``bits="auto"`` context's is stored at fixed bits: those of its ``avg_bits`` rounded down to a
        supported width where it names one (the bytes it asked for); under an ``error_share`` bound, which no
        fixed width is known to hold, ``RECOMPUTATION_SHARE_BITS`` (a recomputation's records exist one block at
        a time in backward, so their bytes weigh little on the peak); else the default fixed bits."""
        if self._recomputation is None:
            config = self.config
            if config.auto:
                bits = (widest_bits_within(config.avg_bits) if config.avg_bits is not None
                        else RECOMPUTATION_SHARE_BITS if config.error_share is not None else CompressionConfig.bits)
                config = dataclasses.replace(config, bits=bits, avg_bits=None, packed_bytes=None, error_share=None)
            self._recomputation = compress(config, model=self._model)
            self._recomputation._swaps_checkpointing = False  # it runs inside the layers this one swapped
        return self._recomputation

    def _hold_exact(self, t: torch.Tensor) -> None:
        """Count a tensor daftrain holds exact for backward outside the pack hook (a ``daftrain.checkpoint``
        region's input, ``NOTE [ Compressed recomputation ]``) in the stats, as a kept save."""
        if not has_storage(t):
            return
        self._keep(t, self._count_raw(t), _KEEP_CHECKPOINT_INPUT)

    def _count_raw(self, t: torch.Tensor) -> StorageWeakRef:
        """``t``'s storage, its bytes counted in ``stats.raw_bytes`` once per forward."""
        storage = StorageWeakRef(t.untyped_storage())
        if storage not in self._raw_storages:
            self._raw_storages.add(storage)
            self._stats.raw_bytes += t.untyped_storage().nbytes()
        return storage

    def _note_unsaved(self, nbytes: int) -> None:
        """A tensor a checkpointed region did not save: freed within the region, so it counts towards the
        next heap trim like a packed one (``NOTE [ Freed memory goes back to the OS ]``)."""
        if self._trimmer is not None:
            self._trimmer.note(nbytes)

    def _region_ended(self) -> None:
        """A checkpointed region returned: what it computed and did not save is free now; hand it back
        (``NOTE [ Freed memory goes back to the OS ]``)."""
        if self._trimmer is not None:
            self._trimmer.trim()

    # -- the hooks ---------------------------------------------------------------------------------
    # NOTE [ A normalised record serves plain saves ]
    # A tensor a normalisation rule stores divided by its rows' scale (``Normalized``) is often saved again
    # by a plain op in the same forward (ConvNeXt V2's response norm saves x for its norm and for
    # ``x * Nx``). Its normalised record restores it with each row's error relative to that row's own
    # scale, never coarser than plain quantization at the same bits, so such a save reuses it instead of
    # storing the tensor twice, unless it needs more bits than the default floor (``min_bits``). No
    # record made at fewer bits than a save's floor serves it (a computed weight saved first by a product
    # at 2 bits, then by ``F.linear``, which needs 8: stored again at 8), and no lossily quantized record
    # serves a constant sharing its storage (``x.detach()``), which is stored losslessly or kept
    # (NOTE [ Constants are stored losslessly or kept ] in decide.py). A softmax's output (``Probabilities``)
    # serves likewise the product that saves it again (``P @ V``): the same rounded values, each row
    # rescaled to its sum 1 by a factor within its rounding of 1.
    def _serves(self, record: Record | PendingRecord, decision: Decision) -> bool:
        """Whether the record found under a save's key may serve a save ``decision`` makes plainly."""
        if decision.treatment is not Treatment.QUANTIZE:
            return record not in self._record_index  # only a record made without loss
        if self._record_bits.get(record, decision.min_bits) < decision.min_bits:
            return False
        return decision.min_bits <= 1 or not isinstance(self._record_encoding.get(record), Normalized)

    def _pack(self, t: torch.Tensor) -> torch.Tensor | KeptTensor | SavedHandle:
        if self._trimmer is not None:
            self._trimmer.note(t.numel() * t.element_size())
        stats = self._stats
        stats.tensors_seen += 1
        held = self._held_saves
        while held and held[0][0] + HELD_SAVES < stats.tensors_seen:
            held.popleft()
        stats.by_dtype[str(t.dtype).removeprefix("torch.")] += 1
        call = self._op_tracer.current()
        decision = decide(t, self.config, self.registry, call)
        if decision.reason == "parameter":
            stats.parameters += 1
            return t.detach()
        if decision.treatment in _ROUNDED:
            saver = saving_function()
            if saver is CHECKPOINT_INPUT:
                decision = _KEEP_CHECKPOINT_INPUT  # NOTE [ A checkpointed region's inputs are kept exact ]
            elif saver is not None and not self.config.quantize_custom_functions and not _is_daftrains(saver):
                decision = _KEEP_CUSTOM_FUNCTION  # NOTE [ Saves of custom Functions are kept ] in nesting.py
                self._custom_kept[saver.__qualname__] += t.numel() * t.element_size()
        # Sparse, nested and meta tensors have no storage to account or pack (decide keeps them).
        storage = None if decision.reason == "layout" else self._count_raw(t)
        if decision.treatment is Treatment.KEEP:
            kept = self._keep(t, storage, decision)
            if decision.rule in _SINGULAR_KEEPS and storage is not None:
                self._keep_every_save(t, storage, kept, call)
            return kept
        if self._exact_saves and storage is not None and any(
                key in self._exact_saves for key in _keys(t, storage)):
            return self._keep(t, storage, _KEEP_SINGULAR)  # NOTE [ Every save of a value a singular backward reads ]
        if self._exact_storages and storage in self._exact_storages:
            return self._keep(t, storage, _KEEP_SINGULAR)  # NOTE [ Quotients by a kept divisor ]
        if decision.treatment is Treatment.BATCH:
            self._small_bytes += t.numel() * t.element_size()
            if self._small_bytes <= SMALL_SHARE * stats.raw_bytes:  # NOTE [ Small tensors packed together ]
                return self._keep(t, storage, _KEEP_SMALL)
            return self._pack_small(t, storage, call)
        source, expand_to = t, None
        if is_expanded(t):  # NOTE [ Expanded views ] in records.py
            t, expand_to = compact_expanded(t), t.shape
        dense = is_dense(t)
        key = plain = _key(t, storage, dense)
        if decision.encoding is not None:  # NOTE [ Op-aware encodings ] in records.py
            key += (decision.encoding,)
        record = self._records.get(key)
        if record is not None and decision.encoding is None and not self._serves(record, decision):
            record = None
        if record is not None:
            self._note_shared(record)
            index = self._record_index.get(record)
            if index is not None:  # a quantized record: the policy notes which op saves it again
                self._bit_policy.assign(self.step, index, t, t, decision.min_bits, saved_again=True)
        else:
            record = self._make_record(_flat(t, dense), decision, t)
            self._records[key] = record
            if isinstance(decision.encoding, (Normalized, Probabilities)) and plain not in self._records:
                # NOTE [ A normalised record serves plain saves ]
                self._records[plain] = record
        handle = SavedHandle(record, t, dense, source, expand_to)
        if self._live_saves is not None and t.device.type == "cpu":
            self._live_saves.hold(handle)
        self._note_recent(source, record, call)
        return handle

    def _note_recent(self, t: torch.Tensor, record: Any, call: OpMatch | None) -> None:
        """Hold a small saved output of a probability's op for the saves shifted from it (``NOTE [ Every save of a
        value a singular backward reads ]``), and what ``call`` saves if it squares (``NOTE [ Saves held for a
        singular backward ]``)."""
        if type(t.grad_fn).__name__ in HELD_PRODUCERS and t.numel() * t.element_size() <= RECENT_SAVE_BYTES:
            self._recent_saves.append((t.grad_fn, record, t))
        if call is not None and call.held and t.grad_fn is not None and not any(
                r is record for _, _, r, _ in self._held_saves):  # ``x * x`` saves x twice
            self._held_saves.append((self._stats.tensors_seen, t.grad_fn, record, t))

    # NOTE [ Every save of a value a singular backward reads ]
    # A value the ``singular_backward`` rule keeps exact (``NOTE [ Singular backward ]`` in op_rules.py) is often
    # saved by the op that made it too: a sigmoid saves its output p, then binary cross-entropy (or a log) saves p
    # and divides by it. Plain PyTorch's gradients cancel between the two: ``(p - y) / (p (1 - p))`` times
    # ``p (1 - p)``. Kept exact for the one and rounded for the other, the factors no longer cancel and the error
    # is again relative to p (the log of a sigmoid's output went from cosine 1.0, both saves rounded alike, to
    # 0.97 at 8 bits with only the log's kept). So every save of those values in the forward restores them exact:
    # a record made of them earlier is restored from the kept tensor, and a later save keeps it too. The same
    # holds where the kept value is the saved one shifted or scaled by constants: ``log(softmax(x) + 1e-8)``,
    # ``log(1 - sigmoid(x) + eps)``, ``p.clamp(min=eps)`` (8 bits: 0.84 and 0.27 with the log's input alone
    # kept). Such a value is made within a few ops of the save it comes from, so the latest ``RECENT_SAVES``
    # rounded saves of a softmax's, sigmoid's, exp's or tanh's output (``HELD_PRODUCERS``: what a log or a
    # division follows) of at most ``RECENT_SAVE_BYTES`` (a loss's probabilities, not an attention's) hold their
    # tensors until that many more came (or the forward ended), and a kept value whose graph reaches the node that
    # made one of them through such ops (``SHIFTS``; a kept result through the singular op that made it,
    # ``SINGULAR_RESULTS``: ``ndtri`` of a sigmoid's output) makes that save's record exact. A larger one stays
    # rounded. Memory held longer is bounded by ``RECENT_SAVES * RECENT_SAVE_BYTES``; holding every small save instead
    # raised MiniLM + LoRA's forward peak by 14-20 MB (``benchmarks/results/singular_backward/``).
    def _keep_every_save(self, t: torch.Tensor, storage: StorageWeakRef, kept: KeptTensor,
                         call: OpMatch | None) -> None:
        for key in _keys(t, storage):
            self._exact_saves[key] = kept
            for record in (self._records.get(key), self._small_records.get(key)):
                if record is not None:
                    self._exact_records[record] = kept
        origin = reached(t.grad_fn, {node for node, _, _ in self._recent_saves}.__contains__, _THROUGH, len(SHIFTS))
        for node, record, source in self._recent_saves:
            if origin is not None and node is origin:
                self._restore_exact(record, source)
        if self._held_saves:  # NOTE [ Saves held for a singular backward ] in singular.py
            reached_held = held_inputs(t.grad_fn, {node for _, node, _, _ in self._held_saves})
            for _, node, record, source in self._held_saves:
                if node in reached_held and record not in self._exact_records:
                    self._restore_exact(record, source)
        if call is not None and call.inverts and not self._amplified_warned and after_product(t.grad_fn):
            self._amplified_warned = True  # NOTE [ Products before a singular backward ] in singular.py
            warnings.warn(
                "daftrain: the matrix a decomposition, an inverse or a solve reads (a Cholesky factor, an "
                "eigendecomposition, a log-determinant) is a product of two tensors compress stored rounded, such "
                "as a Gram or covariance matrix x @ x.T: its gradient multiplies their rounding error by up to that "
                "matrix's condition number. Compute that part outside the compress context, or under "
                "compress(bits=None)", AmplifiedRoundingWarning, stacklevel=caller_level())

    def _restore_exact(self, record: Any, source: torch.Tensor) -> None:
        """Restore ``record``, rounded already, from its held ``source`` kept exact instead."""
        self._exact_records[record] = self._keep(source, self._count_raw(source), _KEEP_SINGULAR)

    def _pack_small(self, t: torch.Tensor, storage: StorageWeakRef | None, call: OpMatch | None) -> SavedHandle:
        """A tensor under ``min_numel`` values staged into a shared record (``NOTE [ Small tensors packed together
        ]`` in ``small_tensors.py``): ``_pack``'s steps for a view that is never expanded, in fewer calls (a
        recurrent layer saves thousands of these per forward)."""
        contiguous = t.is_contiguous()
        key = _key(t, storage, contiguous)
        record = self._small_records.get(key)
        if record is not None:
            self._note_shared(record)
        else:
            self._stats.batched += 1
            record = self._small.add(t.view(-1) if contiguous else t.reshape(-1), self._encode_small)
            self._small_records[key] = record
            if record.offset == 0 and self._live_saves is not None and t.device.type == "cpu":
                self._live_saves.hold(record.batch)  # each batch once: its slices' handles hold it
        self._note_recent(t, record, call)
        return SavedHandle(record, t, contiguous, t)

    def _note_shared(self, record: Any) -> None:
        """A save served by ``record``, made earlier in this forward (``NOTE [ One decode per shared record ]``)."""
        self._stats.deduplicated += 1
        shared = self._shared.get(record)
        if shared is None:
            self._shared[record] = _SharedDecode()
        else:
            shared.uses += 1

    def _unpack(self, packed: torch.Tensor | KeptTensor | SavedHandle) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, KeptTensor):
            return packed.restore()
        packed.check_version()
        exact = self._exact_records.get(packed.record) if self._exact_records else None
        if exact is not None:  # NOTE [ Every save of a value a singular backward reads ]
            restored = exact.restore()
            restored = compact_expanded(restored) if is_expanded(restored) else restored
            return packed.restore(_flat(restored, is_dense(restored)))
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
            self._check_differentiable(packed.record)
        if self._calibration_pass is not None:
            flat = packed.record.decode()
            index = self._record_index.get(packed.record)
            encoding = self._record_encoding.get(packed.record)
            requantize = functools.partial(_requantize, group_size=self.config.group_size, encoding=encoding)
            stored = encoding.values if isinstance(encoding, ByColumns) else encoding  # what, not in which order
            quantity = stored if isinstance(stored, Derivative) else None
            bits = self._record_bits.get(packed.record)
            return packed.restore(self._calibration_pass.perturb(index, flat, requantize, quantity, bits))
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
        if self._trimmer is not None:
            self._trimmer.note(flat.numel() * flat.element_size())
        return packed.restore(flat)

    # NOTE [ A backward differentiated again ]
    # A backward that builds a graph (``create_graph=True``: a gradient penalty, a Hessian-vector product, a
    # physics-informed loss) differentiates the backward's own ops, through the tensors they restored: PyTorch
    # attaches each restored tensor to the node that made the value saved, so a rounded value's derivative is
    # taken at the rounded value, as its first derivative is. That holds for every record that restores the
    # value it saved, rounded (the clip masks' stand-ins too: a clip's second derivative is zero wherever the mask
    # is right). An activation stored as its derivative does not: the input it restores is one with that
    # derivative, folded into the interval where f' increases, and a second derivative taken there is wrong
    # wherever the input lay outside it (an in-place SiLU's Hessian-vector product: cosine 0.38 against plain
    # at 8 bits); out of place its function has no derivative at all. Such a backward raises, naming the
    # ``double_backward`` option, which leaves that rule out: those activations store their input rounded.
    def _check_differentiable(self, record: Any) -> None:
        encoding = self._record_encoding.get(record)
        stored = encoding.values if isinstance(encoding, ByColumns) else encoding
        if isinstance(stored, Derivative) and not isinstance(record, ExactRecord):
            raise UnsupportedError(DOUBLE_BACKWARD_THROUGH_DERIVATIVE)

    # -- helpers -----------------------------------------------------------------------------------
    def _keep(self, t: torch.Tensor, storage: StorageWeakRef | None, decision: Decision) -> KeptTensor:
        self._stats.kept += 1
        self._stats.kept_reasons[decision.reason] += 1
        if storage is not None and storage not in self._kept_storages:
            self._kept_storages.add(storage)
            self._stats.kept_bytes += t.untyped_storage().nbytes()
        # NOTE [ Kept tensors are detached ]
        # detach(), not t: for a saved *output*, t's grad_fn owns the saved variable, and returning t
        # itself would form a reference cycle that is never freed. Unpacking restores the grad_fn, and
        # no data is copied. The detached tensor shares t's version counter, so an in-place
        # modification after the save is still detected (``KeptTensor.restore``).
        return KeptTensor(t.detach(), t._version)

    def _make_record(self, flat: torch.Tensor, decision: Decision,
                     source: torch.Tensor | None = None) -> Record | PendingRecord:
        kind = _KINDS[decision.treatment]
        index = self._num_records
        exact = flat
        if flat.dtype in STORED_AS_FLOAT32:  # NOTE [ Double precision stored through float32 ]
            flat = flat.float()
        if decision.treatment is Treatment.QUANTIZE:
            if self.config.column_groups and source is not None:  # NOTE [ Groups down the columns ]
                decision = self._down_columns(decision, index, flat, source)
            # bits="auto" observes what the record stores (NOTE [ Derivative encoding under bits="auto" ])
            stored_as = (decision.encoding.stored if isinstance(decision.encoding, (Derivative, ByColumns))
                         else None)
            assignment = self._bit_policy.assign(self.step, index, source, flat, decision.min_bits,
                                                 stored_as=stored_as)
        else:  # bool masks, integers and constants: stored exactly (encode ignores the bits), pooled by position
            assignment = Assignment(1, float(index))
        self._num_records += 1
        constant_at = None
        if decision.treatment is Treatment.QUANTIZE_IF_LOSSLESS:
            constant_at = (index, (tuple(flat.shape), flat.dtype, flat.device))
        if assignment.bits is None:  # bits="auto" found this tensor worth its full bytes: kept exact
            record: Record | PendingRecord = ExactRecord(exact, "auto")
            self._account(self._stats, record)
        elif constant_at is not None and self._not_lossless.known(self.step, *constant_at):
            record = ExactRecord(exact, "constant")
            self._account(self._stats, record)
        else:
            record = self._encode(flat, decision, kind, assignment, index, constant_at,
                                  exact if exact is not flat else None)
        if decision.treatment is Treatment.QUANTIZE:  # what later saves of it, and calibrate(), read
            self._record_index[record] = index
            if assignment.bits is not None:
                self._record_bits[record] = assignment.bits
            if decision.encoding is not None:  # calibration perturbs it as the encoding stores it
                self._record_encoding[record] = decision.encoding
        return record

    def _encode_small(self, flat: torch.Tensor) -> Record | PendingRecord:
        """Pack a staging buffer of small tensors as one record at ``SMALL_BITS`` (``NOTE [ Small tensors packed
        together ]`` in ``small_tensors.py``)."""
        index = self._num_records
        self._num_records += 1
        return self._encode(flat, _QUANTIZE_SMALL, "quantize", Assignment(self._small_bits, float(index)), index)

    def _down_columns(self, decision: Decision, index: int, flat: torch.Tensor, source: torch.Tensor) -> Decision:
        """``decision`` with its groups down the columns where ``ColumnChoice`` finds them clearly narrower: plain
        values, a derivative, a softmax's output, or a row normalisation's x_hat (``NOTE [ Normalised values down
        the columns ]``)."""
        encoding = decision.encoding
        if encoding is None or isinstance(encoding, Derivative):
            layout = self._column_choice.layout(self.step, index, flat, source, encoding)
            return decision if layout is None else dataclasses.replace(decision, encoding=layout)
        if isinstance(encoding, Probabilities):  # plain values, restored with their rows' sums
            layout = self._column_choice.layout(self.step, index, flat, source, None)
            return decision if layout is None else dataclasses.replace(
                decision, encoding=dataclasses.replace(encoding, columns=layout))
        down = encoding.down_columns(source.shape[-1]) if isinstance(encoding, Normalized) and source.dim() else None
        if down is None or self._column_choice.layout(self.step, index, flat, source, None) is None:
            return decision
        return dataclasses.replace(decision, encoding=down)

    def compiled_grid(self, position: int, values: torch.Tensor, bits: int) -> torch.Tensor | None:
        """The fitted grid of the record a compiled graph packs at its saved-value ``position`` in this step, or
        ``None`` for the uniform grid (``NOTE [ Fitted grids in compiled graphs ]`` in compiled.py)."""
        if self._grid_choice is None:
            return None
        return self._grid_choice.grid(self.step, _COMPILED_RECORDS + position, values, bits)

    def compiled_seed(self) -> int:
        """The seed of the next record a compiled graph packs in this step (``NOTE [ A fresh seed per compiled call ]``
        in compiled.py): hashed as an eager record's, its index counted apart from theirs."""
        return record_seed(self._base_seed, self.step, _COMPILED_RECORDS + next(self._compiled_records))

    # NOTE [ Double precision stored through float32 ]
    # The kernels quantize float32, float16 and bfloat16 (``layout.QUANTIZABLE_DTYPES``). A float64 activation (a
    # physics-informed network, scientific code trained in double precision) was kept whole: compress stored
    # nothing smaller, at any bits. Its record is made from a float32 copy, and its handle restores the decoded
    # values as float64: rounding to a group's grid errs a value by the group's range / 2**bits, to which
    # float32's relative precision (6e-8) adds nothing measurable at any supported bit-width. A value beyond
    # float32's range is an infinity in the copy, which fails the record's finiteness check like a NaN does
    # (``NOTE [ Non-finite activations ]`` in records.py): what is kept then is the float64 tensor itself. A tensor
    # whose values are all tiny (``decide.FLOAT32_SMALLEST_RANGE``), whose groups' steps would be subnormal there,
    # is kept whole by ``decide``.
    def _encode(self, flat: torch.Tensor, decision: Decision, kind: str, assignment: Assignment,
                index: int, constant_at: tuple[int, Any] | None = None,
                exact: torch.Tensor | None = None) -> Record | PendingRecord:
        """Pack ``flat`` at the assignment's bits, here or on the packer thread, into the pool if there is one;
        ``exact`` is kept instead where a check fails (``flat`` by default)."""
        seed = record_seed(self._base_seed, self.step, index)
        grids = None if self._grid_choice is None else functools.partial(self._grid_choice.grid, self.step, index)
        job = functools.partial(encode, kind=kind, bits=assignment.bits, group_size=self.config.group_size,
                                seed=seed, encoding=decision.encoding, grids=grids, exact=exact)
        if self.pool is not None:  # NOTE [ Importance of a record in the pool ] in auto/policy.py
            job = functools.partial(_encode_into_pool, job, pool=self.pool, importance=assignment.importance,
                                    seed=seed)
        if self._packer is None:
            record = job(flat)
            if isinstance(record, UndecidedRecord):
                self._account_settled(self._settling.add(record, (self._stats, self.step, constant_at)))
            else:
                self._account(self._stats, record, self.step, constant_at)
            return record
        pending = self._packer.submit(flat, job)
        stats, step = self._stats, self.step
        pending.future.add_done_callback(
            lambda f: f.exception() is None and self._account(stats, f.result(), step, constant_at))
        return pending

    def _account_settled(self, settled: list[tuple[Record, tuple[CompressionStats, int, Any]]]) -> None:
        for record, (stats, step, constant_at) in settled:
            self._account(stats, record, step, constant_at)

    # NOTE [ Constants found not lossless ]
    # A constant (a tensor outside the differentiable graph: ``NOTE [ Constants are stored losslessly or
    # kept ]`` in decide.py) is stored at 1 bit only where every group is constant or zero plus one value,
    # which takes a reduction over it, a candidate record and a check per step. Where a forward position's
    # constant failed the check, its later ones of the same shape are kept without it for
    # ``REESTIMATE_STEPS`` steps (a normalisation's mean and rstd, a frozen layer's input: the same kind of
    # values every step). Were one of them lossless after all, it would be kept exact: memory, never accuracy.
    def _account(self, stats: CompressionStats, record: Record | UndecidedRecord, step: int = -1,
                 constant_at: tuple[int, Any] | None = None) -> None:
        if isinstance(record, UndecidedRecord):  # made on the packer thread: waiting there holds no step up
            record = record.settle()
        with self._stats_lock:
            if constant_at is not None and isinstance(record, ExactRecord):
                self._not_lossless.note(step, *constant_at, True)
            if isinstance(record, ExactRecord):
                stats.kept += 1
                stats.kept_reasons[record.reason] += 1
                stats.kept_bytes += record.nbytes
            else:
                integer = isinstance(record, (IntegerRecord, PoolWindowsRecord))
                stats.compressed += not (record.is_bool or integer)
                stats.fitted_grids += on_fitted_grid(record)
                stats.bool_packed += record.is_bool
                stats.integer_packed += integer
                stats.packed_bytes += record.nbytes

    # -- bits="auto" ------------------------------------------------------------------------------
    def report(self) -> AllocationReport | None:
        """``bits="auto"``: each saved tensor's importance and bits; ``str()`` is a table, ``.to_json()``
        JSON. ``None`` until the first step's backward has run, or with fixed bits."""
        return self._bit_policy.report()

    def calibrate(self, loss: torch.Tensor) -> dict[str, float]:
        """``bits="auto"``: measure how much gradient variance each class of saved tensors really adds,
        with one extra backward pass per class on this step's graph, and correct the importance
        estimate (and the allocation in force) by it; see ``NOTE [ Calibration ]`` in ``calibration.py``.

        Call it between the forward (under this context) and ``loss.backward()``, on a step after the
        first one, every few hundred steps (each call costs a backward per class). Needs ``model``.
        Returns each measured class's correction factor; ``ctx.report()`` shows them.
        """
        return calibrate(self._bit_policy, loss, step=self.step, group_size=self.config.group_size,
                         base_seed=self._base_seed, install=self._install_calibration_pass)

    def _install_calibration_pass(self, calibration_pass: CalibrationPass | None) -> None:
        self._calibration_pass = calibration_pass

    def state_dict(self) -> dict[str, Any]:
        """The step counter and (``bits="auto"``) the bit allocation and its estimates, as plain Python
        values, so that a resumed run decides the same bits. Call it between steps."""
        return self._bit_policy.state_dict(self.step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a state from another model or config, or a corrupted one, raises
        ``StateDictError`` and changes nothing."""
        self.step = self._bit_policy.load_state_dict(state)

    def close(self) -> None:
        """Stop the packer thread (asynchronous mode); the context cannot pack afterwards."""
        if self._packer is not None:
            self._packer.close()


def _requantize(flat: torch.Tensor, bits: int, seed: int, *, group_size: int,
                encoding: Encoding | None) -> torch.Tensor:
    """``flat`` stored at ``bits`` the way a record with ``encoding`` stores it, and restored."""
    return encode(flat, "quantize", bits, group_size, seed, encoding).decode()


_SINGULAR_KEEPS = frozenset({"singular_backward", "decomposed_rms_norm"})
"""Rules whose kept values are read with every save of them (an RMSNorm written out keeps ``rsqrt``'s result)."""

_THROUGH = SHIFTS | SINGULAR_RESULTS
"""What a kept value is walked back through to the recent saves it is read with (``NOTE [ Every save of a value a
singular backward reads ]``)."""


# NOTE [ Quotients by a kept divisor ]
# An elementwise division keeps its divisor and dividend exact (``NOTE [ Singular backward ]`` in op_rules.py),
# and its quotient has no bounded range: where the divisor is small the quotient is large (a standardised
# residual ``(x - loc) / scale`` under a learned scale), and a later op that saves it (its square, in a Cauchy's,
# a Student-t's or a hand-written Gaussian's log-likelihood) rounds every value by a step set by the largest:
# Cauchy.log_prob 0.92, StudentT 0.97 at 8 bits. Such a quotient's storage is noted when the call returns (in a
# set the tracer holds without the context: ``NOTE [ No reference cycle ]``), and a save of it later in the
# forward is kept exact.
def _note_storage(storages: set[StorageWeakRef], out: torch.Tensor) -> None:
    """Add ``out``'s storage to ``storages`` (``NOTE [ Quotients by a kept divisor ]``)."""
    if has_storage(out):
        storages.add(StorageWeakRef(out.untyped_storage()))


def _encode_into_pool(job: functools.partial[Record], flat: torch.Tensor, *, pool: PagePool, importance: float,
                      seed: int) -> Record:
    return job(flat).to_pool(pool, importance, seed)


_QUANTIZE_SMALL = Decision(Treatment.QUANTIZE, "")
_KEEP_SMALL = Decision(Treatment.KEEP, "tiny")
_KEEP_SINGULAR = Decision(Treatment.KEEP, "op_rule", rule="singular_backward")
_KEEP_CHECKPOINT_INPUT = Decision(Treatment.KEEP, "checkpoint")
_KEEP_CUSTOM_FUNCTION = Decision(Treatment.KEEP, "custom_function")
_ROUNDED = (Treatment.QUANTIZE, Treatment.BATCH)
_KINDS = {Treatment.QUANTIZE: "quantize", Treatment.QUANTIZE_IF_LOSSLESS: "lossless", Treatment.PACK_BOOL: "bool",
          Treatment.PACK_INTEGER: "integer"}


def _is_daftrains(function: type | str) -> bool:
    """Whether a custom Function is one of daftrain's own, whose saves its rules chose to be quantized."""
    return getattr(function, "__module__", "").startswith("daftrain.")


def _key(t: torch.Tensor, storage: StorageWeakRef | None, whole: bool) -> _Key:
    """The dedup key of a save of ``t``: its storage span, with its shape and strides where the span is not
    ``whole`` (holds other values than ``t``'s, or in another order)."""
    key: _Key = (storage, t.dtype, t._version, t.storage_offset(), t.numel())
    return key if whole else (*key, tuple(t.shape), t.stride())


def _keys(t: torch.Tensor, storage: StorageWeakRef) -> tuple[_Key, ...]:
    """The dedup keys ``_pack`` and ``_pack_small`` would file a save of ``t`` under."""
    compact = compact_expanded(t) if is_expanded(t) else t
    packed, small = _key(compact, storage, is_dense(compact)), _key(t, storage, t.is_contiguous())
    return (packed,) if packed == small else (packed, small)


def _flat(t: torch.Tensor, dense: bool) -> torch.Tensor:
    """``t`` (never expanded) as ``_pack`` packs it, the region a ``SavedHandle`` restores its view from."""
    return t.as_strided((t.numel(),), (1,)) if dense else t.contiguous().view(-1)
