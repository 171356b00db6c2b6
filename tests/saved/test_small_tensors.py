"""Saved tensors under ``min_numel`` values packed together (``NOTE [ Small tensors packed together ]``)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daftrain
from daftrain.saved.records import encode
from daftrain.saved.small_tensors import BATCH_CAPACITY, SmallTensors, worth_batching

GROUP = 256


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.reshape(-1).double(), b.reshape(-1).double(), dim=0))


def _encoder(bits: int, seed: int = 7):
    return functools.partial(encode, kind="quantize", bits=bits, group_size=GROUP, seed=seed)


def _members() -> list[torch.Tensor]:
    """Small tensors of very different scales and offsets, sizes not multiples of a group."""
    g = torch.Generator().manual_seed(0)
    return [1000.0 * torch.randn(300, generator=g), 1e-3 * torch.randn(100, generator=g),
            5.0 + torch.rand(700, generator=g), torch.randn(37, 3, generator=g).t().contiguous()]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_each_small_tensor_is_rounded_within_its_own_groups(bits: int) -> None:
    # A group spanning two members would give the 1e-3 one an error of the 1000 one's step; padding with
    # zeros would stretch the one of values in [5, 6] down to 0. Each value must stay within one step of its
    # own group's range (the tensor's own 256-value runs from its start), between that range's ends.
    small = SmallTensors(GROUP)
    members = _members()
    slices = [small.add(x.reshape(-1), _encoder(bits)) for x in members]
    small.seal(_encoder(bits))
    for x, s in zip(members, slices, strict=True):
        got, flat = s.decode(), x.reshape(-1)
        assert got.shape == flat.shape and got.dtype == flat.dtype
        for start in range(0, flat.numel(), GROUP):
            ref, out = flat[start:start + GROUP], got[start:start + GROUP]
            lo, hi = ref.min(), ref.max()
            # the layout stores each group's scale in bfloat16, rounded up (8 significant bits): the top level
            # may lie up to 2**-7 of the range above the maximum; plus float32 rounding of lo + code * scale
            step = float(hi - lo) / ((1 << bits) - 1)
            slack = 2.0 ** -7 * float(hi - lo) + 1e-5 * max(float(hi.abs()), float(lo.abs()))
            assert float((out - ref).abs().max()) <= step + slack
            assert float(out.min()) >= float(lo) - slack and float(out.max()) <= float(hi) + slack


def test_batched_rounding_is_unbiased() -> None:
    # Stochastic rounding: the mean over draws tends to each value. Per value the rounding's standard
    # deviation is at most half a step; 6 standard errors of the mean bound 300 values' worst at 1e-6 odds.
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    draws = 400
    total = torch.zeros_like(x, dtype=torch.float64)
    for seed in range(draws):
        small = SmallTensors(GROUP)
        other = torch.randn(50, generator=torch.Generator().manual_seed(seed))
        small.add(other, _encoder(2, seed * 7919))  # another member first: x starts at an offset
        s = small.add(x, _encoder(2, seed * 7919))
        small.seal(_encoder(2, seed * 7919 + 1))
        total += s.decode().double()
    step = torch.stack([(x[i:i + GROUP].max() - x[i:i + GROUP].min()) / 3 for i in range(0, 300, GROUP)])
    bound = 6 * (step.max() / 2) / draws ** 0.5
    assert float((total / draws - x.double()).abs().max()) <= float(bound)


def test_a_full_buffer_is_packed_and_a_new_one_opened() -> None:
    small = SmallTensors(GROUP)
    x = torch.randn(4000, generator=torch.Generator().manual_seed(6))
    padded = 4096
    slices = [small.add(x, _encoder(8)) for _ in range(BATCH_CAPACITY // padded + 1)]
    assert slices[0].batch is not slices[-1].batch
    assert slices[0].batch.record is not None and slices[-1].batch.record is None  # packed / still staged
    assert torch.equal(slices[-1].decode(), x)  # staged: exact
    small.seal(_encoder(8))
    for s in slices:
        # within a step of 8 bits over the widest group's range (the range's own: at most the tensor's), its
        # bfloat16 scale rounded up by up to 2**-7
        assert torch.allclose(s.decode(), x, atol=float(x.max() - x.min()) / 255 * (1 + 2.0 ** -7))


def test_few_values_stay_exact_where_their_padded_groups_would_not_halve_them() -> None:
    assert not worth_batching(64, 4, 4, GROUP)  # 134 bytes padded at 4 bits against 256 raw
    assert worth_batching(100, 4, 4, GROUP)
    assert not worth_batching(200, 2, 8, GROUP)  # bfloat16 at 8 bits
    assert worth_batching(1000, 2, 4, GROUP)


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 32)
        self.rnn = nn.GRU(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x))[0])


def _gru_grads(model: nn.Module, ctx: daftrain.compress | None, inside: bool = False,
               steps: int = 30) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    x = torch.randint(0, 50, (4, steps), generator=torch.Generator().manual_seed(2))
    w = torch.randn(4, steps, 50, generator=torch.Generator().manual_seed(3))
    with ctx if ctx is not None else torch.enable_grad():
        loss = (model(x) * w).sum()
        if inside:
            loss.backward()
    if not inside:
        loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_a_recurrent_layers_per_step_saves_are_packed_at_8_bits() -> None:
    # nn.GRU on CPU saves a few tensors of batch x hidden values per time step and layer: all under
    # min_numel, kept exact without batching (1.2x). Packed together they are stored at 8 bits whatever the bits
    # asked for (float32 -> 8 bits is at most 4 / (1 + 6 / 256) = 3.9x), and the gradient must be as close to
    # plain's as with each packed alone at 8 bits: over four draws, within 1.5x of that error (draw to draw it
    # varies by ~20 %).
    model = _Recurrent()
    ref = _gru_grads(model, None)
    kept = daftrain.compress(bits=4, batch_small=False)
    _gru_grads(model, kept)
    assert kept.stats.ratio < 1.5, kept.stats.summary()
    together, alone = [], []
    for seed in range(4):
        ctx = daftrain.compress(bits=8, seed=seed)
        together.append(1 - _cos(_gru_grads(model, ctx), ref))
        assert ctx.stats.batched > 100 and ctx.stats.ratio > 3.0, ctx.stats.summary()
        assert "small packed together" in ctx.stats.summary()
        alone.append(1 - _cos(_gru_grads(model, daftrain.compress(bits=8, seed=seed, min_numel=0)), ref))
    assert 0 < sum(together) <= 1.5 * sum(alone), (together, alone)
    # At 2 bits the small tensors' 8-bit rounding adds next to nothing to the large ones' 2-bit error: over
    # four draws within 1.15x of it with the small ones kept (draw to draw the mean varies by ~10 %).
    packed, kept_errors = [], []
    for seed in range(4):
        at_two = daftrain.compress(bits=2, seed=seed)
        packed.append(1 - _cos(_gru_grads(model, at_two), ref))
        at_two_kept = daftrain.compress(bits=2, seed=seed, batch_small=False)
        kept_errors.append(1 - _cos(_gru_grads(model, at_two_kept), ref))
        assert at_two.stats.ratio > 2 * at_two_kept.stats.ratio  # and much smaller
    assert sum(packed) <= 1.15 * sum(kept_errors), (packed, kept_errors)


def test_backward_inside_the_context_reads_the_exact_staged_values() -> None:
    # Five steps save fewer values than one staging buffer holds: none is packed before backward reads it.
    model = _Recurrent()
    ref = _gru_grads(model, None, steps=5)
    ctx = daftrain.compress(bits=2)
    assert torch.equal(_gru_grads(model, ctx, inside=True, steps=5), ref)
    assert ctx.stats.batched > 20 and ctx.stats.compressed == 1  # packed when the forward ended


def test_a_backward_that_builds_a_graph_saves_staged_values_again() -> None:
    # NOTE [ Staged values read back ]: a gradient penalty inside the context differentiates the backward, whose
    # ops save the restored small tensors again; a view of the staging buffer raised there (the pack's copy into
    # that buffer bumped the tensor's version). The restored values are the staged ones: plain's gradient, to the
    # 8-bit rounding of what the second backward's own saves store (cosine measured 0.99998).
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(16, 32)

    def penalty_grads(ctx: daftrain.compress | None) -> torch.Tensor:
        critic.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_()
        with ctx if ctx is not None else contextlib.nullcontext():
            (g,) = torch.autograd.grad(critic(inputs).sum(), inputs, create_graph=True)
            penalty = (g.norm(dim=1) - 1).square().mean()
        penalty.backward()
        return torch.cat([p.grad.reshape(-1) for p in critic.parameters() if p.grad is not None])

    ctx = daftrain.compress(bits=2)
    got = penalty_grads(ctx)
    assert ctx.stats.batched >= 1
    assert _cos(got, penalty_grads(None)) >= 0.9999


def test_a_retained_graph_decodes_its_shared_records_again() -> None:
    model = _Recurrent()
    x = torch.randint(0, 50, (4, 30), generator=torch.Generator().manual_seed(2))
    with daftrain.compress(bits=2):
        loss = model(x).square().mean()
    grads = []
    for retain in (True, False):
        model.zero_grad(set_to_none=True)
        loss.backward(retain_graph=retain)
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])


def test_a_small_tensor_modified_in_place_after_its_save_is_refused() -> None:
    x = torch.randn(8, 64, requires_grad=True)
    with daftrain.compress(bits=4):
        y = torch.tanh(x @ torch.randn(64, 64))  # tanh saves its output: 512 values
    assert isinstance(y.grad_fn, torch.autograd.graph.Node)
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(daftrain.DaftrainError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_small_tensors_stay_exact(dtype: torch.dtype) -> None:
    # 8 bits would not halve them: kept as they are, the gradient plain's bit for bit.
    leaf = torch.randn(16, 48, generator=torch.Generator().manual_seed(4)).requires_grad_()

    def grad(ctx: daftrain.compress | None) -> torch.Tensor:
        leaf.grad = None
        with ctx if ctx is not None else torch.enable_grad():
            x = (1.5 * leaf).to(dtype)  # an activation (a leaf's cast would count as a parameter): 768 values
            out = (torch.sin(x) * x).float().sum()
        out.backward()
        return leaf.grad

    ref = grad(None)
    ctx = daftrain.compress(bits=4)
    assert torch.equal(grad(ctx), ref)
    assert ctx.stats.batched == 0 and ctx.stats.kept_reasons["tiny"] >= 2


def test_auto_packs_small_tensors_at_the_bits_of_its_average_and_keeps_them_under_a_variance_target() -> None:
    model = _Recurrent()
    by_average = daftrain.compress(bits="auto", avg_bits=4.0, model=model)
    _gru_grads(model, by_average)
    assert by_average.stats.batched > 100
    by_share = daftrain.compress(bits="auto", error_share=0.01, model=model)
    _gru_grads(model, by_share)
    assert by_share.stats.batched == 0 and by_share.stats.kept_reasons["tiny"] > 100


def test_batch_small_is_validated() -> None:
    with pytest.raises(daftrain.ArgumentTypeError, match="batch_small"):
        daftrain.CompressionConfig(batch_small=1)


def test_a_few_small_tensors_next_to_large_ones_stay_exact() -> None:
    # A CNN's pooled features (2048 values) next to 2 MB of convolution output: a sliver of the bytes, and
    # the head's whole weight gradient. Kept exact, as without batching: the same gradient, bit for bit.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                          nn.Linear(256, 10))
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(5))

    def grads(ctx: daftrain.compress) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with ctx:
            out = model(x).square().sum()
        out.backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    ctx = daftrain.compress(bits=2, seed=1)
    got = grads(ctx)
    assert ctx.stats.batched == 0 and ctx.stats.kept_reasons["tiny"] >= 1, ctx.stats.summary()
    assert torch.equal(got, grads(daftrain.compress(bits=2, seed=1, batch_small=False)))


@pytest.mark.parametrize(("asynchronous", "pooled"), [(True, False), (False, True), (True, True)])
def test_the_packer_thread_and_the_pool_store_what_the_synchronous_path_does(asynchronous: bool,
                                                                           pooled: bool) -> None:
    model = _Recurrent()
    ref = _gru_grads(model, daftrain.compress(bits=4, seed=0))
    pool = daftrain.PagePool(daftrain.PoolConfig(max_bytes=64 * 2**20)) if pooled else None
    ctx = daftrain.compress(bits=4, seed=0, asynchronous=asynchronous, pool=pool)
    assert torch.equal(_gru_grads(model, ctx), ref)
    assert ctx.stats.batched > 100
