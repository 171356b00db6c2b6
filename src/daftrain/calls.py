"""Reading a torch function call's arguments, given positionally or by keyword (the op rules and the op tracing
of ``bits="auto"`` both read intercepted calls)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["argument"]


def argument(args: tuple[Any, ...], kwargs: Mapping[str, Any], i: int, name: str, default: Any = None) -> Any:
    """The call's ``i``-th positional argument, else its keyword argument ``name``, else ``default``."""
    return args[i] if len(args) > i else kwargs.get(name, default)
