"""Counters of what one compressed forward pass saved, and the process's peak memory next to them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..rss import peak_rss_bytes


@dataclass
class CompressionStats:
    """What the hooks saw during the last forward pass of a ``compress`` context.

    Byte counts are over unique storages (plain PyTorch) and unique records (daftrain), parameters
    left out of both since the model holds them anyway.
    """

    tensors_seen: int = 0
    """Pack calls, parameters included."""
    parameters: int = 0
    """Saved tensors recognised as parameters (kept, not counted in bytes)."""
    compressed: int = 0
    """Float regions quantized (unique records)."""
    fitted_grids: int = 0
    """Of those, records on a fitted grid (``NOTE [ Fitted grids ]`` in ``kernels/grids.py``)."""
    bool_packed: int = 0
    """Bool regions stored at 1 bit per value (unique records)."""
    batched: int = 0
    """Float tensors under ``min_numel`` values stored in records shared with other small ones (each such record
    counts once in ``compressed``; ``NOTE [ Small tensors packed together ]`` in ``small_tensors.py``)."""
    integer_packed: int = 0
    """Integer regions (indices) stored in a narrower integer type, losslessly (unique records)."""
    deduplicated: int = 0
    """Pack calls served by a record made earlier in the same pass (same storage span and version)."""
    kept: int = 0
    """Non-parameter tensors kept exact; ``kept_reasons`` says why."""
    raw_bytes: int = 0
    """Bytes plain PyTorch would hold for the non-parameter saved tensors (unique storages)."""
    packed_bytes: int = 0
    """Bytes of daftrain's packed records."""
    kept_bytes: int = 0
    """Bytes of the tensors daftrain kept exact (unique storages)."""
    peak_pending_bytes: int = 0
    """Asynchronous mode: the most raw bytes waiting for the packer at one time (held until packed)."""
    compiled_graphs: int = 0
    """Graphs ``torch.compile`` compiled under this context's settings in this process (each recompilation,
    e.g. for new shapes, adds one); the ``compiled_*`` counts below add up their saved tensors, as recorded
    when each graph was compiled (``NOTE [ Hooks inside compiled graphs ]`` in ``compiled.py``)."""
    compiled_saved: int = 0
    """Saved intermediates the compiled graphs offered to the hooks (inputs and parameters are not)."""
    compiled_quantized: int = 0
    """Of those, float tensors each call of the compiled graphs stores quantized."""
    compiled_bool_packed: int = 0
    """Of those, bool tensors stored at 1 bit per value."""
    compiled_raw_bytes: int = 0
    """Bytes of ``compiled_saved`` in plain PyTorch, per call of every compiled graph."""
    compiled_stored_bytes: int = 0
    """Bytes the compiled graphs store for them instead."""
    kept_reasons: Counter[str] = field(default_factory=Counter)
    by_dtype: Counter[str] = field(default_factory=Counter)
    """Pack calls per dtype."""
    peak_rss_bytes: int = 0
    """The process's peak resident memory when ``ctx.stats`` was last read (so, read after backward, it
    includes backward): ``VmHWM`` on Linux, which ``/proc/self/clear_refs`` resets, else ``ru_maxrss``.
    What a user sees in ``top`` and what an OOM killer acts on; 0 until read."""
    peak_cuda_allocated_bytes: int = 0
    """``torch.cuda.max_memory_allocated()`` of the current device when ``ctx.stats`` was last read (since
    the last ``torch.cuda.reset_peak_memory_stats``); 0 where CUDA is not initialised."""
    peak_cuda_reserved_bytes: int = 0
    """``torch.cuda.max_memory_reserved()`` likewise: what PyTorch's caching allocator held at its peak."""

    def read_peak_memory(self) -> None:
        """Set the ``peak_*`` fields from the process's counters now (``ctx.stats`` calls it)."""
        self.peak_rss_bytes = peak_rss_bytes()
        if torch.cuda.is_initialized():
            self.peak_cuda_allocated_bytes = torch.cuda.max_memory_allocated()
            self.peak_cuda_reserved_bytes = torch.cuda.max_memory_reserved()

    @property
    def stored_bytes(self) -> int:
        """Bytes daftrain holds for backward: packed records plus tensors kept exact."""
        return self.packed_bytes + self.kept_bytes

    @property
    def ratio(self) -> float:
        """``raw_bytes / stored_bytes``: how many times less memory the saved activations take."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def summary(self) -> str:
        """One line: what was saved and how, the bytes before and after, and the process's peak memory."""
        return (
            f"saved tensors: {self.tensors_seen} seen, {self.compressed} quantized ({self.fitted_grids} on fitted "
            f"grids), {self.batched} small packed together, {self.bool_packed} bool-packed, "
            f"{self.deduplicated} deduplicated, {self.kept} kept ({dict(self.kept_reasons)}), "
            f"{self.parameters} parameters; {self.raw_bytes / 1e6:.2f} MB -> {self.stored_bytes / 1e6:.2f} MB "
            f"({self.ratio:.1f}x)" + (
                f"; compiled graphs: {self.compiled_graphs}, {self.compiled_quantized} of {self.compiled_saved} "
                f"saved tensors quantized, {self.compiled_bool_packed} bool-packed, "
                f"{self.compiled_raw_bytes / 1e6:.2f} MB -> {self.compiled_stored_bytes / 1e6:.2f} MB"
                if self.compiled_graphs else "")
            + (f"; process peak: RSS {self.peak_rss_bytes / 1e6:.0f} MB" if self.peak_rss_bytes else "")
            + (f", CUDA {self.peak_cuda_allocated_bytes / 1e6:.0f} MB allocated "
               f"({self.peak_cuda_reserved_bytes / 1e6:.0f} MB reserved)" if self.peak_cuda_reserved_bytes else "")
        )
