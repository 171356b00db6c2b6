"""Cross-entropy that saves its logits (saved/cross_entropy.py, the ``cross_entropy`` op rule): the same loss and
gradient bit for bit from exact logits, one logits-sized tensor less in backward, other calls left as they are.
The problems here have a wide head, which ``linear_cross_entropy`` (tests/saved/test_linear_cross_entropy.py)
would take; these tests turn it off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import CreatedTensors

import daftrain
from daftrain.saved.cross_entropy import cross_entropy_saving_logits, saves_logits

ROWS, CLASSES = 1200, 2000  # more rows than one chunk on the CPU (CHUNK_BYTES: 524 rows here)


def _problem(seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = torch.nn.Linear(64, CLASSES)
    h = torch.randn(ROWS, 64, generator=gen) * 3
    target = torch.randint(0, CLASSES, (ROWS,), generator=gen)
    target[::7] = -100  # ignored rows
    return head, h, target


def _run(head, h, target, ctx, **kwargs):  # type: ignore[no-untyped-def]
    head.zero_grad()
    if ctx is None:
        loss = F.cross_entropy(head(h), target, **kwargs)
    else:
        with ctx:
            loss = F.cross_entropy(head(h), target, **kwargs)
    loss.backward()
    return loss.detach(), torch.cat([head.weight.grad.flatten(), head.bias.grad])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_function_gives_plain_loss_bit_for_bit_and_its_gradient(reduction: str) -> None:
    x = (torch.randn(ROWS, CLASSES) * 4).requires_grad_()
    target = torch.randint(0, CLASSES, (ROWS,))
    target[::5] = 7
    target[1] = -100
    plain = F.cross_entropy(x, target, reduction=reduction)
    (want,) = torch.autograd.grad(plain * 1.3, x)
    ours = cross_entropy_saving_logits(x, target, reduction=reduction)
    (got,) = torch.autograd.grad(ours * 1.3, x)
    assert torch.equal(ours, plain)
    assert torch.equal(got, want)  # each row's arithmetic is PyTorch's own, chunk by chunk


def test_every_row_ignored_gives_what_plain_gives() -> None:
    x = torch.randn(8, 50, requires_grad=True)
    target = torch.full((8,), -100)
    for reduction in ("mean", "sum"):
        plain = F.cross_entropy(x, target, reduction=reduction)
        (want,) = torch.autograd.grad(plain, x)
        ours = cross_entropy_saving_logits(x, target, reduction=reduction)
        (got,) = torch.autograd.grad(ours, x)
        torch.testing.assert_close(ours, plain, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_double_backward_matches_plain() -> None:
    x = torch.randn(40, 30, requires_grad=True)
    target = torch.randint(0, 30, (40,))
    target[3] = -100

    def second(loss_fn):  # type: ignore[no-untyped-def]
        (g,) = torch.autograd.grad(loss_fn(x, target), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), x)
        return gg

    assert torch.equal(second(cross_entropy_saving_logits), second(F.cross_entropy))


def test_under_compress_the_loss_is_plain_and_the_gradient_close() -> None:
    head, h, target = _problem()
    plain_loss, plain_grad = _run(head, h, target, None)
    ctx = daftrain.compress(bits=2, linear_cross_entropy=False)
    loss, grad = _run(head, h, target, ctx)
    assert torch.equal(loss, plain_loss)  # forward unchanged
    # the logits are exponentiated in backward: stored at LOGITS_MIN_BITS (8) even under bits=2
    assert F.cosine_similarity(grad.double(), plain_grad.double(), dim=0).item() >= 0.999
    assert ctx.stats.compressed == 1  # the logits (the Linear's input is the batch, a constant)
    assert ctx.stats.packed_bytes > ROWS * CLASSES  # 8 bits a value, not 2
    exact = daftrain.compress(bits=None)
    assert torch.equal(_run(head, h, target, exact)[1], plain_grad)  # exact mode: no rule runs


def test_backward_creates_one_logits_sized_tensor_not_two() -> None:
    # NOTE [ Cross-entropy that saves its logits ]: plain backward makes nll_loss's gradient and
    # log_softmax's; the function writes one (beside the decoded logits, which the unpack makes)
    counts = []
    for ctx in (None, daftrain.compress(bits=8, linear_cross_entropy=False)):
        head, h, target = _problem()
        with ctx if ctx is not None else torch.enable_grad():
            loss = F.cross_entropy(head(h), target)
        probe = CreatedTensors()
        with probe:
            loss.backward()
        counts.append(probe.numels.count(ROWS * CLASSES))
    assert counts == [2, 1]


@pytest.mark.parametrize("kwargs", [
    {"weight": torch.rand(CLASSES)}, {"label_smoothing": 0.1}, {"reduction": "none"},
])
def test_other_calls_run_as_they_are(kwargs) -> None:  # type: ignore[no-untyped-def]
    head, h, target = _problem()
    x = head(h)
    assert saves_logits((x, target), dict(kwargs)) is None
    if kwargs.get("reduction") == "none":
        return
    plain_loss, plain_grad = _run(head, h, target, None, **kwargs)
    loss, grad = _run(head, h, target, daftrain.compress(bits=8, min_numel=0, linear_cross_entropy=False), **kwargs)
    assert torch.equal(loss, plain_loss)
    assert F.cosine_similarity(grad.double(), plain_grad.double(), dim=0).item() >= 0.999


def test_which_calls_are_taken_over() -> None:
    x = torch.randn(6, 5, requires_grad=True)
    t = torch.randint(0, 5, (6,))
    assert saves_logits((x, t), {}) is x
    assert saves_logits((x,), {"target": t, "ignore_index": 3, "reduction": "sum"}) is x
    assert saves_logits((x.detach(), t), {}) is None  # nothing to differentiate
    assert saves_logits((x.double(), t), {}) is None
    assert saves_logits((x.view(2, 3, 5), t.view(2, 3)), {}) is None  # N-d logits
    assert saves_logits((x, torch.softmax(x, 1).detach()), {}) is None  # class probabilities
    with torch.no_grad():
        assert saves_logits((x, t), {}) is None
