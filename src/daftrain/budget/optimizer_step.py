"""The optimizer step in parts: what ``optimizer.step()`` allocates beyond its state, and stepping the
parameters in parts so that its temporaries span one part at a time."""

from __future__ import annotations

import torch

__all__ = ["leanest_part_bytes", "optimizer_transient_bytes", "part_bytes_within", "step_in_parts"]

# NOTE [ The optimizer step's transient ]
# ``optimizer.step()`` allocates temporaries beside the state it keeps. A per-parameter ("for-loop")
# step holds them for one parameter at a time: Adam's ``exp_avg_sq.sqrt() / bias_correction`` makes two
# parameter-sized temporaries before they are freed, so about twice the largest parameter. A ``foreach``
# step makes each temporary for all parameters of a group at once, about the group's parameter bytes
# (stepped in parts: the largest part's).
# torch's default is ``foreach`` only where every parameter is on CUDA. This estimate, scaled by what
# ``BudgetedStep`` measures, is what the planner reserves for the step.

# NOTE [ Stepping in parts ]
# Where the whole step's transient does not fit the room left under the budget, ``step_in_parts``
# calls ``optimizer.step()`` once per part of the parameters, with the gradients of the others set to
# None for that call (torch's optimizers skip a parameter without a gradient), then puts every gradient
# back. A ``foreach`` step's temporaries then span one part. Each parameter is updated once, from its
# own gradient and state, by the same kernels: the result is bit-identical to one step. That holds only
# for optimizers whose update of a parameter reads nothing of the others (``_PER_PARAMETER``: not
# LBFGS, not one that clips by a global norm inside ``step``) and without step hooks, which would run
# once per part; any other optimizer takes one step. A part never splits a parameter, so the leanest
# parts are single parameters, the largest setting the floor.
# A for-loop step (torch's default on CPU) already holds its temporaries for one parameter at a time,
# about twice the largest; run ``foreach`` on a part of that one parameter, it holds one. So parts run
# ``foreach`` where the optimizer's ``foreach`` and for-loop steps compute the same floats
# (``_FOREACH_IS_LOOP``, tested; not NAdam, RAdam, ASGD, whose two paths round differently), and the
# group allows it (not fused, not differentiable, no sparse gradient).
_PER_PARAMETER = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
)

_FOREACH_IS_LOOP = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.RMSprop,
    torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.Rprop,
)


def _steppable_in_parts(optimizer: torch.optim.Optimizer) -> bool:
    from torch.optim import optimizer as optimizer_module

    hooks = (getattr(optimizer, "_optimizer_step_pre_hooks", None), getattr(optimizer, "_optimizer_step_post_hooks",
             None), optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks)
    return type(optimizer) in _PER_PARAMETER and not any(hooks)


def _params(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    return [[p for p in group["params"] if p.requires_grad] for group in optimizer.param_groups]


def _foreach(group: dict, params: list[torch.Tensor]) -> bool:
    foreach = group.get("foreach")
    if foreach is None:
        foreach = all(p.is_cuda for p in params) and not group.get("fused")
    return bool(foreach)


def _foreach_in_parts(optimizer: torch.optim.Optimizer, group: dict, params: list[torch.Tensor]) -> bool:
    """Whether the group's parts run ``foreach`` (NOTE [ Stepping in parts ])."""
    if _foreach(group, params):
        return True
    return type(optimizer) in _FOREACH_IS_LOOP and not group.get("fused") and not group.get("differentiable") \
        and not any(p.grad is not None and p.grad.is_sparse for p in params)


def _split(params: list[torch.Tensor], part_bytes: float) -> list[list[torch.Tensor]]:
    parts: list[list[torch.Tensor]] = []
    size = 0.0
    for p in params:
        if not parts or size + p.nbytes > part_bytes:
            parts.append([])
            size = 0.0
        parts[-1].append(p)
        size += p.nbytes
    return parts


def optimizer_transient_bytes(optimizer: torch.optim.Optimizer, part_bytes: float | None = None) -> int:
    """Estimated bytes ``optimizer.step()`` allocates beyond its state (NOTE [ The optimizer step's
    transient ]), stepping parts of at most ``part_bytes`` (None: one step; see ``step_in_parts``)."""
    worst = 0
    for group, params in zip(optimizer.param_groups, _params(optimizer), strict=True):
        if not params:
            continue
        if part_bytes is not None and _foreach_in_parts(optimizer, group, params):
            need = max(sum(p.nbytes for p in part) for part in _split(params, part_bytes))
        elif _foreach(group, params):
            need = sum(p.nbytes for p in params)
        else:
            need = int(2.2 * max(p.nbytes for p in params))
        worst = max(worst, need)
    return int(worst)


def leanest_part_bytes(optimizer: torch.optim.Optimizer) -> float | None:
    """The smallest part ``step_in_parts`` can step (the largest parameter), or None where the optimizer
    steps whole (NOTE [ Stepping in parts ])."""
    if not _steppable_in_parts(optimizer):
        return None
    return float(max((p.nbytes for params in _params(optimizer) for p in params), default=0))


def part_bytes_within(optimizer: torch.optim.Optimizer, room: float, whole_scale: float,
                      part_scale: float) -> float | None:
    """The largest part whose estimated transient fits ``room`` bytes (estimates times ``whole_scale``
    for one step, ``part_scale`` in parts: each what the last such step measured over its estimate);
    None where the whole step fits or parts would not lower its transient; the leanest part where none
    fits."""
    leanest = leanest_part_bytes(optimizer)
    whole = optimizer_transient_bytes(optimizer)
    if leanest is None or whole_scale * whole <= room or \
            part_scale * optimizer_transient_bytes(optimizer, leanest) >= whole_scale * whole:
        return None  # the whole step fits, or parts would not make it smaller
    low, high = leanest, float(sum(p.nbytes for params in _params(optimizer) for p in params))
    for _ in range(40):  # the estimate is monotone in the part size
        mid = (low + high) / 2
        if part_scale * optimizer_transient_bytes(optimizer, mid) <= room:
            low = mid
        else:
            high = mid
    return low


def step_in_parts(optimizer: torch.optim.Optimizer, part_bytes: float | None) -> int:
    """``optimizer.step()``, over parts of at most ``part_bytes`` of parameters (NOTE [ Stepping in
    parts ]); returns the number of parts stepped."""
    with_grad = [p for params in _params(optimizer) for p in params if p.grad is not None]
    parts = _split(with_grad, part_bytes) if part_bytes is not None and _steppable_in_parts(optimizer) else []
    if len(parts) <= 1:
        optimizer.step()
        return 1
    grads = [p.grad for p in with_grad]
    modes = [group.get("foreach") for group in optimizer.param_groups]
    try:
        for group, params in zip(optimizer.param_groups, _params(optimizer), strict=True):
            if params and _foreach_in_parts(optimizer, group, params):
                group["foreach"] = True
        for p in with_grad:
            p.grad = None
        start = 0
        for part in parts:
            for p, g in zip(part, grads[start:start + len(part)], strict=True):
                p.grad = g
            optimizer.step()
            for p in part:
                p.grad = None
            start += len(part)
    finally:
        for p, g in zip(with_grad, grads, strict=True):
            p.grad = g
        for group, mode in zip(optimizer.param_groups, modes, strict=True):
            group["foreach"] = mode
    return len(parts)
