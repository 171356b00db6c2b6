"""Batches as the budgeted step sees them: their size, slices of them, what a mean loss counts, and the
loss ``loss_fn`` returns for one.

A batch is a tensor, or a tuple/list/dict (nested) holding tensors whose dim 0 is the sample
dimension; anything else in it (strings, flags, 0-d tensors) is passed to every slice as is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["CountFn", "balanced_sizes", "batch_size", "checked_loss", "head_copy", "shapes_of", "slice_copy",
           "split_batch", "token_count"]

CountFn = Callable[[Any], int | torch.Tensor]


def _tensors(batch: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``batch`` with where it is (``batch['ids']``, ``batch[1][0]``), in order."""
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for key, item in batch.items():
            yield from _tensors(item, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, item in enumerate(batch):
            yield from _tensors(item, f"{path}[{i}]")


# NOTE [ Every tensor of a batch is split ]
# A micro-batch is a slice along dim 0 of every tensor of the batch, so a tensor whose dim 0 is not the
# samples' would be cut into pieces that do not belong to the samples beside them: a time-first sequence
# (``nn.LSTM`` without ``batch_first``) split into time steps, class weights into classes. Where the sizes
# disagree that is certain, and the step refuses the batch naming the tensor; where they agree by chance
# (as many time steps as samples) no check can tell, hence the module docstring's rule.
def batch_size(batch: Any) -> int:
    """Samples in ``batch``: dim 0 of its tensors, which must agree (``NOTE [ Every tensor of a batch is split ]``)."""
    found = [(path, t) for path, t in _tensors(batch) if t.dim() > 0]
    if not found:
        got = ("a 0-d tensor" if isinstance(batch, torch.Tensor) else f"{type(batch).__name__} holding only 0-d "
               "tensors" if next(_tensors(batch), None) is not None else type(batch).__name__)
        raise ArgumentTypeError(
            f"a batch must be a tensor, or a tuple/list/dict holding tensors with a batch dimension (dim 0), got "
            f"{got}; pass the samples as tensors of shape (batch, ...)")
    (first_path, first), samples = found[0], int(found[0][1].shape[0])
    for path, t in found[1:]:
        if t.shape[0] != samples:
            raise InvalidArgumentError(
                f"BudgetedStep splits a batch into micro-batches along dim 0 of every tensor in it, but {path} "
                f"(shape {tuple(t.shape)}) has {t.shape[0]} along dim 0 where {first_path} (shape "
                f"{tuple(first.shape)}) has {samples}; put the sample dimension first in every tensor of the batch "
                "(a time-first sequence: transpose it inside loss_fn), and give loss_fn what is not per sample "
                "(class weights, a shared mask) another way, e.g. through a closure")
    return samples


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


def slice_copy(batch: Any, start: int, n: int) -> Any:
    """Samples ``start`` to ``start + n`` of ``batch`` (at most its end) as a copy with its own storage, so
    storage-based byte counts see the slice, not the whole batch it views."""
    total = batch_size(batch)
    n = min(n, total - start)
    if start == 0 and n == total:
        return _clone(batch)
    return _clone(split_batch(batch, [start, n, total - start - n])[1])


def head_copy(batch: Any, n: int) -> Any:
    """The first ``n`` samples of ``batch`` (all of it if it has fewer) as a copy with its own storage."""
    return slice_copy(batch, 0, n)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, Mapping):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        items = [_clone(v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def balanced_sizes(total: int, k: int) -> list[int]:
    """``total`` samples in ``k`` slices whose sizes differ by at most one, the larger ones first."""
    base, extra = divmod(total, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def shapes_of(batch: Any, samples: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The shapes of ``batch``'s tensors in order, dim 0 set to ``samples`` where given (the shapes of a
    slice of that many samples): what a backend's per-shape caches tell micro-batches apart by."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or samples is None:
            return (tuple(batch.shape),)
        return ((samples, *batch.shape[1:]),)
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return tuple(shape for item in batch for shape in shapes_of(item, samples))
    return ()


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


def checked_loss(loss: Any, backward: bool = True) -> torch.Tensor:
    """``loss``, what ``loss_fn`` returned for a micro-batch, if it is one floating-point value whose backward
    reaches the model (``backward``); else an error naming what it is and what to return."""
    if not isinstance(loss, torch.Tensor):
        hint = (" (a model output: return its .loss)" if hasattr(loss, "loss") else
                " (a Python number has no graph: return the tensor itself)" if isinstance(loss, int | float) else "")
        raise ArgumentTypeError(f"BudgetedStep loss_fn must return the loss as a tensor holding one value, got "
                                f"{type(loss).__name__}{hint}")
    if loss.numel() != 1 or not (loss.is_floating_point() or loss.is_complex()):
        raise InvalidArgumentError(
            f"BudgetedStep loss_fn must return one floating-point value (the batch's loss, reduced as "
            f"reduction= says), got a {loss.dtype} tensor of shape {tuple(loss.shape)}; reduce it, e.g. with "
            "reduction='mean' in the loss function")
    if backward and not loss.requires_grad:
        raise InvalidArgumentError(
            "BudgetedStep loss_fn returned a loss that does not require grad, so backward would reach no "
            "parameter: compute it from the model's output outside torch.no_grad() and without .detach(), and "
            "give the optimizer parameters with requires_grad=True")
    return loss
