"""``BudgetedStep``: one training step that fits a memory budget, re-planned whenever it changes.

Example::

    step = BudgetedStep(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), optimizer, budget="600MB")
    for batch in loader:
        loss = step(batch)          # zero_grad, k micro-batches forward+backward, optimizer.step
    print(step.plan)                # the plan as a table

NOTE [ What the step does ]
1. Budget: read ``budget.bytes()`` (a callable or system budget is read again every step).
2. First step only: probe. Forward+backward on slices of the batch (2 samples, then up to
   ``PlannerConfig.probe_samples``, fewer if the measured per-sample memory says the slice would not
   fit) exactly, and once at every allowed bit-width, measuring saved bytes and time per segment
   and the peak RSS. Model buffers (BatchNorm statistics) and the RNG state are restored afterwards,
   gradients dropped: probing leaves no trace in training.
3. Plan from the profile (``planner.plan_step``), every step: cheap, and it is how a changed budget
   or a changed process footprint is honoured before the step runs.
4. Run: ``k`` micro-batches, each forward under ``compress(bits)`` (if any) with the chosen segments
   checkpointed, backward of ``loss * share``; then ``optimizer.step()`` and ``zero_grad(set_to_none)``.
5. Verify: the measured peak of the accumulation phase corrects the memory model (``alpha``) and the
   measured optimizer-step peak replaces its estimate.

NOTE [ Micro-batching keeps the math ]
For a mean-reduced loss, each micro-batch's loss is weighted by its share of the elements the mean
counts: ``count(micro) / count(batch)``. ``count`` defaults to the number of samples; for token
losses pass ``count=token_count()`` (non-ignored labels after the causal shift), so the accumulated
gradient equals the full batch's. BatchNorm is the exception: in train mode it normalises by each
micro-batch's own statistics and updates its running statistics once per micro-batch, so gradients
and running statistics differ from the full batch (as with any gradient accumulation). The usual
remedy, if that matters, is a batch-independent normalisation: ``batchnorm_to_groupnorm(model)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from ..config import CompressionConfig
from ..errors import ArgumentTypeError, InvalidArgumentError, UnsupportedError
from ..saved.hooks import compress
from .budgets import Budget, BudgetTooSmallError, tighten_allocator
from .memory import SavedTensorCounter, current_rss_bytes, peak_rss_bytes, reset_peak_rss
from .planner import Plan, PlannerConfig, Profile, SegmentProfile, plan_step

__all__ = [
    "BudgetedStep",
    "StepRecord",
    "batchnorm_to_groupnorm",
    "find_segments",
    "inplace_activations",
    "split_batch",
    "token_count",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
CountFn = Callable[[Any], int | torch.Tensor]


# -- batches -----------------------------------------------------------------------------------------

def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            t = _first_tensor(item)
            if t is not None:
                return t
    return None


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: dim 0 of its first tensor."""
    t = _first_tensor(batch)
    if t is None or t.dim() == 0:
        raise ArgumentTypeError("a batch must be a tensor, or a tuple/list/dict holding tensors with a batch dimension")
    return int(t.shape[0])


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Split every tensor of ``batch`` along dim 0 into slices of ``sizes`` (views, no copy).

    Tuples, lists and dicts are split recursively; anything else is passed to every slice as is.
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return [batch] * len(sizes)
        return list(torch.split(batch, list(sizes)))
    if isinstance(batch, Mapping):
        parts = {k: split_batch(v, sizes) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(len(sizes))]
    if isinstance(batch, (list, tuple)):
        parts_l = [split_batch(v, sizes) for v in batch]
        out = [[p[i] for p in parts_l] for i in range(len(sizes))]
        if hasattr(batch, "_fields"):  # namedtuple
            return [type(batch)(*o) for o in out]
        return [type(batch)(o) for o in out]
    return [batch] * len(sizes)


def _head(batch: Any, n: int) -> Any:
    """The first ``n`` samples of ``batch`` as a copy with its own storage (so storage-based byte
    counts see the slice, not the whole batch it views)."""
    total = batch_size(batch)
    part = split_batch(batch, [n, total - n])[0] if n < total else batch
    return _clone(part)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, Mapping):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        items = [_clone(v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def _balanced_sizes(total: int, k: int) -> list[int]:
    base, extra = divmod(total, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def token_count(labels_key: str | int = "labels", *, ignore_index: int = -100, shift: bool = True) -> CountFn:
    """A ``count`` for per-token mean losses: non-ignored labels, after the causal shift by one.

    ``labels_key`` indexes the batch (a dict key or a tuple position). With ``shift=True`` the first
    position of each sequence is not counted (as in Hugging Face causal-LM losses).
    """
    def count(batch: Any) -> torch.Tensor:
        labels = batch[labels_key]
        if shift:
            labels = labels[..., 1:]
        return (labels != ignore_index).sum()

    return count


def _samples(batch: Any) -> int:
    return batch_size(batch)


# -- BatchNorm remedy -----------------------------------------------------------------------------------

def batchnorm_to_groupnorm(model: nn.Module, num_groups: int = 32) -> nn.Module:
    """Replace every ``BatchNorm2d`` by a ``GroupNorm`` (in place), so micro-batching changes nothing.

    GroupNorm normalises each sample on its own, so its results do not depend on how the batch is
    split. The groups are ``gcd(num_groups, channels)``. This changes the model (and the accuracy
    you get from it): it is the remedy to choose deliberately, before training starts.
    """
    for name, child in list(model.named_children()):
        if isinstance(child, nn.BatchNorm2d):
            c = child.num_features
            gn = nn.GroupNorm(math.gcd(num_groups, c), c, eps=child.eps, affine=child.affine)
            if child.affine:
                with torch.no_grad():
                    gn.weight.copy_(child.weight)
                    gn.bias.copy_(child.bias)
            setattr(model, name, gn.to(next(child.parameters(), torch.empty(0)).device))
        else:
            batchnorm_to_groupnorm(child, num_groups)
    return model


# -- segments and checkpointing -------------------------------------------------------------------------

def find_segments(model: nn.Module) -> dict[str, nn.Module]:
    """Checkpointable blocks: the children of every ``Sequential``/``ModuleList`` with two or more
    children, outermost first (ResNet ``layerN.i`` blocks, GPT-2 ``transformer.h.i``); the model's
    top-level children when there is none.
    """
    found: dict[str, nn.Module] = {}
    taken: list[str] = []
    for name, mod in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if isinstance(mod, (nn.Sequential, nn.ModuleList)) and len(mod) >= 2:
            for child_name, child in mod.named_children():
                full = f"{name}.{child_name}" if name else child_name
                found[full] = child
                taken.append(full)
    if not found:
        found = dict(model.named_children())
    return found


@contextlib.contextmanager
def _frozen_running_stats(module: nn.Module) -> Iterator[None]:
    """Keep BatchNorm running statistics unchanged (the recomputation of a checkpointed block)."""
    saved = [(b, b.detach().clone()) for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
             for b in m.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


def _checkpointed_forward(module: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        calls = [0]

        def run(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                return original(*a, **kw)
            # NOTE: the recomputation in backward runs the block a second time in train mode; without
            # this BatchNorm would update its running statistics twice per forward.
            with _frozen_running_stats(module):
                return original(*a, **kw)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    return forward


@contextlib.contextmanager
def checkpointing(segments: Mapping[str, nn.Module], names: Sequence[str]) -> Iterator[None]:
    """Run the named segments under non-reentrant checkpoint inside the block; restore them after.

    The forward is replaced through an instance attribute only while the block runs (no permanent
    model rewrite); a pre-existing instance ``forward`` (e.g. from another wrapper) is put back.
    """
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for name in names:
            mod = segments[name]
            previous = mod.__dict__.get("forward", None)
            mod.forward = _checkpointed_forward(mod, mod.forward)  # type: ignore[method-assign]
            patched.append((mod, previous))
        yield
    finally:
        for mod, previous in reversed(patched):
            if previous is None:
                del mod.forward
            else:
                mod.forward = previous  # type: ignore[method-assign]


# -- in-place activations ------------------------------------------------------------------------------

_INPLACE_TYPES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.ELU, nn.CELU, nn.SELU, nn.Threshold)


def _inplace_pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
    x = args[0] if args else None
    # Only an intermediate activation may be overwritten: never a leaf, a user's input or a parameter.
    mod.inplace = isinstance(x, torch.Tensor) and x.grad_fn is not None and x._base is None


@contextlib.contextmanager
def inplace_activations(model: nn.Module) -> Iterator[int]:
    """Run the model's out-of-place activation modules (ReLU, LeakyReLU, ELU, ...) in place.

    NOTE [ In-place activations are exact ]
    An in-place ReLU writes its output over its input instead of allocating a new tensor, so one
    activation-sized buffer less is alive at each of them. Values and gradients are unchanged;
    where autograd needs the overwritten input it raises (version counter), and ``BudgetedStep``
    verifies this once on an exact step before using it. A pre-hook applies it per call only to
    intermediate activations (never a leaf, a view, or a user's input). The modules' ``inplace``
    flags are restored on exit. Yields the number of modules affected.
    """
    mods = [m for m in model.modules() if isinstance(m, _INPLACE_TYPES) and not m.inplace]
    handles = [m.register_forward_pre_hook(_inplace_pre_hook) for m in mods]
    try:
        yield len(mods)
    finally:
        for h in handles:
            h.remove()
        for m in mods:
            m.inplace = False


# -- memory meter ----------------------------------------------------------------------------------------

class _RssMeter:
    """Per-phase peaks of this process's RSS, and the process-lifetime peak across resets.

    NOTE: reading a phase peak needs the kernel's high-water mark reset (``/proc/self/clear_refs``),
    which also resets what ``peak_rss_bytes`` reports. The meter therefore reads the mark before every
    reset and keeps the maximum in ``process_peak``, so no moment of the process is missed.
    """

    def __init__(self) -> None:
        self.process_peak = peak_rss_bytes()
        self.resettable = True

    def start(self) -> int:
        self.process_peak = max(self.process_peak, peak_rss_bytes())
        self.resettable = reset_peak_rss()
        return current_rss_bytes()

    def peak(self) -> int:
        p = peak_rss_bytes()
        self.process_peak = max(self.process_peak, p)
        return p

    def lifetime_peak(self) -> int:
        return max(self.process_peak, peak_rss_bytes())


class _CudaMeter:
    """The same for a CUDA device: memory reserved by PyTorch's caching allocator (what the device
    sees this process hold, less the CUDA context)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.process_peak = torch.cuda.max_memory_reserved(device)
        self.resettable = True

    def start(self) -> int:
        self.process_peak = max(self.process_peak, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_reserved(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        p = torch.cuda.max_memory_reserved(self.device)
        self.process_peak = max(self.process_peak, p)
        return p

    def lifetime_peak(self) -> int:
        return max(self.process_peak, torch.cuda.max_memory_reserved(self.device))


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.nbytes
    if isinstance(x, Mapping):
        return sum(_nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


_STATE_FACTORS: dict[str, float] = {
    "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "Adadelta": 2, "ASGD": 2,
    "Rprop": 2, "LBFGS": 4,
}


def _optimizer_state_factor(opt: torch.optim.Optimizer) -> float:
    name = type(opt).__name__
    group = opt.param_groups[0] if opt.param_groups else {}
    if name == "SGD":
        return 1.0 if group.get("momentum", 0) else 0.0
    if name == "RMSprop":
        return 1.0 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    if name in ("Adam", "AdamW") and group.get("amsgrad", False):
        return 3.0
    return _STATE_FACTORS.get(name, 2.0)  # unknown optimizers: assume two states, like Adam


# -- the step --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepRecord:
    """What one step did and measured."""

    step: int
    budget_bytes: int
    plan: Plan
    peak_bytes: int
    """Peak RSS of the step (accumulation and optimizer phases)."""
    start_rss_bytes: int
    step_s: float
    loss: float
    replanned: bool


@dataclass
class _Measurement:
    saved: float = 0.0
    seg_saved: dict[str, float] = dataclasses.field(default_factory=dict)
    seg_input: dict[str, float] = dataclasses.field(default_factory=dict)
    seg_time: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    peak_delta: float = 0.0


class _DroppingCounter(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes a forward would save (unique storages, parameters and buffers left out) and
    keeps none of them: the forward holds no activations, and the graph cannot be back-propagated."""

    def __init__(self, model: nn.Module) -> None:
        self._skip = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
        self._seen: set[StorageWeakRef] = set()
        self.saved_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> None:
        if isinstance(t, nn.Parameter) or (t._base is not None and isinstance(t._base, nn.Parameter)):
            return None
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in self._skip and ref not in self._seen:
            self._seen.add(ref)
            self.saved_bytes += t.untyped_storage().nbytes()
        return None

    @staticmethod
    def _unpack(_: None) -> torch.Tensor:
        raise UnsupportedError("a counting forward cannot be back-propagated")


class BudgetedStep:
    """A training step that fits a memory budget: plans micro-batches, checkpointing and activation bits.

    Args:
        model: the model (trained in place).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``, mean- (default) or sum-reduced.
        optimizer: stepped once per call, after all micro-batches; gradients are then set to None.
        budget: a ``Budget``, bytes, a string like ``"600MB"``, or a callable read every step.
            It counts the whole process's resident memory (model, optimizer state, batch included).
        config: a ``PlannerConfig`` (bits allowed, safety margin, probe size).
        segments: checkpointable blocks by name; default ``find_segments(model)``.
        count: the number of elements a mean loss averages over in a batch (default: samples); see
            ``token_count`` for token losses. Ignored when ``reduction="sum"``.
        reduction: ``"mean"`` or ``"sum"``, how ``loss_fn`` reduces over the batch.
        compression: base ``CompressionConfig`` for compressed plans (its ``bits`` is replaced).
        inplace: run activation modules in place where autograd allows it (verified on the first
            step, see ``inplace_activations``).
        tune_allocator: fix glibc's mmap threshold so RSS follows live memory (see
            ``budget.tighten_allocator``; process-wide).

    Raises:
        BudgetTooSmallError: from a call, when even the leanest plan cannot fit the budget read then.

    Example::

        step = BudgetedStep(model, loss_fn, optimizer, budget="600MB")
        for batch in loader:
            step(batch)
        print(step.plan)
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                 budget: Budget | str | int | float | Callable[[], str | int | float], *,
                 config: PlannerConfig | None = None, segments: Mapping[str, nn.Module] | None = None,
                 count: CountFn | None = None, reduction: str = "mean",
                 compression: CompressionConfig | None = None, tune_allocator: bool = True,
                 inplace: bool = True) -> None:
        if reduction not in ("mean", "sum"):
            raise InvalidArgumentError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.budget = budget if isinstance(budget, Budget) else Budget(budget)
        self.config = config if config is not None else PlannerConfig()
        self.segments = dict(segments) if segments is not None else find_segments(model)
        self.count = count if count is not None else _samples
        self.reduction = reduction
        self._compression = compression if compression is not None else CompressionConfig()
        self._contexts: dict[int, compress] = {}
        self.profile: Profile | None = None
        self.plan: Plan | None = None
        self.alpha = 1.0
        self.history: list[StepRecord] = []
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.device = device
        self._meter: _RssMeter | _CudaMeter = _CudaMeter(device) if device.type == "cuda" else _RssMeter()
        self._warned_bn = False
        self.probe_sizes: dict[str, list[int]] = {}
        self._compression_loaded = False
        self.inplace = inplace and not self._compression.asynchronous  # async packing reads tensors later
        if tune_allocator and device.type == "cpu":
            tighten_allocator()

    # -- public --------------------------------------------------------------------------------------
    @property
    def process_peak_bytes(self) -> int:
        """Peak memory of the whole process so far: RSS on CPU, reserved device memory on CUDA (kept
        across the per-step resets, see ``_RssMeter``)."""
        return self._meter.lifetime_peak()

    def __call__(self, batch: Any) -> float:
        """Run one planned training step on ``batch``; return the full-batch loss."""
        budget = self.budget.bytes()
        start_rss = self._meter.start()
        persistent = start_rss + self._missing_state_bytes()
        if persistent >= budget and self.profile is None:
            # Nothing measured yet: what the process holds is a lower bound of the smallest budget.
            raise BudgetTooSmallError(budget, persistent + 1, "the process holds that much before any activation "
                                      "(a lower bound: activations need more)")
        if self.profile is None or self.profile.batch_size != batch_size(batch):
            self.profile = self._probe(batch, budget, persistent)
            start_rss = self._meter.start()
            persistent = start_rss + self._missing_state_bytes()
        plan = plan_step(self.profile, budget_bytes=budget, persistent_bytes=persistent, config=self.config,
                         alpha=self.alpha)
        replanned = self.plan is None or (plan.micro_batch_size, plan.checkpointed, plan.bits) != (
            self.plan.micro_batch_size, self.plan.checkpointed, self.plan.bits)
        self.plan = plan
        self._warn_batchnorm(plan)
        t0 = time.perf_counter()
        missing_grads = self._missing_grad_bytes()
        loss = self._accumulate(batch, plan)
        acc_peak = self._meter.peak()
        opt_start = self._meter.start()
        new_state = self._missing_state_bytes() - self._missing_grad_bytes()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        opt_peak = self._meter.peak()
        step_s = time.perf_counter() - t0
        self._calibrate(plan, acc_peak - start_rss - missing_grads, opt_peak - opt_start - new_state)
        record = StepRecord(len(self.history), budget, plan, max(acc_peak, opt_peak), start_rss, step_s, loss,
                            replanned)
        self.history.append(record)
        return loss

    def close(self) -> None:
        """Release the compression contexts (their packer threads, if any)."""
        for ctx in self._contexts.values():
            ctx.close()
        self._contexts.clear()

    # -- accounting ------------------------------------------------------------------------------------
    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _missing_grad_bytes(self) -> int:
        return sum(p.nbytes for p in self._params() if p.grad is None)

    def _missing_state_bytes(self) -> int:
        """Gradients and optimizer state the step will allocate but the process does not hold yet."""
        factor = _optimizer_state_factor(self.optimizer)
        state = sum(p.nbytes for g in self.optimizer.param_groups for p in g["params"]
                    if p.requires_grad and not self.optimizer.state.get(p))
        return self._missing_grad_bytes() + int(factor * state)

    def _calibrate(self, plan: Plan, measured_act: int, measured_opt: int) -> None:
        if not self._meter.resettable or self.profile is None:
            return
        predicted = plan.predicted_activation_bytes / plan.alpha
        if measured_act > 0 and predicted > 0:
            self.alpha = min(self.config.max_alpha, max(self.alpha, measured_act / predicted))
        if measured_opt > 0:
            self.profile = dataclasses.replace(self.profile, optimizer_transient=float(measured_opt) * 1.1)

    def _warn_batchnorm(self, plan: Plan) -> None:
        if plan.num_micro_batches > 1 and not self._warned_bn and any(
                isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules()):
            self._warned_bn = True
            warnings.warn("micro-batching a model with BatchNorm: batch statistics are per micro-batch, so gradients "
                          "and running statistics differ from the full batch (see batchnorm_to_groupnorm)",
                          stacklevel=3)

    # -- running ---------------------------------------------------------------------------------------
    def _context(self, bits: int | None) -> contextlib.AbstractContextManager[Any]:
        if bits is None:
            return contextlib.nullcontext()
        if bits not in self._contexts:
            self._contexts[bits] = compress(dataclasses.replace(self._compression, bits=bits), model=self.model)
        return self._contexts[bits]

    def _inplace(self) -> contextlib.AbstractContextManager[Any]:
        return inplace_activations(self.model) if self.inplace else contextlib.nullcontext()

    def _accumulate(self, batch: Any, plan: Plan) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        parts = split_batch(batch, _balanced_sizes(plan.batch_size, plan.num_micro_batches))
        counts = [float(self.count(p)) for p in parts] if self.reduction == "mean" else [1.0] * len(parts)
        total = sum(counts) if self.reduction == "mean" else 1.0
        value = 0.0
        for part, c in zip(parts, counts, strict=True):
            if self.reduction == "mean" and c == 0:
                continue  # nothing counted in this slice: it contributes no gradient
            w = c / total if self.reduction == "mean" else 1.0
            with checkpointing(self.segments, plan.checkpointed), self._inplace(), self._context(plan.bits):
                loss = self.loss_fn(self.model, part)
            (loss * w).backward()
            value += float(loss.detach()) * w
            del loss  # free the graph's last references before the next slice
        return value

    # -- probing ---------------------------------------------------------------------------------------
    def _measure(self, part: Any, mode: int | str | None) -> _Measurement:
        """One probe on ``part``. ``mode``: ``"count"`` (forward only, saved tensors counted and dropped
        at once, so it holds no activations), ``None`` (exact step), ``"ckpt"`` (exact step, every
        segment checkpointed) or a bit-width (step under ``compress``)."""
        self.optimizer.zero_grad(set_to_none=True)
        grads = self._missing_grad_bytes()
        ctx: Any
        if mode == "count":
            ctx = _DroppingCounter(self.model)
            saved_now: Callable[[], float] = lambda: ctx.saved_bytes  # noqa: E731
        elif mode is None or mode == "ckpt":
            ctx = SavedTensorCounter(exclude=list(self.model.buffers()))
            saved_now = lambda: ctx.saved_bytes  # noqa: E731
        else:
            ctx = compress(dataclasses.replace(self._compression, bits=mode, asynchronous=False), model=self.model)
            saved_now = lambda: ctx.stats.stored_bytes  # noqa: E731
        m = _Measurement()
        stack: list[tuple[float, float]] = []

        def pre(name: str, _mod: nn.Module, args: Any, kwargs: Any) -> None:
            m.seg_input[name] = m.seg_input.get(name, 0.0) + _nbytes(args) + _nbytes(kwargs)
            stack.append((saved_now(), time.perf_counter()))

        def post(name: str, _mod: nn.Module, _args: Any, _kwargs: Any, _out: Any) -> None:
            b0, t0 = stack.pop()
            m.seg_saved[name] = m.seg_saved.get(name, 0.0) + saved_now() - b0
            m.seg_time[name] = m.seg_time.get(name, 0.0) + time.perf_counter() - t0

        handles = []
        if mode != "ckpt":
            for name, mod in self.segments.items():
                handles.append(mod.register_forward_pre_hook(functools.partial(pre, name), with_kwargs=True))
                handles.append(mod.register_forward_hook(functools.partial(post, name), with_kwargs=True))
        start = self._meter.start()
        try:
            t0 = time.perf_counter()
            with checkpointing(self.segments, list(self.segments) if mode == "ckpt" else []), ctx:
                loss = self.loss_fn(self.model, part)
            m.saved = saved_now()
            if mode != "count":
                loss.backward()
            m.seconds = time.perf_counter() - t0
            del loss
            m.peak_delta = self._meter.peak() - start - (grads if mode != "count" else 0)
        finally:
            for h in handles:
                h.remove()
            if isinstance(ctx, compress):
                ctx.close()
            self.optimizer.zero_grad(set_to_none=True)
        return m

    def _verify_inplace(self, part: Any) -> bool:
        """One exact step with in-place activations; autograd raises where they are not allowed."""
        with inplace_activations(self.model) as n:
            if n == 0:
                return False
            try:
                self.loss_fn(self.model, part).backward()
            except RuntimeError as exc:
                if "inplace" not in str(exc) and "in-place" not in str(exc):
                    raise
                return False
            finally:
                self.optimizer.zero_grad(set_to_none=True)
        return True

    def _grow(self, batch: Any, mode: int | str | None, first: _Measurement, m1: int, cap: int,
              room: float) -> list[tuple[int, _Measurement]]:
        """Measure ``mode`` on slices growing x4 from ``m1`` while they fit ``room`` bytes.

        NOTE [ Growing probes ]
        RSS deltas of a 1-sample step are mostly allocator noise; extrapolated to the whole batch
        they would mislead the planner. The probe therefore grows the slice while the per-sample peak
        measured so far says the next slice stays within ``room`` (a fraction of the headroom) and
        ``cap`` samples.
        """
        runs = [(m1, first)]
        while True:
            m, r = runs[-1]
            per_sample = max(r.peak_delta, r.saved, 1.0) / m
            nxt = min(cap, 4 * m, int(room / (1.3 * per_sample)))
            if nxt < m + max(1, m // 2):
                return runs
            runs.append((nxt, self._measure(_head(batch, nxt), mode)))

    def _probe(self, batch: Any, budget: int, persistent: int) -> Profile:
        """Measure the step on small slices of ``batch`` (see NOTE [ What the step does ], 2)."""
        B = batch_size(batch)
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        headroom = (budget - persistent) * self.config.safety
        room = self.config.probe_fraction * headroom
        cap = max(1, int(B * self.config.probe_fraction))
        runs: dict[int | str | None, list[tuple[int, _Measurement]]] = {}
        try:
            rng = {"devices": [self.device.index or 0], "device_type": "cuda"} if self.device.type == "cuda" else {
                "devices": []}
            with torch.random.fork_rng(**rng):
                m1 = 1
                try:
                    self._measure(_head(batch, m1), "count")  # warm-up (allocator, lazy initialisation)
                except ValueError:  # e.g. BatchNorm1d cannot train on one sample
                    m1 = min(2, B)
                    self._measure(_head(batch, m1), "count")
                count = self._measure(_head(batch, m1), "count")
                # The exact step runs only if one slice of it is predicted to fit; otherwise the exact
                # figures come from a step with every segment checkpointed (boundaries + one block).
                exact_one = 1.5 * count.saved + max(count.peak_delta, 0) + 2 * max(count.seg_input.values(),
                                                                                    default=0.0)
                if exact_one <= headroom:
                    runs[None] = self._grow(batch, None, self._measure(_head(batch, m1), None), m1, cap, room)
                else:
                    runs["ckpt"] = [(m1, self._measure(_head(batch, m1), "ckpt"))]
                if self.inplace:
                    self.inplace = exact_one <= headroom and self._verify_inplace(_head(batch, m1))
                # Compression runs only if its kernels' one-time footprint fits besides the probe.
                free = budget - self._meter.start() - self._missing_state_bytes()
                spare = free * self.config.safety - self.config.compression_reserve
                compressed = sorted(b for b in self.config.bits if b is not None)
                if compressed and (self._compression_loaded or spare >= 0.25 * count.saved + max(count.peak_delta, 0)):
                    self._compression_loaded = True
                    warm = _head(batch, min(4, B))
                    for bits in compressed:  # warm-up: kernel compilation and thread pools grow RSS once
                        self._measure(warm, bits)
                    free = budget - self._meter.start() - self._missing_state_bytes()
                    room = min(room, self.config.probe_fraction * free * self.config.safety)
                    for bits in compressed:
                        runs[bits] = self._grow(batch, bits, self._measure(_head(batch, m1), bits), m1, cap, room)
        finally:
            with torch.no_grad():
                for b, v in buffers:
                    b.copy_(v)
            self.optimizer.zero_grad(set_to_none=True)
        self.probe_sizes = {str(k): [m for m, _ in v] for k, v in runs.items()}
        return self._profile(B, m1, count, runs)

    def _profile(self, B: int, m1: int, count: _Measurement,
                 runs: dict[int | str | None, list[tuple[int, _Measurement]]]) -> Profile:
        names = [n for n in self.segments if n in count.seg_saved]
        options: list[int | None] = [b for b in runs if b != "ckpt"]  # type: ignore[misc]
        if "ckpt" in runs:
            options.insert(0, None)
        seg_saved: dict[str, dict[int | None, float]] = {n: {None: count.seg_saved[n] / m1} for n in names}
        outside: dict[int | None, float] = {None: max(0.0, count.saved - sum(count.seg_saved[n] for n in names)) / m1}
        work: dict[int | None, float] = {}
        per_sample_s: dict[int | None, float] = {}
        fixed_s: dict[int | None, float] = {}
        work_fixed = 0.0
        for b in options:
            key = "ckpt" if b is None and "ckpt" in runs else b
            series = runs[key]
            (ma, a), (mb, g) = series[0], series[-1]
            if b is not None:
                for n in names:
                    seg_saved[n][b] = g.seg_saved.get(n, 0.0) / mb
                outside[b] = max(0.0, g.saved - sum(g.seg_saved.get(n, 0.0) for n in names)) / mb
            if key == "ckpt":  # what the checkpointed step holds besides its transient working set
                held = sum(count.seg_input[n] for n in names) + count.saved - sum(count.seg_saved[n] for n in names) \
                    + max(count.seg_saved[n] for n in names)
                ra, rb = a.peak_delta - held / m1 * ma, g.peak_delta - held / m1 * mb
            else:
                ra, rb = a.peak_delta - a.saved, g.peak_delta - g.saved
            slope_w = max(0.0, (rb - ra) / (mb - ma)) if mb > ma else max(0.0, rb / mb)
            work[b] = slope_w
            work_fixed = max(work_fixed, rb - slope_w * mb, ra - slope_w * ma)
            slope = (g.seconds - a.seconds) / (mb - ma) if mb > ma else g.seconds / mb
            slope = max(slope, g.seconds / mb * 0.5)  # noise guard: never less than half the average
            fixed_s[b] = max(0.0, g.seconds - slope * mb)
            if key == "ckpt":  # remove the recomputation the checkpointed probe paid
                slope = max(slope * 0.5, slope - sum(count.seg_time[n] for n in names) / m1)
            per_sample_s[b] = slope
        # Recompute cost per sample from the largest exact slice when there is one (a 1-sample forward
        # is dominated by per-call overhead).
        tm, timing = runs[None][-1] if None in runs else (m1, count)
        # NOTE: a compressed step runs the same forward and backward plus packing and unpacking, so it
        # cannot be faster than the exact one; under a noisy machine the measurement may say otherwise.
        if None in per_sample_s:
            for b in per_sample_s:
                per_sample_s[b] = max(per_sample_s[b], per_sample_s[None])
                fixed_s[b] = max(fixed_s[b], fixed_s[None])
        segments = tuple(SegmentProfile(name=n, saved=seg_saved[n], input_bytes=count.seg_input[n] / m1,
                                        forward_s=timing.seg_time.get(n, 0.0) / tm) for n in names)
        largest = max((p.nbytes for p in self._params()), default=0)
        return Profile(batch_size=B, segments=segments, outside=outside, work_per_sample=work,
                       work_fixed=max(0.0, work_fixed), per_sample_s=per_sample_s, fixed_s=fixed_s,
                       optimizer_transient=float(3 * largest))
