"""The importance-aware paged memory pool that packed records can live in."""

from .store import (
    AdaptiveStep,
    Demand,
    FixedStep,
    PagePool,
    PoolBudgetError,
    PoolConfig,
    PooledRecord,
    PoolError,
    PoolStats,
    RecordState,
    StepPolicy,
    TrackingStep,
)

__all__ = [
    "AdaptiveStep", "Demand", "FixedStep", "PagePool", "PoolBudgetError", "PoolConfig", "PoolError", "PoolStats",
    "PooledRecord", "RecordState", "StepPolicy", "TrackingStep",
]
