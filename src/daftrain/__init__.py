"""daftrain: train deep networks in far less memory, with no model rewrite.

Every activation autograd saves for backward is stored quantized per group and bit-packed::

    import daftrain
    with daftrain.compress(bits=2) as ctx:
        loss = loss_fn(model(x), y)
    loss.backward()
    print(ctx.stats.ratio)
"""

from .auto import AllocationError, AllocationReport, QuantizationVarianceWarning, StateDictError
from .budget import (
    Budget,
    BudgetedStep,
    BudgetError,
    BudgetTooSmallError,
    Plan,
    PlannerConfig,
    batchnorm_to_groupnorm,
    token_count,
)
from .config import CompressionConfig
from .errors import ArgumentTypeError, DaftrainError, InvalidArgumentError, UnsupportedError
from .kernels import load_fast_kernels as _load_fast_kernels
from .kernels import ops as _ops  # registers the daftrain:: custom ops
from .layout import LayoutError, PackedLayout
from .pool import AdaptiveGrowth, FixedGrowth, PagePool, PoolBudgetError, PoolConfig, PoolError, TrackingGrowth
from .saved import (
    AmplifiedRoundingWarning,
    CompileFallbackWarning,
    CompressionStats,
    CustomFunctionWarning,
    InPlaceModificationError,
    RecomputationMismatchError,
    checkpoint,
    compress,
)

__version__ = "0.1.0"

del _ops
_load_fast_kernels()  # numba on CPU, Triton on CUDA; the reference where they cannot load (one warning)

__all__ = [
    "AdaptiveGrowth",
    "AllocationError",
    "AllocationReport",
    "AmplifiedRoundingWarning",
    "ArgumentTypeError",
    "Budget",
    "BudgetError",
    "BudgetTooSmallError",
    "BudgetedStep",
    "CompileFallbackWarning",
    "CompressionConfig",
    "CompressionStats",
    "CustomFunctionWarning",
    "DaftrainError",
    "FixedGrowth",
    "InPlaceModificationError",
    "InvalidArgumentError",
    "LayoutError",
    "PackedLayout",
    "PagePool",
    "Plan",
    "PlannerConfig",
    "PoolBudgetError",
    "PoolConfig",
    "PoolError",
    "QuantizationVarianceWarning",
    "RecomputationMismatchError",
    "StateDictError",
    "TrackingGrowth",
    "UnsupportedError",
    "__version__",
    "batchnorm_to_groupnorm",
    "checkpoint",
    "compress",
    "token_count",
]
