"""``BudgetedStep`` under ``DistributedDataParallel``: one plan agreed by every rank, measuring slices
that never communicate, and micro-batches that synchronise gradients once, on the last of them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UnsupportedError
from .budgets import BudgetTooSmallError
from .planner import (
    Bits,
    Lever,
    Plan,
    PlannerConfig,
    Profile,
    _activation_per_sample,
    _bits_rank,
    _footprint,
    _headroom,
    _micro_batching,
    _step_time,
    _trim_time,
    lever,
)

__all__ = ["PlanAgreementError", "agree_plan", "all_reduce_grads", "ddp_of", "micro_batch_model", "unwrap"]


class PlanAgreementError(UnsupportedError):
    """Another rank failed before the ranks agreed on a step's plan; that rank's own error says why."""


def ddp_of(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """``model`` if it is a ``DistributedDataParallel`` wrapper whose process group spans several ranks."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and dist.get_world_size(model.process_group) > 1:
        return model
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` wraps (``model`` itself otherwise): where segments are
    found and checkpointed, and what probes run (NOTE [ Probes do not communicate ])."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def micro_batch_model(model: nn.Module, ddp: nn.parallel.DistributedDataParallel | None, last: bool) -> nn.Module:
    """The module a micro-batch runs: the DDP wrapper for the last micro-batch of a step, which
    all-reduces the gradients accumulated so far; the wrapped module for the others, which never
    communicate (NOTE [ One all-reduce per step ])."""
    return ddp if ddp is not None and last else unwrap(model)


def all_reduce_grads(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Average the accumulated gradients over the ranks as DDP does, for a step none of whose
    micro-batches ran through the wrapper (a one-sample batch trained by the planning step)."""
    world = dist.get_world_size(ddp.process_group)
    for p in ddp.module.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=ddp.process_group)
            p.grad.div_(world)


# NOTE [ Probes do not communicate ]
# The planning step trains slices whose number depends on each rank's own headroom and measurements
# (NOTE [ Growing probes ] in probe.py), and a plan's micro-batch count may differ between ranks whose
# batches differ. Through the DDP wrapper every backward would all-reduce and every forward may
# broadcast buffers, so ranks running different numbers of them would wait on each other until the
# collective's timeout. Every micro-batch but a step's last therefore runs the wrapped module
# (``unwrap``), which never communicates: ``loss_fn`` must call the model it is given, not a DDP model
# it closes over. DDP's reducer ignores these backwards (it expects its hooks only after a forward
# through the wrapper); the last micro-batch runs through the wrapper and all-reduces the gradients
# accumulated by all of them, as under ``no_sync()``. The buffers end as they would under ``no_sync``:
# the last forward broadcasts rank 0's, which rank 0's own earlier micro-batches updated.

# NOTE [ Agreeing on one plan ]
# Every rank must run the same plan: the same micro-batch count keeps the ranks in step and the same
# bits and checkpointing keep their step times alike, and each rank must stay under its own budget,
# read from its own process. Two simpler rules fail that:
# - planning on rank 0 and broadcasting sizes the plan to rank 0's budget and measurements; a rank
#   with a tighter budget (or a larger footprint) goes over its own;
# - taking the leanest of each knob separately (MAX of the micro-batch count, MIN of the bits, the
#   union of the checkpointed segments) builds a combination no rank measured (a bit-width a tight
#   rank never probed) and pays for every knob at once.
# So, in three collectives on small tensors:
# 1. each rank plans alone (``plan_step``) and all ranks gather the plans' (bits, checkpointed
#    segments), plus one fallback that is always measured: exact activations, every segment
#    checkpointed. A rank whose planning failed says so here, and every rank raises (none is left
#    waiting in the next collective);
# 2. for each candidate, each rank computes the fewest micro-batches it needs to fit its own budget
#    under its own profile and correction ``alpha``; all ranks take the MAX, so the agreed count fits
#    every rank;
# 3. each rank predicts its step time at that count; all ranks take the MAX (a step waits for the
#    slowest rank at the all-reduce) and choose the candidate as ``plan_step`` does (the fastest, or
#    one with more bits within ``prefer_exact_within`` of it). The choice is made from the reduced
#    tensors, identical on every rank, so every rank chooses the same.
# This runs on every step, so a budget that changes on one rank re-plans every rank.

_IMPOSSIBLE = 1 << 62  # micro-batch count of a candidate that does not fit even one sample per micro-batch
_OK, _TOO_SMALL, _FAILED = 0, 1, 2


def _encode_bits(bits: Bits) -> int:
    return 0 if bits is None else int(bits)


def _decode_bits(code: int) -> Bits:
    return None if code == 0 else code


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _micro_batches_needed(profile: Profile, bits: Bits, ckpt: frozenset[str], *, budget_bytes: int,
                          persistent_bytes: int, config: PlannerConfig, alpha: float) -> int:
    """The fewest micro-batches with which ``(bits, ckpt)`` fits this rank's budget (``_IMPOSSIBLE`` if
    none does, or if this rank has no measurement at ``bits``); the rule of ``plan_step``."""
    if bits not in profile.bits_options or bits not in config.bits:
        return _IMPOSSIBLE
    found = _micro_batching(profile, bits, ckpt, _headroom(budget_bytes, persistent_bytes, config), alpha)
    return _IMPOSSIBLE if found is None else found[2]


def agree_plan(own: Plan | None, error: BaseException | None, *, profile: Profile | None, budget_bytes: int,
               persistent_bytes: int, config: PlannerConfig, alpha: float, segment_names: Sequence[str],
               group: Any, time_scale: Mapping[Lever, float] | None = None) -> Plan:
    """The plan every rank of ``group`` runs (NOTE [ Agreeing on one plan ]); a collective: every rank
    calls it once per step, with its own plan, or with the error that kept it from planning.

    Raises:
        the rank's own ``error`` on the rank that failed; on the others ``BudgetTooSmallError`` (that
        rank's budget and required bytes) or ``PlanAgreementError``.
    """
    world, rank, device = dist.get_world_size(group), dist.get_rank(group), _device(group)
    n = len(segment_names)
    # 1. gather every rank's own plan: [status, required bytes, budget bytes, bits, checkpoint mask...]
    row = torch.zeros(4 + n, dtype=torch.int64, device="cpu")
    if error is not None or own is None:
        row[0] = _TOO_SMALL if isinstance(error, BudgetTooSmallError) else _FAILED
        if isinstance(error, BudgetTooSmallError):
            row[1], row[2] = error.required_bytes, error.budget_bytes
    else:
        row[3] = _encode_bits(own.bits)
        for i, name in enumerate(segment_names):
            row[4 + i] = name in own.checkpointed
    rows = [torch.empty_like(row, device=device) for _ in range(world)]
    dist.all_gather(rows, row.to(device), group=group)
    table = torch.stack(rows).cpu().tolist()
    for r, (status, required, budget, *_) in enumerate(table):
        if status == _OK:
            continue
        if r == rank and error is not None:
            raise error
        if status == _TOO_SMALL:
            raise BudgetTooSmallError(budget, required, f"on rank {r} of {world}: every rank runs the same plan, so "
                                                        f"raise rank {r}'s budget")
        raise PlanAgreementError(f"rank {r} of {world} failed before the ranks agreed on this step's plan (its own "
                                 "error says why); every rank stops so that none waits for it in a collective")
    assert profile is not None
    candidates: list[tuple[Bits, frozenset[str]]] = []
    for _, _, _, bits_code, *mask in table:
        c = (_decode_bits(bits_code), frozenset(nm for nm, on in zip(segment_names, mask, strict=True) if on))
        if c not in candidates:
            candidates.append(c)
    if None in config.bits:
        fallback: tuple[Bits, frozenset[str]] = (None, frozenset(segment_names) if config.checkpoint else frozenset())
        if fallback not in candidates:
            candidates.append(fallback)
    # 2. the micro-batch count each candidate needs on the tightest rank
    need = torch.tensor([_micro_batches_needed(profile, b, c, budget_bytes=budget_bytes,
                                               persistent_bytes=persistent_bytes, config=config, alpha=alpha)
                         for b, c in candidates], dtype=torch.int64, device=device)
    dist.all_reduce(need, op=dist.ReduceOp.MAX, group=group)
    ks = need.cpu().tolist()
    # 3. each candidate's time on the slowest rank
    headroom = _headroom(budget_bytes, persistent_bytes, config)
    scale = time_scale or {}
    times = torch.tensor([_local_time(profile, b, c, k, headroom, alpha) * scale.get(lever(b, c), 1.0)
                          if k < _IMPOSSIBLE else 0.0
                          for (b, c), k in zip(candidates, ks, strict=True)], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    slowest = times.cpu().tolist()
    feasible = [i for i, k in enumerate(ks) if k < _IMPOSSIBLE]
    if not feasible:
        raise PlanAgreementError(
            f"no plan fits every rank's budget: the {world} ranks' own plans (and exact activations with every "
            "segment checkpointed) each need more than some rank's budget allows; raise the tightest rank's budget")
    fastest = min(slowest[i] for i in feasible)
    near = [i for i in feasible if slowest[i] <= fastest * (1 + config.prefer_exact_within)]
    best = max(near, key=lambda i: (_bits_rank(candidates[i][0]), -slowest[i], -i))
    bits, ckpt = candidates[best]
    return _local_plan(profile, bits, ckpt, ks[best], budget_bytes=budget_bytes, persistent_bytes=persistent_bytes,
                       alpha=alpha, headroom=headroom, time_scale=scale.get(lever(bits, ckpt), 1.0))


def _local_activation(profile: Profile, bits: Bits, ckpt: frozenset[str], k: int, alpha: float) -> tuple[int, float]:
    """This rank's micro-batch size and activation bytes in ``k`` micro-batches (one per sample where
    it holds fewer than ``k`` samples)."""
    m = math.ceil(profile.batch_size / min(k, profile.batch_size))
    return m, profile.work_fixed * alpha + _activation_per_sample(profile, bits, ckpt) * alpha * m


def _local_time(profile: Profile, bits: Bits, ckpt: frozenset[str], k: int, headroom: float, alpha: float) -> float:
    k_local = min(k, profile.batch_size)
    _, act = _local_activation(profile, bits, ckpt, k, alpha)
    return _step_time(profile, bits, ckpt, k_local) + _trim_time(profile, act, k_local, headroom)


def _local_plan(profile: Profile, bits: Bits, ckpt: frozenset[str], k: int, *, budget_bytes: int,
                persistent_bytes: int, alpha: float, headroom: float, time_scale: float) -> Plan:
    """This rank's ``Plan`` for the agreed ``(bits, ckpt, k)``: its own batch in ``k`` micro-batches (or
    one per sample where it holds fewer than ``k`` samples)."""
    B = profile.batch_size
    k_local = min(k, B)
    m, act = _local_activation(profile, bits, ckpt, k, alpha)
    act = _footprint(profile, act, k_local, headroom)
    order = tuple(s.name for s in profile.segments if s.name in ckpt)
    return Plan(budget_bytes=int(budget_bytes), persistent_bytes=int(persistent_bytes), batch_size=B,
                micro_batch_size=m, num_micro_batches=k_local, checkpointed=order, bits=bits,
                predicted_peak_bytes=int(persistent_bytes + max(act, profile.optimizer_transient)),
                predicted_step_s=_local_time(profile, bits, ckpt, k, headroom, alpha) * time_scale, alpha=alpha,
                segments=profile.segments,
                predicted_activation_bytes=int(act))
