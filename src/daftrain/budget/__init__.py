"""Training within a process memory budget: budgets and their readers, memory meters, batches and
model segments, probing, the planner and ``BudgetedStep``."""

from .batching import token_count
from .budgets import Budget, BudgetError, BudgetTooSmallError
from .planner import Plan, PlannerConfig
from .segments import batchnorm_to_groupnorm
from .step import BudgetedStep

__all__ = [
    "Budget", "BudgetError", "BudgetTooSmallError", "BudgetedStep", "Plan", "PlannerConfig",
    "batchnorm_to_groupnorm", "token_count",
]
