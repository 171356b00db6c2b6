"""Reading a torch function call's arguments, given positionally or by keyword (the op rules and the op tracing
of ``bits="auto"`` both read intercepted calls)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["argument", "reduced_dims"]


def argument(args: tuple[Any, ...], kwargs: Mapping[str, Any], i: int, name: str, default: Any = None) -> Any:
    """The call's ``i``-th positional argument, else its keyword argument ``name``, else ``default``."""
    return args[i] if len(args) > i else kwargs.get(name, default)


def reduced_dims(ndim: int, dim: Any) -> tuple[int, ...]:
    """The dims a reduction's ``dim`` argument (an int or a sequence of them) names, non-negative and sorted; every
    dim of an ``ndim``-dim tensor where it names none."""
    dims = {d % ndim for d in ((dim,) if isinstance(dim, int) else dim)}
    return tuple(sorted(dims)) if dims else tuple(range(ndim))
