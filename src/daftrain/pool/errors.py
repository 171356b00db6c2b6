"""The errors a ``PagePool`` raises."""

from __future__ import annotations

from ..errors import DaftrainError

__all__ = ["PoolBudgetError", "PoolError"]


class PoolError(DaftrainError, RuntimeError):
    """The pool cannot do what was asked (closed pool, released record, corrupted spill file, ...)."""


class PoolBudgetError(PoolError):
    """A store cannot fit under the pool's byte cap (``max_bytes``) and nothing less important can be
    demoted or spilled."""

    def __init__(self, requested_bytes: int, max_bytes: int, used_bytes: int, detail: str = "") -> None:
        self.requested_bytes, self.max_bytes, self.used_bytes = requested_bytes, max_bytes, used_bytes
        msg = (
            f"cannot store a record of {requested_bytes} bytes: the pool's max_bytes allows {max_bytes} bytes "
            f"and {used_bytes} bytes are in use"
        )
        super().__init__(
            msg + (f" ({detail})" if detail else "")
            + "; raise PoolConfig.max_bytes (or call PagePool.set_max_bytes), enable spilling, or store fewer bytes"
        )
