"""The errors daftrain raises. Every one derives from ``DaftrainError``, so ``except DaftrainError``
catches anything the library raises on purpose; each also derives from the built-in exception a caller
would expect (``ValueError`` for a bad value, ``TypeError`` for a bad type, ...). The errors of one
subsystem live in its package (``PoolError`` in ``pool/``, ``BudgetTooSmallError`` in ``budget/``)
and derive from the classes here."""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError", "DaftrainError", "InPlaceModificationError", "InvalidArgumentError", "UnsupportedError",
]


class DaftrainError(Exception):
    """Base of every error daftrain raises."""


class InvalidArgumentError(DaftrainError, ValueError):
    """An argument or configuration field with a value daftrain cannot use; the message names it."""


class ArgumentTypeError(DaftrainError, TypeError):
    """An argument or configuration field of the wrong type; the message names it."""


class UnsupportedError(DaftrainError, RuntimeError):
    """A call that cannot work in the current state or setting; the message says what to do instead."""


class InPlaceModificationError(DaftrainError, RuntimeError):
    """A tensor saved for backward was modified in place before it was packed or restored; plain
    PyTorch raises a ``RuntimeError`` with the same wording."""
