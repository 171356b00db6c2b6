"""Choices made once per forward position and kept across steps (which way a record's groups run, which
grid its codes are on)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["REESTIMATE_STEPS", "PerPosition"]

REESTIMATE_STEPS = 100
"""A forward position's choice is made again after this many steps (or at once if what it is made for changes)."""

T = TypeVar("T")


class PerPosition(Generic[T]):
    """One value per forward position, made on the position's first step and again every ``REESTIMATE_STEPS``
    steps or when its ``key`` (what the value was made for) changes: a step of a model whose activations keep
    their shapes and scales between steps pays for no new choice (one context's state)."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[Hashable, int, T]] = {}

    def get(self, step: int, index: int, key: Hashable, make: Callable[[], T]) -> T:
        """The value at forward position ``index`` of ``step``: the one made for ``key`` if it is recent
        enough (``None`` included), else ``make()``."""
        made = self._recent(step, index, key)
        if made is not None:
            return made[2]
        value = make()
        self.note(step, index, key, value)
        return value

    def known(self, step: int, index: int, key: Hashable) -> T | None:
        """The value noted at ``index`` for ``key`` if it is recent enough, else ``None`` (nothing is made)."""
        made = self._recent(step, index, key)
        return None if made is None else made[2]

    def note(self, step: int, index: int, key: Hashable, value: T) -> None:
        """Keep ``value`` for position ``index`` and ``key`` from ``step`` on."""
        self._made[index] = (key, step, value)

    def _recent(self, step: int, index: int, key: Hashable) -> tuple[Hashable, int, T] | None:
        made = self._made.get(index)
        return made if made is not None and made[0] == key and step - made[1] < REESTIMATE_STEPS else None
