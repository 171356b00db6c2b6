"""daftrain: train deep networks in far less memory, with no model rewrite.

Every activation autograd saves for backward is stored quantized per group and bit-packed::

    import daftrain
    with daftrain.compress(bits=2) as ctx:
        loss = loss_fn(model(x), y)
    loss.backward()
    print(ctx.stats.ratio)
"""

from . import ops  # noqa: F401  (registers the daftrain:: custom ops)
from .kernels.registry import load_fast_kernels as _load_fast_kernels
from .allocation import AllocationError
from .budget import Budget, BudgetError, BudgetTooSmallError
from .budgeted_step import BudgetedStep, batchnorm_to_groupnorm, token_count
from .config import CompressionConfig
from .hooks import compress
from .importance import AllocationReport, QuantizationVarianceWarning, StateDictError
from .layout import LayoutError, PackedLayout
from .planner import Plan, PlannerConfig
from .pool import PagePool, PoolBudgetError, PoolConfig
from .stats import CompressionStats

__version__ = "0.1.0"

_load_fast_kernels()  # numba on CPU, Triton on CUDA; the reference where they cannot load (one warning)

__all__ = [
    "AllocationError",
    "AllocationReport",
    "Budget",
    "BudgetError",
    "BudgetTooSmallError",
    "BudgetedStep",
    "CompressionConfig",
    "CompressionStats",
    "LayoutError",
    "PackedLayout",
    "PagePool",
    "Plan",
    "PlannerConfig",
    "PoolBudgetError",
    "PoolConfig",
    "QuantizationVarianceWarning",
    "StateDictError",
    "__version__",
    "batchnorm_to_groupnorm",
    "compress",
    "token_count",
]
