"""Memory a step uses: per-phase peak meters (RSS from ``rss.py``, CUDA), the bytes a step will still
allocate, and a counter of the bytes autograd saves for backward.

Meters and counters keep their state on the instance.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..allocator import malloc_trim
from ..callbacks import uncompiled
from ..errors import UnsupportedError
from ..params import ParameterRegistry, is_parameter_or_view
from ..rss import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from ..saved.records import check_version

__all__ = [
    "CudaMeter",
    "RssMeter",
    "SavedBytesCounter",
    "format_bytes",
    "meter_for",
    "missing_grad_bytes",
    "missing_state_bytes",
]

_SI_UNITS = ("kB", "MB", "GB", "TB")


def format_bytes(n: int | float, *, round_up: bool = False) -> str:
    """Human-readable size with decimal SI units (1 kB = 1e3 B, 1 MB = 1e6 B): ``"12.3 MB"``.

    Rounded to the nearest tenth of the unit, or with ``round_up=True`` up (away from zero) to a
    figure at least as large as ``n``, so that a budget written as the text covers ``n``.
    """
    if round_up:
        return _format_bytes_up(n)
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 1000:
        return f"{sign}{int(value)} B"
    for unit in _SI_UNITS[:-1]:
        value /= 1000.0
        if value < 999.95:
            return f"{sign}{value:.1f} {unit}"
    return f"{sign}{value / 1000.0:.1f} {_SI_UNITS[-1]}"  # the last unit takes any larger value


def _format_bytes_up(n: int | float) -> str:
    sign = "-" if n < 0 else ""
    b = math.ceil(abs(n))
    if b < 1000:
        return f"{sign}{b} B"
    for k, unit in enumerate(_SI_UNITS, start=1):
        tenths = -(-b // 10 ** (3 * k - 1))  # integer arithmetic: no float rounding down
        if tenths <= 9999 or unit == _SI_UNITS[-1]:  # the last unit takes any larger value
            break
    return f"{sign}{tenths // 10}.{tenths % 10} {unit}"


# -- meters ------------------------------------------------------------------------------------------

# NOTE [ Phase peaks and the process peak ]
# Reading the peak of one phase (probe, accumulation, optimizer step) needs the high-water mark reset
# at its start (``/proc/self/clear_refs`` on CPU, ``reset_peak_memory_stats`` on CUDA), which also
# resets what the process-wide peak reports. A meter therefore reads the mark before every reset and
# keeps the maximum in ``process_peak``, so no moment of the process is missed.
#
# NOTE [ What a trim costs ]
# Handing pages back to the OS costs the kernel time per page, and every page handed back is faulted in
# and zeroed by the next allocation that lands on it, so a trim costs about as much as freeing and
# touching that many fresh pages. The meter measures it once, right after a trim, on a block (16 MiB, or
# a quarter of the headroom where that is less): freshly mapped or from the trimmed heap (its free pages
# were just handed back), its first write pays the faults and its second does not; that
# difference plus the time to free it, per byte, is the planner's price of a trim (NOTE [ The cost
# model ] in planner.py). Three rounds, the median, against a noisy machine.
REFAULT_BLOCK_BYTES = 16 << 20
_REFAULT_ROUNDS = 3
_PAGE_BYTES = 4096


class RssMeter:
    """Per-phase peaks of this process's RSS, and the process-lifetime peak across resets."""

    def __init__(self) -> None:
        self.process_peak = peak_rss_bytes()
        self.resettable = True

    def start(self, *, trim: bool = True) -> int:
        """Begin a phase: reset the peak (returning freed heap memory first, with ``trim``); return the
        memory held now."""
        self.process_peak = max(self.process_peak, peak_rss_bytes())
        self.resettable = reset_peak_rss(trim=trim)
        return current_rss_bytes()

    def peak(self) -> int:
        """Peak since the phase began."""
        p = peak_rss_bytes()
        self.process_peak = max(self.process_peak, p)
        return p

    def lifetime_peak(self) -> int:
        """Peak of the whole process so far."""
        return max(self.process_peak, peak_rss_bytes())

    def current(self) -> int:
        """The memory held now."""
        return current_rss_bytes()

    def release(self) -> None:
        """Return the allocator's free memory to the OS (the peak is kept)."""
        malloc_trim()

    def refault_cost(self, block_bytes: int = REFAULT_BLOCK_BYTES) -> float:
        """Seconds per byte to hand memory back to the OS and fault it in again, measured on a block of
        ``block_bytes`` (NOTE [ What a trim costs ]); 0 for a block under a page."""
        if block_bytes < _PAGE_BYTES:
            return 0.0
        malloc_trim()
        costs = []
        for _ in range(_REFAULT_ROUNDS):
            t0 = time.perf_counter()
            buf = torch.empty(block_bytes, dtype=torch.uint8, device="cpu")
            buf.fill_(1)
            t1 = time.perf_counter()
            buf.fill_(2)
            t2 = time.perf_counter()
            del buf
            malloc_trim()
            t3 = time.perf_counter()
            costs.append((max(0.0, (t1 - t0) - (t2 - t1)) + (t3 - t2)) / block_bytes)
        return statistics.median(costs)




class CudaMeter:
    """The same for a CUDA device: memory reserved by PyTorch's caching allocator (what the device
    sees this process hold, less the CUDA context)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.process_peak = torch.cuda.max_memory_reserved(device)
        self.resettable = True

    def start(self, *, trim: bool = True) -> int:
        """Begin a phase: release cached blocks (with ``trim``), reset the peak; return the memory
        reserved now."""
        self.process_peak = max(self.process_peak, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.synchronize(self.device)
        if trim:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_reserved(self.device)

    def peak(self) -> int:
        """Peak since the phase began."""
        torch.cuda.synchronize(self.device)
        p = torch.cuda.max_memory_reserved(self.device)
        self.process_peak = max(self.process_peak, p)
        return p

    def lifetime_peak(self) -> int:
        """Peak of the whole process so far."""
        return max(self.process_peak, torch.cuda.max_memory_reserved(self.device))

    def current(self) -> int:
        """The memory reserved now."""
        return torch.cuda.memory_reserved(self.device)

    def release(self) -> None:
        """Release the caching allocator's free blocks (the peak is kept)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def refault_cost(self, block_bytes: int = REFAULT_BLOCK_BYTES) -> float:
        """0: released blocks cost a ``cudaMalloc`` per block when allocated again, not a price per byte
        that the planner's trim cost models."""
        return 0.0


def meter_for(device: torch.device) -> RssMeter | CudaMeter:
    """The meter of the memory a budget on ``device`` counts: device memory on CUDA, RSS otherwise."""
    return CudaMeter(device) if device.type == "cuda" else RssMeter()


# -- what a step will still allocate -----------------------------------------------------------------

_STATE_FACTORS: dict[str, float] = {
    "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "Adadelta": 2, "ASGD": 2,
    "Rprop": 2, "LBFGS": 4,
}


def _optimizer_state_factor(opt: torch.optim.Optimizer) -> float:
    """Optimizer state per parameter byte (Adam: 2, SGD with momentum: 1)."""
    name = type(opt).__name__
    group = opt.param_groups[0] if opt.param_groups else {}
    if name == "SGD":
        return 1.0 if group.get("momentum", 0) else 0.0
    if name == "RMSprop":
        return 1.0 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    if name in ("Adam", "AdamW") and group.get("amsgrad", False):
        return 3.0
    return _STATE_FACTORS.get(name, 2.0)  # unknown optimizers: assume two states, like Adam


def missing_grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients ``model``'s trainable parameters do not hold yet."""
    return sum(p.nbytes for p in model.parameters() if p.requires_grad and p.grad is None)


def missing_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Gradients and optimizer state a training step will allocate but the process does not hold yet."""
    factor = _optimizer_state_factor(optimizer)
    state = sum(p.nbytes for g in optimizer.param_groups for p in g["params"]
                if p.requires_grad and not optimizer.state.get(p))
    return missing_grad_bytes(model) + int(factor * state)


# -- saved bytes -------------------------------------------------------------------------------------

class SavedBytesCounter(torch.autograd.graph.saved_tensors_hooks):
    """Count what autograd saves for backward inside the ``with`` block.

    Each saved tensor is attributed to its storage; a storage shared by several
    saved tensors (e.g. an input saved by two ops, or views) is counted once.
    Left out: ``nn.Parameter`` objects and views of them, the storages of
    ``model``'s parameters and buffers (``ParameterRegistry``), and the storages
    of the tensors in ``exclude`` (e.g. ``model.buffers()``).

    Args:
        model: leave out the storages of its parameters and buffers.
        exclude: further tensors whose storages are left out.
        dropping: keep nothing: the forward holds no activations (its peak is
            the working set alone) and cannot be back-propagated. Without it,
            what plain PyTorch saves is kept as is.

    Attributes:
        saved_bytes: sum of ``nbytes`` over the unique counted storages.
        num_tensors: number of counted (non-parameter) saved tensors, with
            repeats, i.e. how many times the pack hook kept an activation.
        num_storages: number of unique counted storages.
        num_skipped: saved tensors left out as parameters / excluded.

    Only the innermost ``saved_tensors_hooks`` context is active, so nesting
    another saved-tensor hook inside this one hides those tensors from it.
    """

    # NOTE [ Which saved tensors are parameters here ]
    # Rules 1 and 2 of NOTE [ Recognising parameters ] (params.py), not ``is_parameter_like``: its rules 3
    # and 4 treat every leaf that requires grad (and casts or views of one) as a parameter, so an input
    # made with ``requires_grad=True`` would go uncounted although autograd keeps it for backward.

    def __init__(self, *, model: nn.Module | None = None, exclude: Iterable[torch.Tensor] = (),
                 dropping: bool = False) -> None:
        # NOTE [ Keying by StorageWeakRef ]
        # The key is the StorageImpl pointer wrapped in a weak reference. Holding
        # the weak reference keeps the StorageImpl object itself allocated (only
        # its data can be freed), so its address cannot be reused by a new
        # storage while we hold the key: a freed-and-reallocated buffer is never
        # mistaken for one already counted. The weak ref does not keep data alive.
        self._storages: dict[StorageWeakRef, int] = {}
        self._registry = ParameterRegistry(model)
        self._excluded = {StorageWeakRef(t.untyped_storage()) for t in exclude}
        self._extra_bytes = 0  # tensors without a storage (e.g. sparse)
        self.dropping = dropping
        self.num_tensors = 0
        self.num_skipped = 0
        # run eagerly where Dynamo would trace them (a compiled model's custom Function saving; NOTE [ Planning a
        # compiled model ] in step.py): traced, they built storage references of fake tensors
        super().__init__(uncompiled(self._pack), uncompiled(self._unpack_dropped if dropping else self._unpack))

    @property
    def saved_bytes(self) -> int:
        """Bytes of unique storages kept alive for backward."""
        return sum(self._storages.values()) + self._extra_bytes

    @property
    def num_storages(self) -> int:
        """Number of unique storages counted."""
        return len(self._storages)

    def _kept(self, t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        # NOTE [ Pack returns t.detach() ]
        # We keep exactly what plain PyTorch keeps: the same storage, no copy.
        # ``detach()`` rather than ``t`` itself because for a saved *output* the
        # tensor's grad_fn owns this SavedVariable; returning ``t`` would make a
        # reference cycle that is never reclaimed when backward is not run (or
        # retain_graph=True). PyTorch restores grad_fn on unpack, so detaching
        # is lossless (it is what PyTorch itself stores for saved outputs). The version is kept
        # beside it: autograd's own check of in-place modification does not run on hooked tensors.
        return None if self.dropping else (t.detach(), t._version)

    def _pack(self, t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        if is_parameter_or_view(t):
            self.num_skipped += 1
            return self._kept(t)
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            # Sparse / storage-less tensors: count their logical size, no dedup.
            self.num_tensors += 1
            self._extra_bytes += t.numel() * t.element_size()
            return self._kept(t)
        ref = StorageWeakRef(storage)
        if ref in self._excluded or self._registry.holds(t):
            self.num_skipped += 1
        else:
            self.num_tensors += 1
            if ref not in self._storages:
                self._storages[ref] = storage.nbytes()
        return self._kept(t)

    @staticmethod
    def _unpack(kept: tuple[torch.Tensor, int]) -> torch.Tensor:
        tensor, version = kept
        check_version(tensor, version)
        return tensor

    @staticmethod
    def _unpack_dropped(_: None) -> torch.Tensor:
        raise UnsupportedError("SavedBytesCounter(dropping=True) kept no saved tensor, so its forward cannot be "
                               "back-propagated; count with dropping=False to run backward")

    def __enter__(self) -> SavedBytesCounter:
        super().__enter__()
        return self

    def __repr__(self) -> str:
        return (
            f"SavedBytesCounter(saved_bytes={self.saved_bytes} ({format_bytes(self.saved_bytes)}), "
            f"num_tensors={self.num_tensors}, num_storages={self.num_storages}, "
            f"num_skipped={self.num_skipped}, dropping={self.dropping})"
        )
