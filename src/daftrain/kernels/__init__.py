"""daftrain's kernels: ``torch.library`` ops (``ops.py``) whose pure PyTorch reference (``reference.py``)
is the spec, with fast kernels per device registered beside it (``registry.py``)."""

from .registry import kernel_report, load_fast_kernels

__all__ = ["kernel_report", "load_fast_kernels"]
