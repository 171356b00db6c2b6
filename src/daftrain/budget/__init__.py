"""Training within a process memory budget: budgets and their readers, memory meters, the planner and
``BudgetedStep``."""

from .budgets import Budget, BudgetError, BudgetTooSmallError
from .planner import Plan, PlannerConfig
from .step import BudgetedStep, batchnorm_to_groupnorm, token_count

__all__ = [
    "Budget", "BudgetError", "BudgetTooSmallError", "BudgetedStep", "Plan", "PlannerConfig",
    "batchnorm_to_groupnorm", "token_count",
]
