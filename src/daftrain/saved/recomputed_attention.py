"""Attention that saves only its inputs and recomputes itself in backward (``NOTE [ Attention recomputed from
its stored inputs ]``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["attention_recomputed", "recomputes"]


# NOTE [ Attention recomputed from its stored inputs ]
# ``F.scaled_dot_product_attention`` saves, besides q, k and v, what its forward computed from them: the
# output and each row's logsumexp (the fused kernels), or the probabilities, the dropout mask and scaled
# copies of q and k (the math path, which the CPU takes under dropout or with a mask that requires grad:
# ``n**2`` values per head). Its backward relies on identities between them: the rows of
# ``exp(scale * q k^T - logsumexp)`` sum to 1, and ``rowsum(dO * out)`` equals ``rowsum(P * dP)``, so each
# row of the logits' gradient sums to zero. Rounded one by one, those tensors belong to no single forward:
# the identities fail and what they leave over is a bias of ``dq`` and ``dk`` that does not average out,
# large where probabilities are peaked (``NOTE [ Op rules ]``, 2.). Under the ``attention_qk`` rule the call
# runs as a function that saves only q, k, v and its mask (``NOTE [ Attention logits that need more than 8
# bits ]`` in ``attention_precision.py`` says how precisely) and, in backward, runs the same
# call again on the restored q, k and v (under the forward's random state: the same dropout mask) and
# backpropagates through it: the exact gradient of attention at the rounded inputs, every identity intact.
# It stores neither the output nor the logsumexp, nor the probabilities and the dropout mask: fewer bytes
# and a smaller gradient error, for one more forward of the attention per call in backward. Both runs go
# through the same path (grad enabled, the same inputs requiring grad, so the same kernel and dropout), with
# saved-tensor hooks that keep what the inner call saves as it is (detached: a saved output that held its own
# ``grad_fn`` would be a reference cycle through C++ that no collector frees), for as long as that one call's
# gradient is being taken. Under ``create_graph`` the second run uses the restored tensors themselves, so
# the gradient is differentiable in them.
def recomputes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an SDPA call with these arguments runs as ``attention_recomputed``: it builds a graph and its
    inputs are plain dense tensors."""
    names = ("query", "key", "value", "attn_mask")
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    q, k, v, mask = (bound.get(n) for n in names)
    if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested for t in (q, k, v)):
        return False
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.layout == torch.strided):
        return False
    grads = any(t.requires_grad for t in (q, k, v, mask) if isinstance(t, torch.Tensor))
    return grads and torch.is_grad_enabled() and type(q) is torch.Tensor


def attention_recomputed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                         scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (the same signature and output) that saves only its inputs."""
    return _Recomputed.apply(query, key, value, attn_mask, (dropout_p, is_causal, scale, enable_gqa))


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _as_stored(t: torch.Tensor) -> torch.Tensor:
    return t


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               options: tuple[float, bool, float | None, bool]) -> torch.Tensor:
    dropout_p, is_causal, scale, enable_gqa = options
    with torch.autograd.graph.saved_tensors_hooks(_detached, _as_stored):
        return torch.ops.aten.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale=scale,
                                                           enable_gqa=enable_gqa)


class _RandomState:
    """The generator states a dropout draws from (the CPU's, and the device's where the inputs are on one)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """The generators start from these states inside, and are put back as they were after."""
        with torch.random.fork_rng(devices=[self.device] if self.accelerator is not None else []):
            torch.set_rng_state(self.cpu)
            if self.accelerator is not None:
                torch.cuda.set_rng_state(self.accelerator, self.device)
            yield


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                mask: torch.Tensor | None, options: tuple[float, bool, float | None, bool]) -> torch.Tensor:
        ctx.options = options
        ctx.random = _RandomState(q.device) if options[0] > 0 else None
        ctx.needs = tuple(t is not None and t.requires_grad for t in (q, k, v, mask))
        ctx.save_for_backward(q, k, v, mask)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(needs) if t is not None else None
                      for t, needs in zip((q, k, v, mask), ctx.needs, strict=True)]
            return _attention(*leaves, options).detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        create_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            inputs = [t if t is None or (create_graph and t.requires_grad) else t.detach().requires_grad_(needs)
                      for t, needs in zip(saved, ctx.needs, strict=True)]
            with ctx.random.restored() if ctx.random is not None else contextlib.nullcontext():
                out = _attention(*inputs, ctx.options)
        wrt = [t for t, needs in zip(inputs, ctx.needs, strict=True) if needs]
        grads = iter(torch.autograd.grad(out, wrt, grad, create_graph=create_graph))
        return (*(next(grads) if needs else None for needs in ctx.needs), None)
