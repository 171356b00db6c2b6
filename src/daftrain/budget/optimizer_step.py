"""The optimizer step in parts: what ``optimizer.step()`` allocates beyond its state, and stepping the
parameters in parts so that its temporaries span one part at a time."""

from __future__ import annotations

from collections.abc import Callable

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
# once per part; any other optimizer takes one step. A parameter larger than a part is stepped in
# slices (NOTE [ Slicing a parameter ]).
# A for-loop step (torch's default on CPU) already holds its temporaries for one parameter at a time,
# about twice the largest; run ``foreach`` on a part of that one parameter, it holds one. So parts run
# ``foreach`` where the optimizer's ``foreach`` and for-loop steps compute the same floats
# (``_FOREACH_IS_LOOP``, tested; not NAdam, RAdam, ASGD, whose two paths round differently), and the
# group allows it (not fused, not differentiable, no sparse gradient).

# NOTE [ Slicing a parameter ]
# Whole parameters leave the largest one as the floor (a tied embedding: a foreach part of its size, a
# for-loop step twice it). The optimizers of ``_PER_PARAMETER`` update each element from that element
# of the parameter, its gradient and its state alone, plus scalar state that every element shares (the
# step count, NAdam's mu product, ASGD's eta and mu). So a parameter larger than a part is stepped in
# slices of its flattened elements: each slice is handed to ``optimizer.step()`` as a parameter of its
# own (a view of the parameter, a view of the gradient as its grad, views of the per-element state, the
# scalar state cloned), and the step writes through the views. Every slice computes the same scalars;
# the last slice's are copied back. A parameter without state yet (the first step) is stepped the same
# way, each slice creating its own, copied into state of the parameter's shape as it goes. Elementwise
# kernels give every element the same floats wherever the range is cut (tested against one step for
# every optimizer of ``_PER_PARAMETER``, at slice sizes that cut vectors). A parameter is sliced only
# where it, its gradient and its per-element state are contiguous and real, its state holds nothing but
# per-element and scalar tensors, and its group is neither fused nor differentiable; a slice is never
# below ``_LEANEST_SLICE_BYTES``, where the calls would cost more than the bytes they save.
_PER_PARAMETER = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
)

_LEANEST_SLICE_BYTES = 1 << 20
_LOOP_TRANSIENT = 2.2  # a for-loop step's temporaries over its largest parameter (or slice)

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


def _per_element(value: object, p: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == p.shape


def _may_slice(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> bool:
    """Whether ``p`` can be stepped in slices (NOTE [ Slicing a parameter ]), its gradient aside."""
    if group.get("fused") or group.get("differentiable") or p.is_complex() or not p.is_contiguous():
        return False
    return all(not isinstance(v, torch.Tensor) or (v.is_contiguous() if _per_element(v, p) else v.dim() == 0)
               for v in optimizer.state.get(p, {}).values())


def _sliceable(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> bool:
    g = p.grad
    return g is not None and g.layout == torch.strided and g.shape == p.shape and g.is_contiguous() \
        and _may_slice(optimizer, group, p)


def _larger_than_a_slice(p: torch.Tensor, part_bytes: float) -> bool:
    return p.nbytes > max(part_bytes, _LEANEST_SLICE_BYTES)


def _slice_elements(p: torch.Tensor, part_bytes: float) -> int:
    return max(1, int(max(part_bytes, _LEANEST_SLICE_BYTES) // p.element_size()))


def _piece_bytes(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor, part_bytes: float) -> int:
    """The bytes of ``p`` one part holds: all of it, or a slice where it is larger than a part."""
    if _larger_than_a_slice(p, part_bytes) and _may_slice(optimizer, group, p):
        return _slice_elements(p, part_bytes) * p.element_size()
    return p.nbytes


def _split(params: list[torch.Tensor], part_bytes: float, sliced: Callable[[torch.Tensor], bool]
           ) -> list[tuple[list[torch.Tensor], int | None]]:
    """Consecutive parts of at most ``part_bytes`` (or one parameter), each with the number of elements
    per slice where it is one parameter stepped in slices (``sliced``), else None."""
    parts: list[tuple[list[torch.Tensor], int | None]] = []
    size = 0.0
    for p in params:
        if _larger_than_a_slice(p, part_bytes) and sliced(p):
            parts.append(([p], _slice_elements(p, part_bytes)))
            size = float("inf")
            continue
        if not parts or size + p.nbytes > part_bytes:
            parts.append(([], None))
            size = 0.0
        parts[-1][0].append(p)
        size += p.nbytes
    return parts


def optimizer_transient_bytes(optimizer: torch.optim.Optimizer, part_bytes: float | None = None) -> int:
    """Estimated bytes ``optimizer.step()`` allocates beyond its state (NOTE [ The optimizer step's
    transient ]), stepping parts of at most ``part_bytes`` (None: one step; see ``step_in_parts``)."""
    worst = 0
    for group, params in zip(optimizer.param_groups, _params(optimizer), strict=True):
        if not params:
            continue
        if part_bytes is not None and _steppable_in_parts(optimizer):
            if _foreach_in_parts(optimizer, group, params):
                need = max(sum(_piece_bytes(optimizer, group, p, part_bytes) for p in part)
                           for part, _ in _split(params, part_bytes, lambda p, g=group: _may_slice(optimizer, g, p)))
            else:
                need = int(_LOOP_TRANSIENT * max(_piece_bytes(optimizer, group, p, part_bytes) for p in params))
        elif _foreach(group, params):
            need = sum(p.nbytes for p in params)
        else:
            need = int(_LOOP_TRANSIENT * max(p.nbytes for p in params))
        worst = max(worst, need)
    return int(worst)


def leanest_part_bytes(optimizer: torch.optim.Optimizer) -> float | None:
    """The smallest part ``step_in_parts`` can step (the largest parameter that cannot be sliced, or a
    slice: NOTE [ Slicing a parameter ]), or None where the optimizer steps whole (NOTE [ Stepping in
    parts ])."""
    if not _steppable_in_parts(optimizer):
        return None
    return float(max((min(p.nbytes, _LEANEST_SLICE_BYTES) if _may_slice(optimizer, group, p) else p.nbytes
                      for group, params in zip(optimizer.param_groups, _params(optimizer), strict=True)
                      for p in params), default=0))


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


def step_in_parts(optimizer: torch.optim.Optimizer, part_bytes: float | None,
                  before_each: Callable[[int], None] | None = None) -> int:
    """``optimizer.step()``, over parts of at most ``part_bytes`` of parameters (NOTE [ Stepping in
    parts ]), a parameter larger than a part in slices (NOTE [ Slicing a parameter ]); returns the number
    of ``optimizer.step()`` calls. ``before_each(bytes)`` is called before each call of a step in parts
    with that call's estimated transient (NOTE [ The optimizer step's transient ])."""
    if part_bytes is None or not _steppable_in_parts(optimizer):
        optimizer.step()
        return 1
    groups = list(zip(optimizer.param_groups, _params(optimizer), strict=True))
    group_of = {id(p): group for group, params in groups for p in params}
    with_grad = [p for _, params in groups for p in params if p.grad is not None]
    parts = _split(with_grad, part_bytes, lambda p: _sliceable(optimizer, group_of[id(p)], p))
    if len(parts) <= 1 and (not parts or parts[0][1] is None):
        optimizer.step()
        return 1
    grads = [p.grad for p in with_grad]
    modes = [group.get("foreach") for group in optimizer.param_groups]
    calls = 0
    foreach = {id(group): bool(params) and _foreach_in_parts(optimizer, group, params) for group, params in groups}
    try:
        for group in optimizer.param_groups:
            if foreach[id(group)]:
                group["foreach"] = True
        for p in with_grad:
            p.grad = None
        start = 0
        for part, elements in parts:
            for p, g in zip(part, grads[start:start + len(part)], strict=True):
                p.grad = g
            group = group_of[id(part[0])]
            loop = 1.0 if foreach[id(group)] else _LOOP_TRANSIENT
            if elements is None:
                if before_each is not None:
                    before_each(int(loop * sum(p.nbytes for p in part)))
                optimizer.step()
                calls += 1
            else:
                calls += _step_in_slices(optimizer, group, part[0], elements,
                                         None if before_each is None
                                         else lambda nbytes, f=loop: before_each(int(f * nbytes)))
            for p in part:
                p.grad = None
            start += len(part)
    finally:
        for p, g in zip(with_grad, grads, strict=True):
            p.grad = g
        for group, mode in zip(optimizer.param_groups, modes, strict=True):
            group["foreach"] = mode
    return calls


def _step_in_slices(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor, elements: int,
                    before_each: Callable[[int], None] | None) -> int:
    """Step ``p`` alone, ``elements`` of it at a time (NOTE [ Slicing a parameter ]); the other
    parameters have no gradient. Returns the number of slices."""
    state = optimizer.state.get(p)  # a defaultdict: get() does not create
    flat, flat_grad = p.detach().view(-1), p.grad.view(-1)
    n, params = p.numel(), group["params"]
    made: dict[str, torch.Tensor] = {}
    last: dict = {}
    piece = flat
    try:
        for start in range(0, n, elements):
            end = min(n, start + elements)
            piece = flat[start:end]
            piece.grad = flat_grad[start:end]
            views = {k: v.view(-1)[start:end] for k, v in (state or {}).items() if _per_element(v, p)}
            if state:
                optimizer.state[piece] = {k: views[k] if k in views else v.clone() if isinstance(v, torch.Tensor)
                                          else v for k, v in state.items()}
            group["params"] = [piece]
            if before_each is not None:
                before_each(piece.nbytes)
            optimizer.step()
            last = optimizer.state.pop(piece, {})
            for k, v in last.items():
                if k in views and v is not views[k]:  # replaced rather than updated in place
                    views[k].copy_(v)
                elif not state and _per_element(v, piece):
                    if k not in made:
                        made[k] = torch.empty(p.shape, dtype=v.dtype, device=v.device)
                    made[k].view(-1)[start:end].copy_(v)
    finally:
        group["params"] = params
        optimizer.state.pop(piece, None)
    if state:
        for k, v in last.items():
            if _per_element(state.get(k), p):
                continue
            if isinstance(state.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                state[k].copy_(v)
            else:
                state[k] = v
    elif last:
        optimizer.state[p] = {k: made.get(k, v) for k, v in last.items()}
    return -(-n // elements)
