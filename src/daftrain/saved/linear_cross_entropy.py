"""Cross-entropy over a wide linear layer's output (a language model's head), run as one function of the layer's
input, weight and bias: nothing of the logits' size saved, or created in backward
(``NOTE [ Cross-entropy over a wide linear layer ]``)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..params import grad_leaf, grad_writable
from .cross_entropy import REDUCTIONS

__all__ = ["CHUNK_BYTES", "LinearCall", "LinearOutputs", "cross_entropy_over_linear"]

CHUNK_BYTES = {"cpu": 16 << 20, "cuda": 32 << 20}
"""By device, the most bytes of logits forward and backward hold at a time (at least one row, or one column of
a tile): forward's temporaries and backward's one tile are that size."""

TILE_ROWS = 4096
"""Backward works on tiles of at most this many rows by as many classes as fit in ``CHUNK_BYTES``: each tile
reads its block of the weight twice and adds to that block's gradient once, so tall tiles keep that traffic a
small share of the tile's matmuls."""


# NOTE [ Cross-entropy over a wide linear layer ]
# A language model's head maps a narrow hidden state (GPT-2: 768 values a token) to a wide vocabulary
# (50257 logits), and its loss is cross-entropy over those logits. Even saving the logits instead of their
# log-probabilities (``NOTE [ Cross-entropy that saves its logits ]``), the forward makes log-probabilities
# of the logits' size and the backward holds two logits-sized tensors (decoded logits, their gradient):
# 412 MB each for GPT-2 small at 8 x 256 tokens, the largest tensors of its step. Under ``compress``, a
# ``F.cross_entropy`` call whose logits are the output of a linear call that is *wide* (its output takes more
# bytes at ``LOGITS_MIN_BITS`` than its input exact), unchanged since, as a whole (the output or a contiguous
# reshape of it with the same last dim), runs as a function of that call's input, weight and bias instead:
#   - forward computes the loss from the logits that exist, a chunk of rows at a time (``CHUNK_BYTES``) with
#     PyTorch's own ops: no log-probabilities of the logits' size; it saves the input (exact: fewer bytes
#     than the logits at 8 bits), the weight, the bias and each row's logsumexp (one value a row);
#   - backward works on tiles of rows by classes (``TILE_ROWS``): each tile's logits come from the forward's
#     output while that is alive and unchanged (the caller still holds it), else are recomputed from the
#     exact input; its gradient, ``(softmax - one_hot(target)) * scale`` with the softmax ``exp(logits -
#     logsumexp)``, is written over them, and the input's, weight's and bias's gradients take their parts:
#     one tile-sized temporary, nothing of the logits' size. With the logsumexp known, a tile needs no
#     other columns of its rows, so a tile spans every row up to ``TILE_ROWS``: the weight's gradient for a
#     block of classes is summed over few row tiles (one up to ``TILE_ROWS`` rows), not over many chunks.
# A half-precision head (bfloat16 under autocast, or a bfloat16 model) whose output is cast up once for the loss
# (``logits.float()``) is taken too: backward recomputes the logits in the head's dtype and runs the gradients'
# matmuls in it, as the layer's own backward does, summing their partials in float32.
# The loss reaches the input, weight and bias through this function, not through the linear call's node,
# which gets no gradient from it (another use of the logits still sends its own gradient through that node).
# The gradient is the same function of exact values as plain PyTorch's, with the logits exact where the
# function that saves them stores them at 8 bits; the softmax from the logsumexp and the sums over tiles
# (the loss over chunks of rows, the input's gradient over blocks of classes) round differently, so results
# equal plain's to float rounding, not bit for bit.
# A hook on the output waits for a gradient the function would never send there. Where the logits or their
# base carry one, the call is left to the logits-saving function; a hook on an intermediate view, or one
# registered after the loss was computed, cannot be seen, and sees no gradient. FSDP gathers a resharded
# module's weight from such a hook and queues its gradient reduction from it (a missed one is a gradient
# never reduced, silently), and the output it hooks may be a view gone by the loss: in a process group of
# more than one rank nothing is taken over (DDP too: it could not be told apart from here). Where the
# weight's memory was freed between forward and backward anyway, backward raises, and
# ``CompressionConfig(linear_cross_entropy=False)`` turns this off.


@dataclass(frozen=True)
class LinearCall:
    """A linear call: its output's autograd node and a reference to the output, its input, weight and bias, the
    versions of the four at the call, and the dtype it computed in (its output's: under autocast, not its
    inputs')."""

    node: Any
    output: weakref.ReferenceType[torch.Tensor]
    input: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    versions: tuple[int, int, int, int]
    dtype: torch.dtype


def _versions(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
              b: torch.Tensor | None) -> tuple[int, int, int, int]:
    return out._version, x._version, w._version, -1 if b is None else b._version


# Nodes of views that keep every element in order: a contiguous result of a chain of them is a reshape.
_RESHAPE_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0"})


def _sharded() -> bool:
    """More than one rank: a module may be sharded (FSDP), with hooks on outputs that cannot all be seen."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class LinearOutputs:
    """Per thread, the latest wide linear call (its input: at most its output's size at 8 bits), until a
    cross-entropy takes it, another wide call replaces it, or the context exits (``OpTracer.stop``).

    The output is identified by its autograd node, which the record holds (so it cannot be freed and its
    identity reused): a tensor is the call's whole output if its node is that node or reaches it through
    reshapes only, it is contiguous with the output's last dim, nothing was written in place since (a view
    shares its base's version counter), no hook waits for its gradient, and no other rank may shard it."""

    def __init__(self) -> None:
        self._last: LinearCall | None = None

    def note(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        self._last = LinearCall(out.grad_fn, weakref.ref(out), x, weight, bias, _versions(out, x, weight, bias),
                                out.dtype)

    def take(self, logits: torch.Tensor) -> LinearCall | None:
        """The noted call if ``logits`` is its whole, unchanged output, or that output cast up once to the logits'
        dtype (``logits.float()`` of a bfloat16 output); the record is then dropped."""
        call = self._last
        if call is None or _versions(logits, call.input, call.weight, call.bias)[1:] != call.versions[1:]:
            return None
        classes = call.weight.shape[0]
        if not (logits.dim() == 2 and logits.shape[1] == classes and logits.is_contiguous()
                and logits.shape[0] * call.weight.shape[1] == call.input.numel()
                and logits.device == call.weight.device):
            return None
        if logits._backward_hooks or (logits._base is not None and logits._base._backward_hooks) or _sharded():
            return None  # a hook waits for the output's gradient, which the function would never send
        node, cast = logits.grad_fn, False
        while node is not None and node is not call.node:
            name = type(node).__name__
            if name == "ToCopyBackward0" and not cast and call.dtype != logits.dtype:
                cast = True  # a copy made once and not written since: what it holds is what the call computed
            elif name not in _RESHAPE_NODES:
                return None
            node = node.next_functions[0][0]
        if node is not call.node or (not cast and logits._version != call.versions[0]):
            return None
        self._last = None
        return call


def cross_entropy_over_linear(call: LinearCall, input: torch.Tensor, target: torch.Tensor, weight: Any = None,
                              size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                              reduction: str = "mean", label_smoothing: float = 0.0, *,
                              grad_in_place: bool = False) -> torch.Tensor:
    """``F.cross_entropy`` of ``call``'s output ``input`` (a call ``saves_logits`` took and ``LinearOutputs.take``
    matched; the same signature). With ``grad_in_place`` the weight's gradient is added into its ``.grad`` where it
    may be (``NOTE [ Weight gradients accumulated in place ]`` in ``budget/weight_grads.py``)."""
    w = call.weight
    early = (torch.is_grad_enabled() and call.input.requires_grad and not w.requires_grad
             and call.dtype in _EARLY_DTYPES)
    param = w if grad_in_place and grad_leaf(w) and call.dtype == w.dtype else None
    return _OverLinear.apply(call.input, w, call.bias, input.detach(), target, ignore_index, reduction,
                             call.output, call.versions[0], call.dtype, early, param)


_EARLY_DTYPES = (torch.float32, torch.bfloat16)
"""Heads whose input's gradient forward may compute for a loss gradient of 1 (``NOTE [ A frozen head's input
gradient, computed in forward ]``): not float16, whose loss scaling multiplies the gradient before it is rounded."""


# NOTE [ A frozen head's input gradient, computed in forward ]
# The loss is a scalar, so every gradient this function returns is its gradient for a loss gradient of 1 times
# the loss gradient backward receives. Where the head's weight takes no gradient (a frozen head: LoRA and other
# adapters leave it so) backward needs only the input's (and the bias's) gradient, and forward, which holds the
# logits chunk by chunk anyway, computes them there from the logits the layer made: ``(softmax - one_hot) *
# scale`` over each chunk, times the weight; backward then multiplies by the loss gradient. Backward recomputes
# no logits (one matmul of the head's size, a large share of a small model's step), and what forward keeps for it
# is one tensor of the input's size in float32. Not for float16 heads: a loss scaler multiplies the loss
# gradient into the logits' gradient before the float16 matmul, whose small products would underflow without it.
# A backward that builds a graph (``create_graph``) still runs the whole-tensor ops on the saved input.



class _OverLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                output: weakref.ReferenceType[torch.Tensor], output_version: int, dtype: torch.dtype,
                early: bool, param: torch.Tensor | None) -> torch.Tensor:
        rows, classes = logits.shape
        step = max(1, CHUNK_BYTES.get(logits.device.type, CHUNK_BYTES["cpu"]) // (classes * logits.element_size()))
        log_probs = logits.new_empty((min(step, rows), classes))
        logsumexp = logits.new_empty(0 if early else rows)  # read by the tiled backward alone, not an early one's
        total = logits.new_zeros(())
        # nll_loss's total weight without class weights: the rows not ignored
        valid = target != ignore_index
        counted = valid.sum().to(logits.dtype)
        if early:  # NOTE [ A frozen head's input gradient, computed in forward ]
            scale = torch.where(valid, 1 / counted if reduction == "mean" else 1.0, 0.0)
            w = weight.to(dtype)
            dx = logits.new_empty((rows, weight.shape[1]))
            db = logits.new_zeros(classes) if bias is not None and bias.requires_grad else None
        for s in range(0, rows, step):
            n = min(step, rows - s)
            torch._log_softmax(logits[s:s + n], 1, False, out=log_probs[:n])
            part, _ = torch.ops.aten.nll_loss_forward(log_probs[:n], target[s:s + n], None, REDUCTIONS["sum"],
                                                      ignore_index)  # checks the targets as plain's does
            total += part
            if not early:
                torch.logsumexp(logits[s:s + n], 1, out=logsumexp[s:s + n])
            else:
                sc = scale[s:s + n, None]
                d = log_probs[:n].exp_().mul_(sc)  # the softmax from the log-probabilities, its nll taken
                _subtract_one_hot(d, target[s:s + n], 0, sc)
                if db is not None:
                    db.add_(d.sum(0))
                _write(dx[s:s + n], d.to(dtype), w, first=True)
        del log_probs
        ctx.early = (dx, db) if early else None
        ctx.param = param  # the parameter itself (NOTE [ The parameter itself ] in budget/weight_grads.py)
        ctx.ignore_index, ctx.reduction = ignore_index, REDUCTIONS[reduction]
        ctx.output, ctx.output_version, ctx.has_bias, ctx.dtype = output, output_version, bias is not None, dtype
        ctx.save_for_backward(x, weight, bias if bias is not None else weight.new_empty(0), target, counted,
                              logsumexp)
        return total / counted if reduction == "mean" else total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, bias_or_empty, target, counted, logsumexp = ctx.saved_tensors
        bias = bias_or_empty if ctx.has_bias else None
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        rows_x = x.reshape(-1, x.shape[-1])
        if weight.untyped_storage().nbytes() < weight.numel() * weight.element_size():
            raise UnsupportedError(
                "the weight of the linear layer before F.cross_entropy was freed between forward and backward "
                "(an FSDP module resharded after its forward?); pass compress(linear_cross_entropy=False) so "
                "that the loss's gradient goes through the layer's own backward")
        cd = ctx.dtype  # the layer's own arithmetic: in its output's dtype (bfloat16 under autocast)
        if ctx.early is not None and not torch.is_grad_enabled():
            dx, db = ctx.early
            return ((dx * grad).to(x.dtype).view_as(x) if need_x else None, None,
                    (db * grad).to(bias.dtype) if need_b and db is not None else None, *(None,) * 9)
        if torch.is_grad_enabled():  # create_graph: the same ops as plain on the whole tensor, differentiable
            logits = F.linear(rows_x.to(cd), weight.to(cd), None if bias is None else bias.to(cd))
            log_probs = torch.log_softmax(logits.to(logsumexp.dtype), 1)
            nll = torch.ops.aten.nll_loss_backward(grad, log_probs, target, None, ctx.reduction, ctx.ignore_index,
                                                   counted)
            d = torch.ops.aten._log_softmax_backward_data(nll, log_probs, 1, log_probs.dtype).to(cd)
            return ((d @ weight.to(cd)).to(x.dtype).view_as(x) if need_x else None,
                    (d.t() @ rows_x.to(cd)).to(weight.dtype) if need_w else None,
                    d.sum(0).to(bias.dtype) if need_b and bias is not None else None, *(None,) * 9)
        out = ctx.output()
        live = out.view(-1, weight.shape[0]) if out is not None and out._version == ctx.output_version else None
        valid = target != ctx.ignore_index
        # each row's gradient is (softmax - one_hot) times this: the loss's gradient over the rows counted (mean)
        scale = torch.where(valid, grad / counted if ctx.reduction == REDUCTIONS["mean"] else grad, 0.0)
        same = cd == logsumexp.dtype == weight.dtype == x.dtype  # float32 throughout: the logits recomputed in place
        dx = torch.zeros(rows_x.shape, dtype=logsumexp.dtype, device=x.device) if need_x else None
        into = ctx.param if ctx.param is not None and need_w and grad_writable(ctx.param, weight) else None
        added = into is not None and into.grad is not None  # the weight's gradient added into .grad as it is made
        dw = (into.grad if added else torch.empty_like(weight)) if need_w else None
        db = torch.empty_like(bias) if need_b and bias is not None else None
        rows, classes = rows_x.shape[0], weight.shape[0]
        tile_rows = min(rows, TILE_ROWS)
        chunk_bytes = CHUNK_BYTES.get(weight.device.type, CHUNK_BYTES["cpu"])
        cols = min(classes, max(1, chunk_bytes // (tile_rows * logsumexp.element_size())))
        tile = logsumexp.new_empty((tile_rows, cols))
        for c in range(0, classes, cols):
            nc = min(cols, classes - c)
            w = weight[c:c + nc].to(cd)
            b = None if bias is None else bias[c:c + nc].to(cd)
            # the weight's and bias's gradients for these classes, summed over the row tiles in float32: a
            # half-precision weight's gradient over several row tiles is summed in a block of its own
            summed = dw is not None and dw.dtype != logsumexp.dtype and rows > tile_rows
            dw_c = dw.new_empty((nc, dw.shape[1]), dtype=logsumexp.dtype) if summed else (
                None if dw is None else dw[c:c + nc])
            db_c = None if db is None else logsumexp.new_zeros(nc)
            for r in range(0, rows, tile_rows):
                nr = min(tile_rows, rows - r)
                xs, tg = rows_x[r:r + nr].to(cd), target[r:r + nr]
                d = tile[:nr, :nc]
                if live is not None:
                    d.copy_(live[r:r + nr, c:c + nc])
                elif not same:
                    d.copy_(F.linear(xs, w, b))
                elif b is not None:
                    torch.addmm(b, xs, w.t(), out=d)
                else:
                    torch.mm(xs, w.t(), out=d)
                sc = scale[r:r + nr, None]
                d.sub_(logsumexp[r:r + nr, None]).exp_().mul_(sc)
                _subtract_one_hot(d, tg, c, sc)
                dc = d.to(cd)  # itself where the layer computes in float32
                if dx is not None:
                    _write(dx[r:r + nr], dc, w, first=False)
                if dw_c is not None:
                    _write(dw_c, dc.t(), xs, first=r == 0 and (summed or not added))
                if db_c is not None:
                    db_c.add_(d.sum(0))
            if summed and added:
                dw[c:c + nc].add_(dw_c)
            elif summed:
                dw[c:c + nc].copy_(dw_c)
            if db is not None and db_c is not None:
                db[c:c + nc].copy_(db_c)
        if into is not None:
            if not added:
                into.grad = dw
            dw = None
        return (dx.to(x.dtype).view_as(x) if dx is not None else None, dw, db, *(None,) * 9)


def _subtract_one_hot(d: torch.Tensor, target: torch.Tensor, first: int, scale: torch.Tensor) -> None:
    """``d[i, target[i] - first] -= scale[i]`` for the rows whose target is among ``d``'s columns, without reading
    which rows those are back to the host: any other row subtracts zero from its first column."""
    hit = (target >= first) & (target < first + d.shape[1])
    d.scatter_add_(1, torch.where(hit, target - first, 0)[:, None], torch.where(hit[:, None], scale, 0.0).neg_())


def _write(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``dst = a @ b`` (``first``) or ``dst += a @ b``, without a temporary where the dtypes agree, and where they
    do not (half-precision factors, a float32 sum) without rounding the product to half precision first where
    the device's matmul can write float32 (CUDA)."""
    if dst.dtype == a.dtype and first:
        torch.mm(a, b, out=dst)
    elif dst.dtype == a.dtype:
        dst.addmm_(a, b)
    else:
        ab = torch.ops.aten.mm.dtype(a, b, dst.dtype) if _MM_OUT_DTYPE and dst.is_cuda else a @ b
        if first:
            dst.copy_(ab)
        else:
            dst.add_(ab)


_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")
"""This PyTorch has ``aten::mm.dtype``: half-precision factors, a float32 product (its kernels are CUDA's)."""
