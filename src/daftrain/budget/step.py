"""``BudgetedStep``: one training step that fits a memory budget, re-planned whenever it changes.

Example::

    step = BudgetedStep(model, lambda m, b: F.cross_entropy(m(b[0]), b[1]), optimizer, budget="600MB")
    for batch in loader:
        loss = step(batch)          # zero_grad, k micro-batches forward+backward, optimizer.step
    print(step.plan)                # the plan as a table
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ..allocator import tighten_allocator
from ..config import CompressionConfig
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..pool import PagePool
from ..saved.hooks import compress
from ..saved.op_rules import ExactSavings, may_have_wide_head
from . import weight_grads
from .batching import CountFn, balanced_sizes, batch_size, checked_loss, shapes_of, split_batch
from .budgets import Budget, BudgetTooSmallError
from .distributed import agree_plan, all_reduce_grads, ddp_of, micro_batch_model, unwrap
from .memory import meter_for, missing_grad_bytes, missing_state_bytes
from .optimizer_step import leanest_part_bytes, optimizer_transient_bytes, part_bytes_within, step_in_parts
from .planner import (
    Lever,
    Plan,
    PlannerConfig,
    Profile,
    _activation_per_sample,
    _headroom,
    _records_per_sample,
    accumulation_time,
    keeps_freed,
    lever,
    plan_step,
)
from .probe import FirstStep, LossFn, Prober
from .segments import checkpointing, find_segments, inplace_activations
from .weight_grads import weight_grads_in_place

__all__ = ["BudgetedStep", "StepRecord"]

_ALPHA_WINDOW = 3  # steps whose measured/predicted ratio sets alpha (the largest of them)
_MIN_ALPHA = 1.0  # below the profile's own prediction only by re-measuring it (a new planning step)
_OPTIMIZER_SLACK = 1.1  # on the optimizer step's measured transient

# NOTE [ What the step does ]
# 1. Measure: read ``budget.bytes()`` (a callable or system budget is read again every step) and what
#    the process holds at the start of the step. On the first step (and whenever the batch size
#    changes) the planning step trains slices of the batch that grow while they fit, measuring each,
#    exactly and, where exact activations are bound, at every allowed bit-width (probe.py, NOTE [ The
#    planning step trains ]). The slices size themselves to the headroom, so they also run when the
#    process already holds more than the budget (one or two samples, every segment checkpointed): the
#    planner then names a budget that fits, measured, not guessed.
# 2. Plan from the profile (``planner.plan_step``), every step: cheap, and it is how a changed budget
#    or a changed process footprint is honoured before the step runs.
# 3. Run: the samples the planning step did not train (all of them on later steps) in micro-batches
#    of the plan, each forward under ``compress(bits)`` (if any) with the chosen segments checkpointed,
#    backward of ``loss * share``; then ``optimizer.step()``, in parts where the whole step's transient
#    would not fit the room left (NOTE [ Stepping in parts ]), and ``zero_grad(set_to_none)``.
# 4. Correct: the measured peak of the accumulation phase corrects the memory model (``alpha``, the
#    largest measured/predicted ratio of the last three planned steps, at least 1, so it comes back
#    down once reality agrees again)
#    and the measured optimizer-step peak scales its estimate.

# NOTE [ One all-reduce per step ]
# Under ``DistributedDataParallel`` every micro-batch but the last runs the wrapped module: its
# gradients accumulate in ``.grad`` locally, and the last micro-batch, through the wrapper, all-reduces
# the accumulated sums once, as ``no_sync()`` does for gradient accumulation (NOTE [ Probes do not
# communicate ] in distributed.py says why not ``no_sync``). The planning step leaves at least one
# sample for that last micro-batch. Slices that a mean loss counts nothing in are skipped, but never
# all of them: a rank must join the all-reduce once per step.

# NOTE [ Metering a planned step ]
# Phase peaks come from resetting the kernel's high-water mark (memory.py). Returning freed heap memory
# to the OS first (``malloc_trim``; ``empty_cache`` on CUDA) makes the measurements of the planning step
# comparable with each other, but every page it returns is faulted in and zeroed again by the next
# step's allocations, and glibc's fixed mmap threshold (``tighten_allocator``) does the same to every
# large block; on a CPU either costs more than all of a plan's own choices (docs/budget.md). So a step
# trims once, at its start, where what the process holds must be read for the plan (without it, freed
# memory the allocator keeps would count as held and shrink every later plan), and its later phases
# (the optimizer step, the planning step's remainder) reset the mark without trimming; and the fixed
# threshold is applied only where a budget is too tight for anything else (NOTE [ The allocator as a
# lever ]). The step's peak, the figure the budget is checked against, is
# the whole process's either way. glibc's dynamic mmap threshold keeps a freed micro-batch's
# activations as free heap that the next one reuses only in part (and a backward what its forward
# freed), so a step could go over its budget at a plan the model says fits. So a micro-batch, its
# backward, or the optimizer step, that would start with less room than the model gives it below the
# budget first returns the free memory (``meter.release()``): a trim only where the budget needs one.
# The planner prices those trims (NOTE [ The cost model ], 3. in planner.py) and usually prefers a plan
# whose micro-batch fits beside what the allocator keeps of the one before, which needs none. The room
# is the model's activations or, once the step's first micro-batch has run, what it measured where that
# is more: a model corrected only after the step (``alpha``) let the first steps of a plan it
# underestimated go over.

# NOTE [ The allocator as a lever ]
# glibc's dynamic mmap threshold (raised by every large free, up to 32 MiB) serves blocks below it from
# the heap, and a freed one stays resident until an allocation reuses it or a trim returns it. So what one
# micro-batch's forward and backward hold above their start varies with where the allocator happens to
# place the transients, by tens of MB between micro-batches of the same size that start from the same
# memory held (docs/budget.md). A plan with more room than that absorbs it in its safety margin; a budget
# that leaves only a few tens of MB above what the process holds cannot: a step goes over by a few MB,
# and the correction that follows leaves no plan that fits. A fixed threshold (``tighten_allocator``)
# puts every block of 64 KiB and more in its own mapping, unmapped on free: RSS follows live memory and
# the variation goes, at the cost of page faults on every large allocation (NOTE [ Metering a planned
# step ]). The default
# (``tune_allocator=None``) pulls that lever only where the budget needs it, on CPU: before a step whose
# room (budget less what the process holds, optimizer state included) is below
# ``PlannerConfig.tighten_below`` (two of glibc's largest heap blocks), after a step that went over its
# budget, and when no plan fits the budget without it: the planning step then measures again, since what it
# measured counted the freed memory glibc kept as the plan's own (docs/budget.md has a checkpointed forward
# whose resident memory grew many times its live blocks). That retry helps only as far as the heap has not
# grown yet: glibc serves a large request from a free chunk of its heap before it maps a new block, so blocks
# freed before the threshold was fixed are reused, and kept, after it; ``tune_allocator=True`` fixes it before
# any. glibc has no call that gives its dynamic threshold back, so it stays for the process; the step warns
# once when it pulls it and records it in ``StepRecord.allocator_tightened``.
# ``tune_allocator=True`` fixes it from the start, ``False`` never.

# NOTE [ Bits by importance under a plan ]
# The planner prices a compressed plan by the bytes its bit-width stores (``Profile.segments``' saved
# bytes at 8, 4 or 2 bits, measured at fixed bits). Given ``compression=CompressionConfig(bits="auto")``
# a plan at ``b`` bits runs under ``compress(bits="auto", avg_bits=b)``: the same bytes (the allocation's
# budget is fixed ``b``-bit's, counted with the layout's group overhead, and its adaptation steps store
# every tensor at ``b``), spent where the gradient needs them (docs/auto.md). The step owns that byte
# target, so a base configuration that names one (``avg_bits``, ``packed_bytes``, ``error_share``) is
# refused. A checkpointed segment's recomputation is stored at ``b`` too (``recomputation_context``), as
# the cost model counts it. Micro-batches of other sizes keep the allocation (``NOTE [ Another batch
# size ]`` in auto/policy.py), so one context per bit-width serves every plan at it. The variance
# warning is off (``variance_warning=None``): its probe copies every gradient for a step, memory the plan
# does not count, and under micro-batching it would compare accumulated gradients, reading one
# micro-batch's gradient as the minibatch noise.

# NOTE [ The pool under the plan's cap ]
# Given a ``PagePool``, a compressed plan's micro-batches store their packed records in its pages: a
# micro-batch's backward frees its records' pages and the next one's forward takes the same pages, so
# records never go through the allocator, whose freed blocks the model otherwise counts. Before the
# micro-batches run the step sets the pool's byte cap to the room the plan leaves for records: the
# budget, less what the process holds, less the plan's predicted footprint without the records of one
# micro-batch (the model's own split: saved activations outside blocks and in blocks not checkpointed,
# at the plan's bits, ``alpha`` applied). Where the model holds, records fit under it and nothing is
# evicted; where it underestimates, the pool demotes the least important records to fewer bits and then
# spills them to files (``NOTE [ Eviction order ]`` in pool/store.py) instead of the step going over
# its budget. ``StepRecord.pool_evictions`` counts them, so a lossy step is never silent. After the
# micro-batches the cap drops to one page, which frees every chunk: between steps the room belongs to
# the optimizer step and the next plan, and the held bytes the next plan reads hold no empty pages. A
# recomputation's records are stored outside the pool (``recomputation_context``), as the model counts
# them in the working set. The step owns the cap: one set on the pool before is replaced.

# NOTE [ The optimizer step that creates the state ]
# The optimizer's first step creates its state (Adam's two moments) one parameter at a time, between
# the per-parameter transients, and the allocator lays the new state beside the free memory the
# micro-batches left rather than in it: that step peaks well above its state plus the transient
# measured on later steps, and no step before it has measured it (docs/budget.md). So before a step
# that creates state the step returns the allocator's free memory unconditionally, whatever the
# estimate says: once per run, and the room it frees is what that step's extra transient takes.

# NOTE [ Memory kept per input shape ]
# Backends keep memory for every input shape they have run, for good: oneDNN's primitive cache on a CPU
# (about the same few MB for every new micro-batch size of a CNN, nothing for a size run before;
# docs/budget.md), cuDNN's plans on a GPU. A step whose plan brings a new micro-batch size holds that
# much more at its end than at its start, and its own peak carries it, but the model predicts the
# activations from what the process holds at the step's start. So the step keeps the shapes it has run
# (``shapes_of`` of each micro-batch) and measures what a new one leaves held: each exact slice of the
# planning step that brings one (the first excepted, which pays the process's first backward), then
# each step that brought any, its growth in held bytes (state and gradients excluded) over the count
# of new shapes. A plan whose micro-batches bring new shapes is made with that many times the largest
# of the last three measurements reserved out of the room (two shapes at most: balanced micro-batches
# take two sizes), and planned again if the reserved plan brings more; where no plan fits beside the
# reserve, the plan made without it runs (a budget that tight is the leanest plan's, reserve or not).
# A step that loaded the compression kernels, or created the optimizer's state, measures nothing: what
# those leave held beyond their own bytes is not a shape's.

# NOTE [ Micro-batching keeps the math ]
# For a mean-reduced loss, each micro-batch's loss is weighted by its share of the elements the mean
# counts: ``count(micro) / count(batch)``. ``count`` defaults to the number of samples; for token
# losses pass ``count=token_count()`` (non-ignored labels after the causal shift), so the accumulated
# gradient equals the full batch's; a step given a dict batch whose ``labels`` are per token with ignored
# positions, and no ``count``, warns once (counting samples there is the gradient-accumulation bug users of
# Hugging Face's Trainer met). BatchNorm is the exception: in train mode it normalises by each
# micro-batch's own statistics and updates its running statistics once per micro-batch, so gradients
# and running statistics differ from the full batch (as with any gradient accumulation). The usual
# remedy, if that matters, is a batch-independent normalisation: ``batchnorm_to_groupnorm(model)``.


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
    rank_plan: Plan | None = None
    """Under ``DistributedDataParallel``: the plan this rank would have run alone, before the ranks
    agreed on ``plan`` (NOTE [ Agreeing on one plan ] in distributed.py); ``None`` otherwise."""
    optimizer_parts: int = 1
    """How many ``optimizer.step()`` calls the optimizer step made: parts, and slices of a parameter
    larger than a part (NOTEs [ Stepping in parts ] and [ Slicing a parameter ] in optimizer_step.py);
    0 where a ``grad_scaler`` found non-finite gradients and the step was skipped."""
    pool_evictions: int = 0
    """With a ``pool``: records it demoted or spilled during the step because they exceeded the byte cap
    the plan set (NOTE [ The pool under the plan's cap ]); 0 where the plan's model held."""
    planning: bool = False
    """Whether this was a planning step (the first of a batch size): its measuring slices trained part
    of the batch and ``plan`` the rest; ``step_s`` includes them."""
    allocator_tightened: bool = False
    """Whether glibc's mmap threshold was fixed when the step ended (NOTE [ The allocator as a lever ])."""
    grad_norm: float | None = None
    """With ``max_grad_norm``: the total 2-norm of the step's gradients before they were clipped."""


_IGNORE_INDEX = -100
"""The label PyTorch's and Hugging Face's token losses ignore by default."""

_KERNELS_TOOK_THE_ROOM = (
    "this planning step loaded the compression kernels to measure compressed plans, and they stay in the "
    "process (more than PlannerConfig.compression_reserve here); with PlannerConfig(bits=(None,)) or a larger "
    "compression_reserve they are not loaded at this budget")


# NOTE [ Planning a compiled model ]
# The planning step measures slices of growing size under hooks of its own (per-segment forward hooks, a counter of
# saved bytes). A compiled model compiles again for each new slice size (until Dynamo makes the batch dimension
# dynamic) and for each new set of saved-tensor hooks, and those compilations land inside the measured slices:
# the profile reads them as the step's time and memory per sample, and under a tight budget the plan runs far
# smaller micro-batches than it needs (docs/budget.md). The measuring hooks run eagerly (``callbacks.uncompiled``:
# traced, they failed on symbolic sizes), and the step warns; measuring a compiled model's steady state
# (compiling before measuring, hooks Dynamo does not guard on) is not built.
def _compiled(model: nn.Module) -> bool:
    """Whether ``model`` or a module in it was compiled with ``torch.compile`` (or ``Module.compile``)."""
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


def _split(samples: int, k: int) -> list[int]:
    """The sizes of ``k`` balanced micro-batches of ``samples`` (one per sample where there are fewer)."""
    return balanced_sizes(samples, max(1, min(k, samples)))


def _with_detail(error: BaseException, detail: str) -> BudgetTooSmallError:
    """``error``, a ``BudgetTooSmallError``, with ``detail`` on what took the room."""
    assert isinstance(error, BudgetTooSmallError)
    detailed = BudgetTooSmallError(error.budget_bytes, error.required_bytes, detail)
    detailed.__cause__ = error
    return detailed


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
        compression: base ``CompressionConfig`` for compressed plans (its ``bits`` is replaced). With
            ``bits="auto"``, a plan at ``b`` bits stores the bytes of fixed ``b``-bit with each tensor's
            bits chosen by its importance (``avg_bits=b``; NOTE [ Bits by importance under a plan ]).
        max_grad_norm: clip the gradients to this total 2-norm before the optimizer step, as
            ``torch.nn.utils.clip_grad_norm_`` over the model's parameters does in a hand-written loop:
            once, on the whole batch's gradients (after every micro-batch, and DDP's all-reduce); each
            step's norm before clipping is in ``history[i].grad_norm``. ``None`` (default): no clipping.
        grad_scaler: a ``torch.amp.GradScaler`` for float16 autocast: every micro-batch's loss is scaled
            before its backward, the gradients are unscaled (then clipped) before the optimizer step,
            which is skipped where the scaler found non-finite gradients (``optimizer_parts`` 0), and the
            scaler is updated after it, as ``scaler.step`` and ``scaler.update`` do in a hand-written loop.
        inplace: exact in-place savings: activation modules run in place where autograd allows it
            (verified on the first step, see ``inplace_activations``), and ``Linear`` and ``Embedding``
            weight gradients are added into ``.grad`` in backward (``weight_grads_in_place``; not under
            DDP, whose hooks on the gradient accumulators must run).
        pool: optional ``PagePool`` for compressed plans' packed records, its byte cap set from each plan
            (NOTE [ The pool under the plan's cap ]).
        tune_allocator: fix glibc's mmap threshold so RSS follows live memory (see
            NOTE [ Freed memory goes back to the OS ] in ``allocator.py``; process-wide, for good):
            ``None`` (default) only on CPU where the budget leaves less than
            ``PlannerConfig.tighten_below`` above what the process holds, or after a step went over it
            (NOTE [ The allocator as a lever ]; a warning says when); ``True`` at once; ``False`` never.
            It makes a step slower (NOTE [ Metering a planned step ]). The compression contexts of
            compressed plans trim the heap only with ``True``, not by ``compression.tune_allocator``.

    Under ``DistributedDataParallel`` every call is a collective: all ranks agree on one plan, each
    staying under its own budget, and micro-batches all-reduce gradients once, after the last of them
    (see docs/budget.md, "Distributed"). ``loss_fn`` must call the model it is given (probes pass the
    wrapped module, which never communicates).

    Raises:
        BudgetTooSmallError: from a call, when even the leanest plan cannot fit the budget read then.
        InvalidArgumentError: from a call, for a batch without samples, or whose tensors disagree on dim 0.

    Example::

        step = BudgetedStep(model, loss_fn, optimizer, budget="600MB")
        for batch in loader:
            step(batch)
        print(step.plan)
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: Optimizer,
                 budget: Budget | str | int | float | Callable[[], str | int | float], *,
                 config: PlannerConfig | None = None, segments: Mapping[str, nn.Module] | None = None,
                 count: CountFn | None = None, reduction: str = "mean",
                 compression: CompressionConfig | None = None, pool: PagePool | None = None,
                 tune_allocator: bool | None = None, inplace: bool = True,
                 max_grad_norm: float | None = None, grad_scaler: torch.amp.GradScaler | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ArgumentTypeError(f"BudgetedStep model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise ArgumentTypeError(f"BudgetedStep loss_fn must be callable as loss_fn(model, batch) -> loss, got "
                                    f"{type(loss_fn).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ArgumentTypeError(f"BudgetedStep optimizer must be a torch.optim.Optimizer over the model's "
                                    f"parameters, got {type(optimizer).__name__}")
        if reduction not in ("mean", "sum"):
            raise InvalidArgumentError(f"BudgetedStep reduction must be 'mean' or 'sum' (how loss_fn reduces over "
                                       f"the batch), got {reduction!r}")
        if config is not None and not isinstance(config, PlannerConfig):
            raise ArgumentTypeError(f"BudgetedStep config must be a PlannerConfig, got {type(config).__name__}; "
                                    "pass e.g. PlannerConfig(bits=(None,))")
        if compression is not None and not isinstance(compression, CompressionConfig):
            raise ArgumentTypeError(f"BudgetedStep compression must be a CompressionConfig, got "
                                    f"{type(compression).__name__}; pass e.g. CompressionConfig(group_size=64)")
        if pool is not None and not isinstance(pool, PagePool):
            raise ArgumentTypeError(f"BudgetedStep pool must be a daftrain.PagePool or None, got "
                                    f"{type(pool).__name__}")
        if tune_allocator is not None and not isinstance(tune_allocator, bool):
            raise ArgumentTypeError(f"BudgetedStep tune_allocator must be None (where the budget needs it), True "
                                    f"or False, got {type(tune_allocator).__name__}")
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise ArgumentTypeError(f"BudgetedStep grad_scaler must be a torch.amp.GradScaler or None, got "
                                    f"{type(grad_scaler).__name__}")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, int | float)
                                          or not 0 < max_grad_norm < math.inf):
            raise InvalidArgumentError(f"BudgetedStep max_grad_norm must be a positive finite number (the total "
                                       f"gradient norm to clip to) or None, got {max_grad_norm!r}")
        targets = [n for n in ("avg_bits", "packed_bytes", "error_share")
                   if compression is not None and getattr(compression, n) is not None]
        if targets:
            raise InvalidArgumentError(f"BudgetedStep sets the bytes of a compressed plan itself (avg_bits = the "
                                       f"plan's bits), so compression must not name {targets[0]}; pass "
                                       "CompressionConfig(bits='auto') without a target")
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        if _compiled(model):  # NOTE [ Planning a compiled model ]
            warnings.warn(
                "BudgetedStep was given a model compiled with torch.compile: it plans from slices of the batch it "
                "measures, and a compiled model compiles again for new slice sizes and for the hooks that measure "
                "it, which it counts as the step's own time and memory; under a tight budget its plans come out far "
                "leaner (smaller micro-batches) and slower than needed. Pass the model uncompiled", stacklevel=2)
        self.max_grad_norm, self.grad_scaler = max_grad_norm, grad_scaler
        self._ddp = ddp_of(model)
        local = unwrap(model)
        self.budget = budget if isinstance(budget, Budget) else Budget(budget)
        self.config = config if config is not None else PlannerConfig()
        self.segments = dict(segments) if segments is not None else find_segments(local)
        self.count = count if count is not None else batch_size
        self._warned_tokens = count is not None or reduction != "mean"  # NOTE [ Micro-batching keeps the math ]
        self.reduction = reduction
        self._compression = dataclasses.replace(compression if compression is not None else CompressionConfig(),
                                                tune_allocator=tune_allocator is True)
        self.pool = pool
        self._contexts: dict[int, compress] = {}
        self.profile: Profile | None = None
        self.plan: Plan | None = None
        self.alpha = 1.0
        self._ratios: collections.deque[float] = collections.deque(maxlen=_ALPHA_WINDOW)
        self._time_ratios: dict[Lever, collections.deque[float]] = {}
        # the optimizer step's measured transient over its estimate, stepped whole (False) or in parts (True)
        self._optimizer_ratios: dict[bool, collections.deque[float]] = {
            False: collections.deque(maxlen=_ALPHA_WINDOW), True: collections.deque(maxlen=_ALPHA_WINDOW)}
        self._last_lever: Lever | None = None
        # NOTE [ Memory kept per input shape ]: shapes run, bytes each new one left held, and the last
        # step's held bytes at its start with the count of new shapes it brought
        self._shapes: set[tuple[tuple[int, ...], ...]] = set()
        self._held_per_shape: collections.deque[float] = collections.deque(maxlen=_ALPHA_WINDOW)
        self._new_shapes_since: tuple[int, int] | None = None
        # the share of a micro-batch's activations the allocator kept beside the next (NOTE [ The cost
        # model ], 3. in planner.py)
        self._kept: collections.deque[float] = collections.deque(maxlen=_ALPHA_WINDOW)
        self.history: list[StepRecord] = []
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._meter = meter_for(self.device)
        self._grads_in_place = inplace and self._ddp is None
        # exact plans take the loss over a language model's head (NOTE [ Exact training with the loss over the head ])
        self._exact = (ExactSavings(linears=(weight_grads.linear,), weight_grads_in_place=self._grads_in_place)
                       if self._compression.linear_cross_entropy and may_have_wide_head(model) else None)
        self._prober = Prober(local, loss_fn, optimizer, self.segments, self.config, self._compression, self._meter,
                              grads_in_place=self._grads_in_place, exact=self._exact, grad_scaler=grad_scaler)
        self._warned_bn = False
        self.inplace = inplace and not self._compression.asynchronous  # async packing reads tensors later
        self.tune_allocator = tune_allocator
        self.allocator_tightened = False
        if tune_allocator:
            self._tighten_allocator(None)

    # -- public --------------------------------------------------------------------------------------
    @property
    def process_peak_bytes(self) -> int:
        """Peak memory of the whole process so far: RSS on CPU, reserved device memory on CUDA (kept
        across the per-step resets, see NOTE [ Phase peaks and the process peak ])."""
        return self._meter.lifetime_peak()

    def __call__(self, batch: Any) -> float:
        """Run one planned training step on ``batch``; return the full-batch loss."""
        return self._step(batch, self._prober.compression_loaded, time.perf_counter())

    def _step(self, batch: Any, kernels_loaded: bool, t0: float) -> float:
        """``__call__``; ``kernels_loaded``: whether the compression kernels were loaded before the call, ``t0``
        when it started (a step that plans again counts the first try's time as its own)."""
        samples = batch_size(batch)
        if samples < 1:
            raise InvalidArgumentError(
                "the batch given to BudgetedStep has 0 samples (dim 0 of its first tensor is 0), and a step "
                "needs at least one; skip empty batches before calling the step")
        total = float(self.count(batch)) if self.reduction == "mean" else 1.0
        if not self._warned_tokens:
            self._warn_token_mean(batch, samples)
        budget = start_rss = persistent = reserve = 0
        own: Plan | None = None
        first: FirstStep | None = None
        self.optimizer.zero_grad(set_to_none=True)
        missing_grads = missing_grad_bytes(self.model)
        try:
            # 1. measure
            budget = self.budget.bytes()
            start_rss = self._meter.start()
            persistent = start_rss + missing_state_bytes(self.model, self.optimizer)
            if budget - persistent < self.config.tighten_below:
                self._tighten_allocator(f"the budget leaves {(budget - persistent) / 1e6:.1f} MB above what the "
                                        f"process holds, less than PlannerConfig.tighten_below")
            self._measure_new_shapes(persistent)
            if self.profile is None or self.profile.batch_size != samples:
                first = self._prober.planning_step(
                    batch, budget, persistent, inplace=self.inplace, share=self._share(total),
                    keep=1 if self._ddp is not None and samples > 1 else 0)
                self.profile, self.inplace = first.profile, first.inplace
                self.profile = self._with_kept(self.profile)  # measured of the allocator: it holds for any size
                self._shapes |= first.shapes
                self._held_per_shape.extend(first.held_per_shape)
                # the slices' gradients are held now; the optimizer state is not yet
                persistent = max(persistent, self._meter.start() + missing_state_bytes(self.model, self.optimizer))
            # 2. plan
            own, reserve = self._plan(batch, first, budget, persistent)
        except Exception as exc:
            self.optimizer.zero_grad(set_to_none=True)  # what the planning step trained is not stepped
            if isinstance(exc, BudgetTooSmallError) and self._ddp is None and self._tighten_allocator(
                    "no plan fits the budget while glibc keeps freed memory"):
                self.profile = None  # measured again, the allocator's memory now following what is used
                self._held_per_shape.clear()
                return self._step(batch, kernels_loaded, t0)
            kernels = isinstance(exc, BudgetTooSmallError) and self._prober.compression_loaded and not kernels_loaded
            if self._ddp is None:
                if kernels:
                    raise _with_detail(exc, _KERNELS_TOOK_THE_ROOM) from exc
                raise
            error: BaseException | None = _with_detail(exc, _KERNELS_TOOK_THE_ROOM) if kernels else exc
        else:
            error = None
        if self._ddp is None:
            assert own is not None
            plan, rank_plan = own, None
        else:  # every rank reaches this collective, also one that failed above
            plan = agree_plan(own, error, profile=self.profile, budget_bytes=budget,
                              persistent_bytes=persistent + reserve,
                              config=self.config, alpha=self.alpha, segment_names=list(self.segments),
                              group=self._ddp.process_group, time_scale=self._time_scale())
            rank_plan = own
        replanned = self.plan is None or (plan.micro_batch_size, plan.checkpointed, plan.bits) != (
            self.plan.micro_batch_size, self.plan.checkpointed, self.plan.bits)
        self.plan = plan
        self._warn_batchnorm(plan)
        # 3. run
        trained = first.trained if first is not None else 0
        loss = first.loss if first is not None else 0.0
        act_ratio: float | None = None
        evicted = 0
        contexts = len(self._contexts)
        if trained < samples:
            rest = split_batch(batch, [trained, samples - trained])[1] if trained else batch
            k = self._micro_batches(plan, samples - trained, first is None)
            micro = math.ceil((samples - trained) / k)
            predicted = self._predicted_activation(plan, micro)
            headroom = _headroom(budget, persistent + reserve, self.config)
            ceiling = budget - self.alpha * predicted
            if first is not None:  # what the slices freed, before the remainder allocates
                self._make_room(ceiling)
            rest_start = self._meter.start(trim=False) if first is not None else start_rss
            evicted = self._cap_pool(plan, micro, budget, persistent + reserve)
            acc_t0 = time.perf_counter()
            try:
                value, first_peak, untrimmed = self._accumulate(rest, plan, k, total, ceiling=ceiling,
                                                                budget=budget,
                                                                grads=missing_grads if first is None else 0)
            finally:
                evicted = self._release_pool(plan, evicted)
            loss += value
            self._correct_time(plan, time.perf_counter() - acc_t0,
                               accumulation_time(self.profile, plan, samples - trained, k, self.alpha * predicted,
                                                 headroom))
            # what the micro-batches measured against the model (NOTE [ The cost model ], 3. and 5.):
            # the first one against its activations, the whole phase against the plan's footprint
            # (what the allocator kept of one micro-batch beside the next included); the planning
            # step's slices allocated the gradients already, a planned step allocates them itself
            grads = missing_grads if first is None else 0
            kept = keeps_freed(self.profile, self.alpha * predicted, k, headroom)
            footprint = predicted * ((1 + self.profile.freed_kept) if kept else 1)
            one, phase = first_peak - rest_start - grads, self._meter.peak() - rest_start - grads
            if predicted > 0:
                act_ratio = max(one / predicted, phase / footprint)
            if kept and first is None and one > 0:  # NOTE [ The cost model ], 3. in planner.py
                self._correct_kept(phase / one - 1 if untrimmed >= 2 else 1.0 if untrimmed == 0 else None)
            new_shapes = self._shapes_of(batch, plan, trained, first is None) - self._shapes
            self._shapes |= new_shapes
            # a step that loaded the compression kernels measures nothing (NOTE [ Memory kept per input shape ])
            self._new_shapes_since = (persistent, len(new_shapes)) if new_shapes and len(self._contexts) == contexts \
                else None
        elif self._ddp is not None:
            all_reduce_grads(self._ddp)
        acc_peak = max(self._meter.peak(), first.peak_bytes if first is not None else 0)
        grad_norm, finite = self._unscale_and_clip()
        new_state = missing_state_bytes(self.model, self.optimizer) - missing_grad_bytes(self.model)
        assert self.profile is not None
        if new_state > 0:  # NOTE [ The optimizer step that creates the state ]
            self._meter.release()
            self._new_shapes_since = None  # what it holds beyond the state is not a shape's
        self._make_room(budget - self.profile.optimizer_transient - new_state)
        part = part_bytes_within(self.optimizer, budget - self._meter.current() - new_state,
                                 _OPTIMIZER_SLACK * self._optimizer_scale(False),
                                 _OPTIMIZER_SLACK * self._optimizer_scale(True))
        opt_start = self._meter.start(trim=False)
        part_scale = _OPTIMIZER_SLACK * self._optimizer_scale(True)

        def before_part(nbytes: int) -> None:
            # a part that starts lower (after a trim) is measured from there, not from the phase's start
            nonlocal opt_start
            self._make_room(budget - new_state - part_scale * nbytes)
            opt_start = min(opt_start, self._meter.current())

        parts = step_in_parts(self.optimizer, part, before_part) if finite else 0
        self.optimizer.zero_grad(set_to_none=True)
        if self.grad_scaler is not None:
            self.grad_scaler.update()
        opt_peak = self._meter.peak()
        step_s = time.perf_counter() - t0
        # 4. correct
        self._correct_model(act_ratio, opt_peak - opt_start - new_state if parts else 0, part)
        peak = max(acc_peak, opt_peak)
        if peak > budget:
            self._tighten_allocator(f"step {len(self.history)} peaked {(peak - budget) / 1e6:.1f} MB over the budget")
        record = StepRecord(len(self.history), budget, plan, peak, start_rss, step_s, loss,
                            replanned, rank_plan, optimizer_parts=parts, pool_evictions=evicted,
                            planning=first is not None, allocator_tightened=self.allocator_tightened,
                            grad_norm=grad_norm)
        self.history.append(record)
        return loss

    def close(self) -> None:
        """Release the compression contexts (their packer threads, if any)."""
        for ctx in self._contexts.values():
            ctx.close()
        self._contexts.clear()

    # -- correcting the model ------------------------------------------------------------------------
    def _predicted_activation(self, plan: Plan, micro: int) -> float:
        """The activation bytes the model predicts for ``plan`` at micro-batches of ``micro`` samples,
        before the correction ``alpha``."""
        assert self.profile is not None
        per = _activation_per_sample(self.profile, plan.bits, frozenset(plan.checkpointed))
        return self.profile.work_fixed + per * micro

    def _correct_kept(self, measured: float | None) -> None:
        """Record the share of a micro-batch's activations the allocator kept beside the next (1 for a
        plan that had to trim; ``None``: nothing measured), and give the profile the largest of the last
        three."""
        if measured is None or not self._meter.resettable or self.profile is None:
            return
        self._kept.append(min(1.0, max(0.0, measured)))
        self.profile = self._with_kept(self.profile)

    def _with_kept(self, profile: Profile) -> Profile:
        """``profile`` with the largest kept share of the last three measured (as it is before any)."""
        return dataclasses.replace(profile, freed_kept=max(self._kept)) if self._kept else profile

    def _measure_new_shapes(self, persistent: int) -> None:
        """What the last step's new shapes left held, per shape, from ``persistent``, held at this step's
        start (NOTE [ Memory kept per input shape ])."""
        if self._new_shapes_since is not None and self._meter.resettable:
            before, count = self._new_shapes_since
            self._held_per_shape.append(max(0.0, (persistent - before) / count))
        self._new_shapes_since = None

    def _micro_batches(self, plan: Plan, samples: int, planned: bool) -> int:
        """How many micro-batches ``plan`` runs ``samples`` in: its own count, or, for the samples a
        planning step left, as many as its micro-batch size needs."""
        return plan.num_micro_batches if planned else math.ceil(samples / plan.micro_batch_size)

    def _shapes_of(self, batch: Any, plan: Plan, trained: int, planned: bool) -> set[tuple[tuple[int, ...], ...]]:
        """The shapes of the micro-batches ``plan`` runs the samples of ``batch`` from ``trained`` on in."""
        left = batch_size(batch) - trained
        if left <= 0:
            return set()
        return {shapes_of(batch, n) for n in _split(left, self._micro_batches(plan, left, planned))}

    def _plan(self, batch: Any, first: FirstStep | None, budget: int, persistent: int) -> tuple[Plan, int]:
        """The plan for the samples of ``batch`` the planning step ``first`` (if any) left, and the bytes
        reserved out of its room for what its new shapes will hold (NOTE [ Memory kept per input shape ])."""
        assert self.profile is not None
        trained = first.trained if first is not None else 0
        per_shape = max(self._held_per_shape, default=0.0)
        scale = self._time_scale()
        reserve = 0
        plan = plan_step(self.profile, budget_bytes=budget, persistent_bytes=persistent, config=self.config,
                         alpha=self.alpha, time_scale=scale)
        while True:  # the reserve only grows, to two shapes' at most: three rounds at most
            need = math.ceil(per_shape * len(self._shapes_of(batch, plan, trained, first is None) - self._shapes))
            if need <= reserve:
                return plan, reserve
            try:
                plan = plan_step(self.profile, budget_bytes=budget, persistent_bytes=persistent + need,
                                 config=self.config, alpha=self.alpha, time_scale=scale)
            except BudgetTooSmallError:  # no room for the reserve: the plan made without it, as before
                return plan, reserve
            reserve = need

    def _correct_model(self, act_ratio: float | None, measured_opt: int, part: float | None) -> None:
        """Set ``alpha`` from what the last steps measured against what the model predicted (NOTE [ The
        cost model ], 5.), and record the optimizer step's measured transient (in parts of ``part`` bytes)
        against its estimate; the profile keeps the leanest step's, scaled, with 10 % slack."""
        if not self._meter.resettable or self.profile is None:
            return
        if act_ratio is not None and act_ratio > 0:
            self._ratios.append(act_ratio)
            self.alpha = min(self.config.max_alpha, max(_MIN_ALPHA, max(self._ratios)))
        if measured_opt > 0:
            self._optimizer_ratios[part is not None].append(
                measured_opt / max(1, optimizer_transient_bytes(self.optimizer, part)))
            lean = leanest_part_bytes(self.optimizer)
            leanest = optimizer_transient_bytes(self.optimizer, lean) * self._optimizer_scale(lean is not None)
            self.profile = dataclasses.replace(self.profile, optimizer_transient=_OPTIMIZER_SLACK * leanest)

    def _optimizer_scale(self, in_parts: bool) -> float:
        """The optimizer step's measured over estimated transient, whole or in parts: the largest of the
        last three such steps (1 before any)."""
        return max(self._optimizer_ratios[in_parts], default=1.0)

    def _time_scale(self) -> dict[Lever, float]:
        """Each lever's measured over predicted time (NOTE [ The cost model ], 4.): the median of its last
        three planned steps; a lever not run yet takes that of the lever run last, so that it is
        weighed against it by the model alone."""
        if self._last_lever is None or self.profile is None:
            return {}
        scale = {key: statistics.median(r) for key, r in self._time_ratios.items()}
        return {(b, c): scale.get((b, c), scale[self._last_lever]) for b in self.profile.bits_options
                for c in (False, True)}

    def _correct_time(self, plan: Plan, measured_s: float, predicted: float) -> None:
        """Record the micro-batches' time against the model's uncorrected prediction for them (the
        planning step's remainder included: it runs the plan)."""
        key = lever(plan.bits, plan.checkpointed)
        if predicted > 0 and measured_s > 0:
            ratio = measured_s / predicted
            self._time_ratios.setdefault(key, collections.deque(maxlen=_ALPHA_WINDOW)).append(ratio)
            self._last_lever = key

    def _warn_batchnorm(self, plan: Plan) -> None:
        if plan.num_micro_batches > 1 and not self._warned_bn and any(
                isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules()):
            self._warned_bn = True
            warnings.warn("micro-batching a model with BatchNorm: batch statistics are per micro-batch, so gradients "
                          "and running statistics differ from the full batch (see batchnorm_to_groupnorm)",
                          stacklevel=3)

    def _unscale_and_clip(self) -> tuple[float | None, bool]:
        """Between the last backward and the optimizer step, as a hand-written loop: the gradients unscaled by
        ``grad_scaler`` and clipped to ``max_grad_norm``; their norm before clipping (with ``max_grad_norm``) and
        whether the optimizer may step (no gradient the scaler found non-finite)."""
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        norm = None if self.max_grad_norm is None else float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        if scaler is None or not scaler.is_enabled():
            return norm, True
        # what GradScaler.step reads to skip a step (its own per-device inf checks from unscale_)
        return norm, not sum(float(v) for v in scaler._found_inf_per_device(self.optimizer).values())

    def _warn_token_mean(self, batch: Any, samples: int) -> None:
        """Warn once where the batch's labels look like a per-token loss's and ``count`` was left to count samples
        (``NOTE [ Micro-batching keeps the math ]``): Hugging Face's language-model batches."""
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if samples < 2 or not isinstance(labels, torch.Tensor) or labels.dim() < 2 or labels.is_floating_point():
            return
        if bool((labels == _IGNORE_INDEX).any()):
            self._warned_tokens = True
            warnings.warn(
                f"BudgetedStep: batch['labels'] holds ignored positions ({_IGNORE_INDEX}) and no count= was given, so "
                "each micro-batch's mean loss is weighted by its share of the samples, not of the tokens the loss "
                "averages over: where micro-batches hold different numbers of tokens the step's gradient is not the "
                "whole batch's. For a per-token mean loss (Hugging Face's language-model losses) pass "
                "count=daftrain.token_count() (shift=False for a loss without the causal shift); to weigh by samples, "
                "pass count=lambda batch: len(batch['labels'])", stacklevel=4)

    # -- running ---------------------------------------------------------------------------------------
    def _context(self, bits: int | None) -> contextlib.AbstractContextManager[Any]:
        """The context a micro-batch runs under at ``bits`` (NOTE [ Bits by importance under a plan ])."""
        if bits is None:
            return self._exact if self._exact is not None else contextlib.nullcontext()
        if bits not in self._contexts:
            config = (dataclasses.replace(self._compression, avg_bits=float(bits), variance_warning=None)
                      if self._compression.auto else dataclasses.replace(self._compression, bits=bits))
            self._contexts[bits] = compress(config, model=self.model, pool=self.pool)
        return self._contexts[bits]

    def _cap_pool(self, plan: Plan, micro: int, budget: int, persistent: int) -> int:
        """Set the pool's byte cap to the room ``plan`` leaves for one micro-batch's records (NOTE [ The
        pool under the plan's cap ]); return its evictions so far."""
        if self.pool is None or plan.bits is None:
            return 0
        assert self.profile is not None
        records = _records_per_sample(self.profile, plan.bits, frozenset(plan.checkpointed))
        others = plan.predicted_activation_bytes - self.alpha * micro * records
        self.pool.set_max_bytes(max(self.pool.page_size, int(budget - persistent - others)))
        return self.pool.stats().evictions

    def _release_pool(self, plan: Plan, evicted_before: int) -> int:
        """Free the pool's chunks after ``plan``'s micro-batches; return the evictions they caused."""
        if self.pool is None or plan.bits is None:
            return 0
        self.pool.set_max_bytes(self.pool.page_size)
        return self.pool.stats().evictions - evicted_before

    def _inplace(self) -> contextlib.AbstractContextManager[Any]:
        return inplace_activations(self.model) if self.inplace else contextlib.nullcontext()

    def _weight_grads(self) -> contextlib.AbstractContextManager[Any]:
        return weight_grads_in_place(self.model) if self._grads_in_place else contextlib.nullcontext()

    def _share(self, total: float) -> Callable[[Any], float]:
        """The weight of a micro-batch's loss: its share of what the batch's mean counts (NOTE
        [ Micro-batching keeps the math ]), or 1 for a sum."""
        if self.reduction == "sum":
            return lambda part: 1.0
        return lambda part: float(self.count(part)) / total if total > 0 else 0.0

    def _tighten_allocator(self, reason: str | None) -> bool:
        """Fix glibc's mmap threshold, once, on CPU, where ``tune_allocator`` allows it; ``reason`` (for the
        default, ``None``) is what the warning names (NOTE [ The allocator as a lever ]). Whether this call
        fixed it."""
        if self.allocator_tightened or self.tune_allocator is False or self.device.type != "cpu":
            return False
        self.allocator_tightened = tighten_allocator()
        if self.allocator_tightened and reason is not None:
            warnings.warn(f"BudgetedStep fixed glibc's mmap threshold for this process so that its memory follows "
                          f"what it uses ({reason}): steps stay under a tight budget but run slower; pass "
                          f"tune_allocator=False to keep glibc's defaults", stacklevel=3)
        return self.allocator_tightened

    def _make_room(self, ceiling: float) -> bool:
        """Return the allocator's free memory if more than ``ceiling`` bytes are held (NOTE [ Metering a
        planned step ]); whether it did."""
        if self._meter.current() > ceiling:
            self._meter.release()
            return True
        return False

    def _accumulate(self, batch: Any, plan: Plan, k: int, total: float, ceiling: float | None = None,
                    budget: int | None = None, grads: int = 0) -> tuple[float, int, int]:
        """Forward+backward of ``batch`` in ``k`` balanced micro-batches under ``plan``, each loss
        weighted by its share (NOTE [ Micro-batching keeps the math ]); return the summed weighted
        loss, the memory peak when the first micro-batch's backward ended and how many micro-batches ran
        without a trim before them or their backward (0 where any trimmed). A micro-batch, or its
        backward, that would start above ``ceiling`` bytes held first returns the allocator's free
        memory (NOTE [ Metering a planned step ]); once the first micro-batch has run, the ceiling
        leaves room for what it measured (``grads``: bytes it allocated that stay) below ``budget``
        where that is more than the model predicted. Under DDP only the last
        micro-batch runs through the wrapper and all-reduces the gradients (NOTE [ One all-reduce per
        step ])."""
        parts = split_batch(batch, _split(batch_size(batch), k))
        share = self._share(total)
        weights = [share(p) for p in parts]
        run = [i for i, w in enumerate(weights) if self.reduction == "sum" or w > 0]
        if not run and self._ddp is not None:
            run = [len(parts) - 1]  # the all-reduce must still happen once on this rank, with weight 0
        value, first_peak, trimmed = 0.0, 0, False
        start = self._meter.current()
        for i in run:
            if ceiling is not None and i != run[0]:
                trimmed |= self._make_room(ceiling)
            model = micro_batch_model(self.model, self._ddp, i == run[-1])
            context = self._context(plan.bits)
            recompute = context if isinstance(context, compress) else None
            with self._weight_grads():  # over the backward too (NOTE [ Weight gradients accumulated in place ])
                with checkpointing(self.segments, plan.checkpointed, recompute), self._inplace(), context:
                    loss = checked_loss(self.loss_fn(model, parts[i]))
                if ceiling is not None:
                    trimmed |= self._make_room(ceiling)  # what the forward freed, before the backward allocates
                self._prober.backward(loss * weights[i])
                value += float(loss.detach()) * weights[i]
                del loss  # free the graph's last references before the next slice
            if i == run[0]:
                first_peak = self._meter.peak()
                if ceiling is not None and budget is not None:
                    ceiling = min(ceiling, budget - (first_peak - start - grads))
        return value, first_peak or self._meter.peak(), 0 if trimmed else len(run)
