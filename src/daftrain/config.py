"""Frozen, validated configuration objects."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ArgumentTypeError, InvalidArgumentError
from .layout import MAX_GROUP_SIZE, MIN_GROUP_SIZE, SUPPORTED_BITS

AUTO_BITS = "auto"
"""``CompressionConfig(bits=AUTO_BITS)`` picks bits per tensor from its importance."""

MIN_AVG_BITS, MAX_AVG_BITS = 1.0, 32.0
DEFAULT_AVG_BITS = 2.0
"""The ``avg_bits`` target of ``bits="auto"`` given neither ``avg_bits`` nor ``packed_bytes``."""
MAX_ERROR_SHARE = 1.0


@dataclass(frozen=True)
class CompressionConfig:
    """How saved activations are compressed.

    Example::

        cfg = CompressionConfig(bits=2, group_size=256)
        with daftrain.compress(cfg) as ctx:
            loss = loss_fn(model(x), y)
        loss.backward()
    """

    bits: int | str | None = 4
    """Bits per value for float activations: 1, 2, 4 or 8; ``None`` keeps every tensor exact;
    ``"auto"`` picks each tensor's bits (1, 2, 4, 8 or exact) from its importance under the
    ``avg_bits``, ``packed_bytes`` or ``error_share`` target (see ``auto/policy.py``). The default, 4, is
    the fewest fixed bits that trained as well as FP32 on every task of the accuracy-parity benchmark;
    2 stores half as much and costs accuracy on some (docs/results.md)."""

    group_size: int = 256
    """Values that share one (min, scale) pair. A multiple of 32, so each group's codes fill whole
    32-bit words at every bit-width (see ``layout.py``)."""

    column_groups: bool = True
    """Let a ``[rows, cols]`` tensor's groups run down its columns where that estimates clearly less
    rounding variance than along its rows, at the same bytes (``NOTE [ Groups down the columns ]`` in
    ``saved/grouping.py``): a smaller gradient error on most transformers, for about twice the kernel time
    on the tensors it picks (docs/saved.md). ``False`` keeps memory order."""

    fitted_grids: bool = True
    """At 2 and 4 bits, round each saved tensor onto levels fitted to its values (closer together where its
    values are) where that estimates clearly less rounding variance than evenly spaced levels: a smaller
    gradient error at the same bytes, unbiased as before (``NOTE [ Fitted grids ]`` in ``kernels/grids.py``).
    ``False`` keeps evenly spaced levels everywhere."""

    linear_cross_entropy: bool = True
    """Run ``F.cross_entropy`` over the output of a wide linear layer (a language model's head: more output
    than input features) as one function of the layer's input, weight and bias, which recomputes the logits a
    chunk at a time in backward: no logits-sized tensor is saved or made in backward, for about one more
    matmul of the head (``NOTE [ Cross-entropy over a wide linear layer ]`` in
    ``saved/linear_cross_entropy.py``). The loss and gradients equal plain PyTorch's to float rounding, not
    bit for bit. ``False`` saves the logits (at 8 bits or more) instead."""

    double_backward: bool = False
    """The backward will itself be differentiated (``create_graph=True``: a gradient penalty, a Hessian-vector
    product, a physics-informed loss): GELU, SiLU, Mish and Hardswish store their input, rounded, instead of
    their derivative, which has no derivative of its own (``NOTE [ A backward differentiated again ]`` in
    ``saved/hooks.py``). ``False``: a backward that builds a graph through such a stored derivative raises."""

    min_numel: int = 4096
    """Tensors with fewer elements are not packed on their own: packing each saves little and costs a call
    (``batch_small`` packs them together)."""

    batch_small: bool = True
    """Stage float32 tensors under ``min_numel`` values together and quantize them as one record at 8 bits, each
    in its own groups, where they are more than a sliver of what a forward saves (``NOTE [ Small tensors packed
    together ]`` in ``saved/small_tensors.py``): a recurrent layer's many per-step saves are stored ~4x smaller.
    Fixed bits and ``bits="auto"`` with an ``avg_bits`` target; ``False`` keeps them exact."""

    pack_bool: bool = True
    """Store bool tensors (ReLU/dropout masks) as 1 bit per value, losslessly."""

    pack_integers: bool = True
    """Store integer tensors (a max pool's indices, a gather's) in the narrowest integer type that holds their
    values' span, losslessly (``NOTE [ Integer tensors in their narrowest type ]`` in ``saved/records.py``)."""

    quantize_custom_functions: bool = False
    """Quantize what a custom ``torch.autograd.Function`` saves too. Its backward is the author's own code, which
    daftrain's op rules know nothing of: by default its floating-point saves are kept exact, and only lossless
    packing applies to them (``NOTE [ Saves of custom Functions are kept ]`` in ``saved/nesting.py``)."""

    seed: int | None = None
    """Base seed of the stochastic-rounding stream; ``None`` derives it from ``torch.initial_seed()``."""

    asynchronous: bool = False
    """Pack on a worker thread while the next layers compute, and decode ahead in backward
    (see ``packer.py``). Results are identical to the synchronous path."""

    decode_buffers: bool = True
    """Decode in backward into reused host buffers instead of fresh memory (CPU; see
    ``NOTE [ Decode buffers ]`` in ``decode_buffers.py``): faster, at the cost of a few free buffers
    held during backward."""

    tune_allocator: bool = True
    """On CPU, hand glibc's free heap back to the OS (``malloc_trim``) when a forward starts and ends, every
    ``allocator.DEFAULT_TRIM_BYTES`` (32 MiB) through the hooks, and whenever the memory glibc holds freed grew
    by as much, so the memory of freed activations and backward's transients does not stay in the heap: the
    process peak a user sees follows live memory
    (``NOTE [ Freed memory goes back to the OS ]`` in ``allocator.py``). It changes no allocator setting of
    the process."""

    avg_bits: float | None = None
    """``bits="auto"`` only: the budget as average bits per value over the tensors it allocates, counted
    with the real layout's per-group overhead (``avg_bits=2.0`` costs exactly the bytes of fixed 2-bit).
    ``None`` with no ``packed_bytes`` or ``error_share`` means ``DEFAULT_AVG_BITS`` (2.0)."""

    packed_bytes: int | None = None
    """``bits="auto"`` only: the budget in bytes of packed records per forward pass, instead of ``avg_bits``."""

    error_share: float | None = None
    """``bits="auto"`` only, instead of a byte budget: the fewest bytes whose estimated quantization variance
    is at most this share of the gradient's squared norm (``0.005`` keeps the gradient's cosine to the
    exact one near 0.9975). The estimate is calibrated on the loss computed under the context
    (``NOTE [ A variance target ]`` in ``auto/policy.py``)."""

    adapt_interval: int = 100
    """``bits="auto"`` only: re-estimate importance and re-allocate bits every this many steps (and
    whenever the saved tensors' shapes change)."""

    variance_warning: float | None = 0.1
    """``bits="auto"`` only: warn when the estimated quantization variance of the gradient exceeds this
    fraction of the minibatch gradient's own variance (needs ``model`` to measure the latter: a copy of
    the gradients, kept over one step after each adaptation step). ``None`` measures and warns nothing."""

    def __post_init__(self) -> None:
        if self.bits is not None and self.bits != AUTO_BITS and (
            isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in SUPPORTED_BITS
        ):
            raise InvalidArgumentError(
                f"bits must be one of {SUPPORTED_BITS}, {AUTO_BITS!r} or None (keep exact), got {self.bits!r}"
            )
        self._check_auto()
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise ArgumentTypeError(f"group_size must be an int, got {type(self.group_size).__name__}")
        if not (MIN_GROUP_SIZE <= self.group_size <= MAX_GROUP_SIZE) or self.group_size % 32:
            raise InvalidArgumentError(
                f"group_size must be a multiple of 32 in [{MIN_GROUP_SIZE}, {MAX_GROUP_SIZE}], "
                f"got {self.group_size}"
            )
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise InvalidArgumentError(f"min_numel must be a non-negative int, got {self.min_numel!r}")
        if not isinstance(self.asynchronous, bool):
            raise ArgumentTypeError(f"asynchronous must be a bool, got {type(self.asynchronous).__name__}")
        if not isinstance(self.decode_buffers, bool):
            raise ArgumentTypeError(f"decode_buffers must be a bool, got {type(self.decode_buffers).__name__}")
        if not isinstance(self.tune_allocator, bool):
            raise ArgumentTypeError(f"tune_allocator must be a bool, got {type(self.tune_allocator).__name__}")
        if not isinstance(self.column_groups, bool):
            raise ArgumentTypeError(f"column_groups must be a bool, got {type(self.column_groups).__name__}")
        if not isinstance(self.fitted_grids, bool):
            raise ArgumentTypeError(f"fitted_grids must be a bool, got {type(self.fitted_grids).__name__}")
        if not isinstance(self.linear_cross_entropy, bool):
            raise ArgumentTypeError(
                f"linear_cross_entropy must be a bool, got {type(self.linear_cross_entropy).__name__}")
        if not isinstance(self.double_backward, bool):
            raise ArgumentTypeError(f"double_backward must be a bool, got {type(self.double_backward).__name__}")
        if not isinstance(self.pack_bool, bool):
            raise ArgumentTypeError(f"pack_bool must be a bool, got {type(self.pack_bool).__name__}")
        if not isinstance(self.batch_small, bool):
            raise ArgumentTypeError(f"batch_small must be a bool, got {type(self.batch_small).__name__}")
        if not isinstance(self.pack_integers, bool):
            raise ArgumentTypeError(f"pack_integers must be a bool, got {type(self.pack_integers).__name__}")
        if not isinstance(self.quantize_custom_functions, bool):
            raise ArgumentTypeError(
                f"quantize_custom_functions must be a bool, got {type(self.quantize_custom_functions).__name__}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
            raise InvalidArgumentError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")

    def _check_auto(self) -> None:
        auto = self.bits == AUTO_BITS
        targets = [n for n in ("avg_bits", "packed_bytes", "error_share") if getattr(self, n) is not None]
        if not auto and targets:
            raise InvalidArgumentError(
                f"the target {' and '.join(targets)} (avg_bits, packed_bytes or error_share) can only apply with "
                f"bits={AUTO_BITS!r}, got bits={self.bits!r}"
            )
        if len(targets) > 1:
            raise InvalidArgumentError(f"give the target as {' or as '.join(targets)}, not both")
        if self.error_share is not None and (
            isinstance(self.error_share, bool) or not isinstance(self.error_share, int | float)
            or not 0 < self.error_share <= MAX_ERROR_SHARE
        ):
            raise InvalidArgumentError(
                f"error_share must be a number in (0, {MAX_ERROR_SHARE}], got {self.error_share!r}"
            )
        if self.avg_bits is not None and (
            isinstance(self.avg_bits, bool) or not isinstance(self.avg_bits, int | float)
            or not MIN_AVG_BITS <= self.avg_bits <= MAX_AVG_BITS
        ):
            raise InvalidArgumentError(
                f"avg_bits must be a number in [{MIN_AVG_BITS}, {MAX_AVG_BITS}], got {self.avg_bits!r}"
            )
        if self.packed_bytes is not None and (
            isinstance(self.packed_bytes, bool) or not isinstance(self.packed_bytes, int) or self.packed_bytes <= 0
        ):
            raise InvalidArgumentError(f"packed_bytes must be a positive int, got {self.packed_bytes!r}")
        interval = self.adapt_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise InvalidArgumentError(f"adapt_interval must be an int >= 1, got {self.adapt_interval!r}")
        if self.variance_warning is not None and (
            isinstance(self.variance_warning, bool) or not isinstance(self.variance_warning, int | float)
            or not self.variance_warning > 0
        ):
            raise InvalidArgumentError(f"variance_warning must be a positive number or None, got "
                                       f"{self.variance_warning!r}")

    @property
    def auto(self) -> bool:
        """True when bits are chosen per tensor (``bits="auto"``)."""
        return self.bits == AUTO_BITS
