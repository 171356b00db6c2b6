"""The op rules inside compiled graphs (saved/graph_rules.py) and the traced encodings they choose
(saved/compiled.py), each against the compiled model without compression."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daftrain
from daftrain.saved import graph_rules
from daftrain.saved.compiled import GraphRule, _beside, _normalized, _representatives
from daftrain.saved.records import Normalized

# Cosine between a compressed gradient and the exact one at 8 bits: the suite's bound for 8-bit
# activations (tests/saved/test_compiled.py).
COSINE_8_BITS = 0.999


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _without_rules(monkeypatch) -> None:
    """The traced pack as it was before the rules: every float value quantized at the configured bits."""
    monkeypatch.setattr("daftrain.saved.compiled.graph_rule", lambda node, bw_graph, bits: (
        graph_rules.GraphRule("keep", "") if graph_rules._is_auxiliary(node) else None))


def _grads(module: nn.Module, fn, x: torch.Tensor, ctx, backend: str) -> torch.Tensor:
    torch._dynamo.reset()
    module.zero_grad(set_to_none=True)
    compiled = torch.compile(fn, backend=backend)
    if ctx is None:
        out = compiled(x)
    else:
        with ctx:
            out = compiled(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * w).sum().backward()
    return torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.grad is not None])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double(), b.double(), dim=0))


def _masked(lin: nn.Linear):
    def fn(x):
        # an additive attention mask of zeros and finfo.min built from the input, as a causal and padding
        # mask is; SDPA's backward reads it
        keep = (x[..., :32] > -1.0) | torch.eye(32, dtype=torch.bool)
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None]
        h = lin(x).view(4, 32, 4, 16).transpose(1, 2)
        return F.scaled_dot_product_attention(h, h, h, attn_mask=mask)

    return fn


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_constants_are_kept(backend, monkeypatch):
    # Quantized, the mask's decoded zeros were off by up to ~1e36 and the gradient not finite, or wrong
    # (NOTE [ Op rules in compiled graphs ], 1.).
    lin, x = nn.Linear(64, 64), torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(0))
    plain = _grads(lin, _masked(lin), x, None, backend)
    ctx = daftrain.compress(bits=8, min_numel=0)
    got = _grads(lin, _masked(lin), x, ctx, backend)
    assert torch.isfinite(plain).all() and torch.isfinite(got).all()
    assert _cos(got, plain) >= COSINE_8_BITS, ctx.stats.summary()
    saved = [(s.how, s.raw_bytes) for g in ctx._hooks.graphs() for s in g]
    assert ("kept", 4 * 32 * 32 * 4) in saved, saved  # the mask, [4, 1, 32, 32] float32
    _without_rules(monkeypatch)
    got = _grads(lin, _masked(lin), x, daftrain.compress(bits=8, min_numel=0), backend)
    assert not torch.allclose(got, plain, rtol=1e-3, atol=1e-3)


def _class_token_rows() -> torch.Tensor:
    """Token rows of unit spread after rows of zeros (a ViT's class tokens at initialisation)."""
    x = torch.randn(8, 33, 64, generator=torch.Generator().manual_seed(0))
    x[:, 0] = 0.0
    return x


class _PreNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(33, 64))
        self.norm = nn.LayerNorm(64, eps=1e-12)
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x * 1.0 + self.pos))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_normalisation_inputs_are_stored_normalised(backend, monkeypatch):
    # LayerNorm backward re-normalises its input with the exact rstd (1e6 for the rows of zeros): their
    # rounding error was multiplied by it (NOTE [ Op rules in compiled graphs ], 2.). Under inductor
    # the partitioner saves x * 1.0 and recomputes the sum with the position embedding in backward.
    model, x = _PreNorm(), _class_token_rows()
    plain = _grads(model, model, x, None, backend)
    ctx = daftrain.compress(bits=8, min_numel=0)
    assert _cos(_grads(model, model, x, ctx, backend), plain) >= COSINE_8_BITS
    if backend == "aot_eager":  # inductor's partitioner saves this one's normalised output instead
        _without_rules(monkeypatch)
        assert _cos(_grads(model, model, x, daftrain.compress(bits=8, min_numel=0), backend), plain) < 0.9


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_clip_masks_are_exact(backend, monkeypatch):
    # ReLU6's backward reads its input only against 0 and 6; values crowd both bounds, where rounding
    # would flip the mask (NOTE [ Op rules in compiled graphs ], 3.).
    lin = nn.Linear(64, 64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        lin.weight.mul_(0.01)
        lin.bias.copy_(torch.cat([torch.zeros(32), torch.full((32,), 6.0)]))

    def fn(x):
        return F.relu6(lin(x))

    x = torch.randn(128, 64, generator=gen)
    plain = _grads(lin, fn, x, None, backend)
    ctx = daftrain.compress(bits=2, min_numel=0)
    assert torch.equal(_grads(lin, fn, x, ctx, backend), plain)
    assert ctx.stats.compiled_bool_packed >= 1, ctx.stats.summary()
    if backend == "aot_eager":  # inductor's partitioner saves the comparisons' bool masks instead
        _without_rules(monkeypatch)
        assert not torch.equal(_grads(lin, fn, x, daftrain.compress(bits=2, min_numel=0), backend), plain)


class _LeakyThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(F.leaky_relu(self.first(x), 0.2, inplace=True))  # its backward reads its output


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compared_values_the_backward_also_reads_keep_their_sides(backend, monkeypatch):
    # A leaky ReLU's output is one saved value for its own backward (its sign picks 1 or the slope) and the
    # next layer's weight gradient (its values); rounded across 0, the slope flipped (NOTE [ Op rules in
    # compiled graphs ], 3.). With the sides stored, the first layer's gradient, which reads the output only
    # through its sign, is plain PyTorch's.
    model = _LeakyThenLinear()
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    first = sum(p.numel() for p in model.first.parameters())
    plain = _grads(model, model, x, None, backend)
    ctx = daftrain.compress(bits=2, min_numel=0)
    got = _grads(model, model, x, ctx, backend)
    assert torch.allclose(got[:first], plain[:first], rtol=1e-5, atol=1e-7)
    assert not torch.equal(got[first:], plain[first:])  # the values were quantized
    monkeypatch.setattr(graph_rules, "_compared_besides", lambda uses: None)
    got = _grads(model, model, x, daftrain.compress(bits=2, min_numel=0), backend)
    assert not torch.allclose(got[:first], plain[:first], rtol=1e-3, atol=1e-5)


def test_relu_outputs_store_no_side_of_zero(monkeypatch):
    # A ReLU's output keeps its 0 exact in the layout (zero-exact groups), so its sides cost nothing to keep:
    # the same bytes as with no sides stored, where a leaky ReLU's pay 2 bits per value for them.
    model = _LeakyThenLinear()
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))

    def relu_then_linear(x):
        return model.second(F.relu(model.first(x), inplace=True))

    stored = {}
    for sides in (True, False):
        if not sides:
            monkeypatch.setattr(graph_rules, "_compared_besides", lambda uses: None)
        for name, fn in (("relu", relu_then_linear), ("leaky", model)):
            ctx = daftrain.compress(bits=2, min_numel=0)
            _grads(model, fn, x, ctx, "aot_eager")
            stored[name, sides] = ctx.stats.compiled_stored_bytes
    assert stored["relu", True] == stored["relu", False]
    assert stored["leaky", True] == stored["leaky", False] + 128 * 64 * 2 // 8


class _ConvNormClip(nn.Module):
    """conv -> BatchNorm -> ReLU6 with the norm's outputs crowding both bounds of the clip."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.norm = nn.BatchNorm2d(16)
        with torch.no_grad():
            self.norm.weight.fill_(0.05)
            self.norm.bias.copy_(torch.cat([torch.zeros(8), torch.full((8,), 6.0)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu6(self.norm(self.conv(x)))


def test_masks_recomputed_in_backward_are_exact(monkeypatch):
    # Inductor's partitioner saves the convolution's output and recomputes BatchNorm and the ReLU6 mask
    # from it in backward: quantized, values near the mask's bounds flipped it (a MobileNet V2 at 4 bits:
    # 0.76 against 0.99 in eager code; NOTE [ Op rules in compiled graphs ], 3.). The rule keeps them.
    model = _ConvNormClip()
    x = torch.randn(8, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    plain = _grads(model, model, x, None, "inductor")
    ctx = daftrain.compress(bits=4, min_numel=0)
    assert torch.equal(_grads(model, model, x, ctx, "inductor"), plain), ctx.stats.summary()
    s = ctx.stats
    assert s.compiled_saved - s.compiled_quantized - s.compiled_bool_packed >= 1, s.summary()
    monkeypatch.setattr(graph_rules, "_compared_after_recomputing", lambda uses: False)
    got = _grads(model, model, x, daftrain.compress(bits=4, min_numel=0), "inductor")
    assert _cos(got, plain) < 0.99


def test_representatives_compare_as_the_intervals_they_stand_for():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        thresholds = (-1.0, 0.0, 6.0)
        reps = _representatives(thresholds, dtype)
        assert reps is not None and len(reps) == 4
        edges = (float("-inf"), *thresholds, float("inf"))
        assert all(lo < r < hi for r, lo, hi in zip(reps, edges[:-1], edges[1:], strict=True))
    # bfloat16 has no value strictly between two neighbours: such thresholds keep plain quantization
    assert _representatives((1.0, 1.0078125), torch.bfloat16) is None


def test_the_values_beside_a_threshold_are_its_neighbours_in_the_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for t in (-1.0, 0.0, 0.25, 6.0):
            below, above = _beside(t, dtype, above=False), _beside(t, dtype, above=True)
            for v in (below, above):
                assert torch.tensor(v, dtype=dtype).item() == v  # held exactly
            assert below < t < above
            if t != 0:  # nothing of the dtype between them and t (next to 0: the smallest normal number)
                ref = torch.tensor(t, dtype=dtype)
                assert torch.nextafter(ref, torch.tensor(-math.inf, dtype=dtype)).item() == below
                assert torch.nextafter(ref, torch.tensor(math.inf, dtype=dtype)).item() == above
            else:
                assert above == torch.finfo(dtype).tiny == -below


@pytest.mark.parametrize(("shape", "dims", "center"), [
    ((8, 33, 64), (2,), True), ((8, 16, 6, 6), (0, 2, 3), True), ((8, 33, 64), (2,), False),
])
def test_traced_normalisation_matches_the_eager_encoding(shape, dims, center):
    # NOTE [ Normalised values in a compiled graph ]: the branch-free statistics are the eager
    # encoding's, constant rows included (x_hat 0, std 0, the mean their value).
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3 + 1
    x.select(dims[-1] - 1 if len(dims) > 1 else 1, 0).fill_(0.25)  # constant rows or channels
    x_hat, mean, std = _normalized(x, GraphRule("normalize", "", dims=dims, center=center))
    eager_dims = (0, 2) if len(dims) > 1 else (2,)
    view = (shape[0], shape[1], -1) if len(dims) > 1 else (-1, 1, shape[-1])
    enc = Normalized(tuple(x.reshape(view).shape), eager_dims, center)
    want_hat, want_mean, want_std = enc._normalize(x.reshape(view))
    torch.testing.assert_close(x_hat.reshape(-1), want_hat.reshape(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std.reshape(-1), want_std.reshape(-1), rtol=1e-5, atol=1e-6)
    if center:
        torch.testing.assert_close(mean.reshape(-1), want_mean.reshape(-1), rtol=1e-6, atol=1e-6)
    restored = x_hat * std + mean
    torch.testing.assert_close(restored, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", ["batch", "layer"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_normalised_values_keep_their_statistics(backend, norm, monkeypatch):
    # NOTE [ Normalised values keep their statistics ] (records.py), in the traced unpack, and the
    # statistics inductor saves of a decomposed norm kept (NOTE [ Op rules in compiled graphs ], 5.): an
    # offset per channel (row) added before a batch (layer) norm gets a gradient that is a sum of the
    # norm's input gradient over the channel (row), exactly zero in plain PyTorch (float32 rounding of a
    # few hundred terms: bound 1e-5 of the input gradient's norm), and at 2 bits too.
    gen = torch.Generator().manual_seed(0)
    if norm == "batch":
        x = torch.randn(4, 64, 1, 1, generator=gen) + 0.05 * torch.randn(4, 64, 4, 4, generator=gen)
        layer, offset, pool = nn.BatchNorm2d(64).train(), nn.Parameter(torch.zeros(64, 1, 1)), (2, 3)
    else:
        x = torch.randn(4, 16, 1, generator=gen) + 0.05 * torch.randn(4, 16, 384, generator=gen)
        layer, offset, pool = nn.LayerNorm(384), nn.Parameter(torch.zeros(4, 16, 1)), (1,)
    head = nn.Linear(64 if norm == "batch" else 384, 10)

    def fn(x):
        return head(layer(x * 1.0 + offset).mean(pool))

    def grads(ctx) -> tuple[torch.Tensor, torch.Tensor]:
        torch._dynamo.reset()
        leaf = x.clone().requires_grad_()
        offset.grad = None
        compiled = torch.compile(fn, backend=backend)
        with ctx if ctx is not None else torch.enable_grad():
            out = compiled(leaf)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        assert leaf.grad is not None and offset.grad is not None
        return leaf.grad, offset.grad

    plain_x, plain_offset = grads(None)
    assert float(plain_offset.norm()) <= 1e-5 * float(plain_x.norm())
    got_x, got_offset = grads(daftrain.compress(bits=2, min_numel=0))
    assert float(got_offset.norm()) <= 1e-5 * float(got_x.norm()), float(got_offset.norm() / got_x.norm())
    if backend == "inductor" and norm == "layer":
        return  # inductor saves the layer norm's mean as var_mean's own output, kept without the rules
    _without_rules(monkeypatch)  # the input (the batch norm's mean, under inductor) quantized as it is
    without_x, without_offset = grads(daftrain.compress(bits=2, min_numel=0))
    assert float(without_offset.norm()) >= 1e-3 * float(without_x.norm())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_softmax_rows_keep_their_sums(backend, monkeypatch):
    # NOTE [ Probabilities keep their sums ] (records.py) in the traced unpack (NOTE [ Op rules in compiled
    # graphs ], 6.): softmax's backward sums to zero over each row, so a logit offset per query row gets a
    # gradient of exactly zero in plain PyTorch (float32 rounding of 64-term sums: bound 1e-5 of q's
    # gradient), and at 2 bits too; the output quantized as it is leaves its rows' rounding there.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=gen) for _ in range(3))
    k = k + 2.0
    offset = torch.zeros(2, 4, 64, 1)

    def fn(q, v, offset):
        return torch.softmax((q * 1.0) @ k.transpose(-2, -1) / 8.0 + offset, dim=-1) @ v

    def grads(ctx) -> tuple[torch.Tensor, torch.Tensor]:
        torch._dynamo.reset()
        leaves = [t.clone().requires_grad_() for t in (q, v, offset)]
        compiled = torch.compile(fn, backend=backend)
        with ctx if ctx is not None else torch.enable_grad():
            out = compiled(*leaves)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        assert leaves[0].grad is not None and leaves[2].grad is not None
        return leaves[0].grad, leaves[2].grad

    plain_q, plain_offset = grads(None)
    assert float(plain_offset.norm()) <= 1e-5 * float(plain_q.norm())
    got_q, got_offset = grads(daftrain.compress(bits=2, min_numel=0))
    assert float(got_offset.norm()) <= 1e-5 * float(got_q.norm()), float(got_offset.norm() / got_q.norm())
    _without_rules(monkeypatch)
    without_q, without_offset = grads(daftrain.compress(bits=2, min_numel=0))
    assert float(without_offset.norm()) >= 1e-2 * float(without_q.norm())


def test_log_softmax_rows_keep_their_sums(monkeypatch):
    # NOTE [ Op rules in compiled graphs ], 4. and 6.: a log_softmax's output is floored at 8 bits and restored
    # with rows whose logsumexp is 0, so the bias of the head before it gets a gradient that sums to zero over
    # the classes, as in plain PyTorch (float32 rounding of 256-term sums: bound 1e-6 of its norm).
    gen = torch.Generator().manual_seed(0)
    x, target = torch.randn(256, 64, generator=gen), torch.randint(0, 100, (256,), generator=gen)
    head = nn.Linear(64, 100)

    def bias_grad(ctx) -> torch.Tensor:
        torch._dynamo.reset()
        head.zero_grad(set_to_none=True)
        compiled = torch.compile(lambda x: F.nll_loss(F.log_softmax(head(x * 1.0) * 3.0, dim=-1), target),
                                 backend="aot_eager")
        with ctx if ctx is not None else torch.enable_grad():
            loss = compiled(x.clone().requires_grad_())
        loss.backward()
        assert head.bias.grad is not None
        return head.bias.grad

    plain = bias_grad(None)
    assert abs(float(plain.sum())) <= 1e-6 * float(plain.norm())
    got = bias_grad(daftrain.compress(bits=2, min_numel=0))
    assert abs(float(got.sum())) <= 1e-6 * float(got.norm()), float(got.sum() / got.norm())
    _without_rules(monkeypatch)
    without = bias_grad(daftrain.compress(bits=2, min_numel=0))
    assert abs(float(without.sum())) >= 1e-4 * float(without.norm())


_TARGET = torch.rand(128, 64, generator=torch.Generator().manual_seed(5))
_GROUPS = torch.arange(128) % 16
_IMAGE = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(7))
def _end_point_error(flow: torch.Tensor) -> torch.Tensor:
    """A 2-D flow's end-point error written out, most points nearly right: a root of a sum of two squares."""
    off = _TARGET.view_as(flow)
    return torch.sqrt(((flow - flow.detach() - 1e-3 * off - (off > 0.9).float()) ** 2).sum(1) + 1e-12)


# NOTE [ Op rules in compiled graphs ], 7.: backward divides by what these save, or is singular in it, at values
# the inputs put near the singularity (the eager cases: tests/saved/test_op_rules.py).
_SINGULAR = {
    "binary_cross_entropy": lambda h: F.binary_cross_entropy(torch.sigmoid(h * 5.0), _TARGET, reduction="none"),
    "division": lambda h: _TARGET / (h.abs() + 0.05),
    "soft_sign": lambda h: h / (h.abs() + 0.05),
    "square_root": lambda h: torch.sqrt(h.abs() + 1e-4),
    "power_below_one": lambda h: (h.abs() + 1e-4) ** 0.5,
    "lgamma": lambda h: torch.lgamma(h.abs() + 0.01),
    "asin": lambda h: torch.asin(h.clamp(-0.999, 0.999)),
    "log_of_sigmoid": lambda h: torch.log(torch.sigmoid(h * 5.0)),
    "grid_sample": lambda h: F.grid_sample(_IMAGE, torch.tanh(h * 2.0).view(4, 32, 32, 2), align_corners=False),
    "cdist": lambda h: torch.cdist(h.view(16, 8, 64), h.view(16, 8, 64).detach() + 0.01 * _TARGET.view(16, 8, 64)),
    "eigh": lambda h: torch.linalg.eigh(h.reshape(128, 8, 8) + h.reshape(128, 8, 8).transpose(-1, -2))[1].abs(),
    "spectral_norm": lambda h: torch.linalg.matrix_norm(h.reshape(128, 8, 8), ord=2),
    "segment_max": lambda h: torch.segment_reduce(h, "max", lengths=torch.full((16,), 8)),
    "logit": lambda h: torch.logit(torch.sigmoid(h * 4.0)),
    "hypot": lambda h: torch.hypot(h, h * 0.1 + 0.001),
    # a square's base, read with a root or a reciprocal (NOTE [ Saves held for a singular backward ] in singular.py):
    # the partitioner saves 2 * x ** 1, or the layer's output before the slices of an image
    "charbonnier": lambda h: torch.sqrt((h - _TARGET) ** 2 + 1e-12),
    "total_variation": lambda h: torch.sqrt(torch.diff(h.view(128, 8, 8), dim=1)[:, :, 1:] ** 2
                                            + torch.diff(h.view(128, 8, 8), dim=2)[:, 1:, :] ** 2 + 1e-8),
    "cauchy_kernel": lambda h: 1.0 / (1.0 + h * h / 0.01),
    "end_point_error": lambda h: _end_point_error(h.view(128, 2, 32)),
    # a learned scale through a softplus, divided by where it is small (a standardised residual's scale)
    "cauchy_log_prob": lambda h: torch.distributions.Cauchy(h, F.softplus(h.flip(0) * 3.0) + 1e-3).log_prob(_TARGET),
    # products, whose backward multiplies the other factors (compiled: no division by them to find)
    "product": lambda h: h.view(128, 16, 4).prod(-1),
    "scatter_product": lambda h: torch.ones(16, 64).scatter_reduce(0, _GROUPS[:, None].expand(128, 64), h, "prod"),
}


@pytest.mark.parametrize("name", _SINGULAR)
def test_values_a_singular_backward_reads_are_kept(name, monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)

    def fn(x):
        return _SINGULAR[name](lin(x))

    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    plain = _grads(lin, fn, x, None, "aot_eager")
    ctx = daftrain.compress(bits=2, min_numel=0)
    assert _cos(_grads(lin, fn, x, ctx, "aot_eager"), plain) > 0.9995, ctx.stats.summary()
    _without_rules(monkeypatch)
    got = _grads(lin, fn, x, daftrain.compress(bits=2, min_numel=0), "aot_eager")
    assert not _cos(got, plain) > 0.999, _cos(got, plain)
