"""The importance-aware paged memory pool that packed records can live in."""

from .config import PoolConfig, PoolStats, RecordState
from .errors import PoolBudgetError, PoolError
from .growth import AdaptiveGrowth, Demand, FixedGrowth, GrowthPolicy, TrackingGrowth
from .record import PooledRecord
from .store import PagePool

__all__ = [
    "AdaptiveGrowth", "Demand", "FixedGrowth", "GrowthPolicy", "PagePool", "PoolBudgetError", "PoolConfig",
    "PoolError", "PoolStats", "PooledRecord", "RecordState", "TrackingGrowth",
]
