"""Frozen, validated configuration objects."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_BITS: tuple[int, ...] = (1, 2, 4, 8)
"""Bit-widths a float activation can be quantized to; ``None`` keeps it exact."""

MIN_GROUP_SIZE = 32
MAX_GROUP_SIZE = 1 << 16


@dataclass(frozen=True)
class CompressionConfig:
    """How saved activations are compressed.

    Example::

        cfg = CompressionConfig(bits=2, group_size=256)
        with daftrain.compress(cfg) as ctx:
            loss = loss_fn(model(x), y)
        loss.backward()
    """

    bits: int | None = 2
    """Bits per value for float activations: 1, 2, 4 or 8; ``None`` keeps every tensor exact."""

    group_size: int = 256
    """Values that share one (min, scale) pair. A multiple of 32, so each group's codes fill whole
    32-bit words at every bit-width (see ``layout.py``)."""

    min_numel: int = 4096
    """Tensors with fewer elements are kept exact: packing them saves little and costs a call."""

    pack_bool: bool = True
    """Store bool tensors (ReLU/dropout masks) as 1 bit per value, losslessly."""

    seed: int | None = None
    """Base seed of the stochastic-rounding stream; ``None`` derives it from ``torch.initial_seed()``."""

    asynchronous: bool = False
    """Pack on a worker thread while the next layers compute, and decode ahead in backward
    (see ``packer.py``). Results are identical to the synchronous path."""

    def __post_init__(self) -> None:
        if self.bits is not None and (
            isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in SUPPORTED_BITS
        ):
            raise ValueError(
                f"bits must be one of {SUPPORTED_BITS} or None (keep exact), got {self.bits!r}"
            )
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise TypeError(f"group_size must be an int, got {type(self.group_size).__name__}")
        if not (MIN_GROUP_SIZE <= self.group_size <= MAX_GROUP_SIZE) or self.group_size % 32:
            raise ValueError(
                f"group_size must be a multiple of 32 in [{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}], "
                f"got {self.group_size}"
            )
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative int, got {self.min_numel!r}")
        if not isinstance(self.asynchronous, bool):
            raise TypeError(f"asynchronous must be a bool, got {type(self.asynchronous).__name__}")
        if not isinstance(self.pack_bool, bool):
            raise TypeError(f"pack_bool must be a bool, got {type(self.pack_bool).__name__}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
