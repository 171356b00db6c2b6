"""records.py: the ``Normalized`` encoding (a normalisation's input as x_hat with exact statistics) in both
layouts the normalization rule builds, against the input it stores."""

from __future__ import annotations

import itertools

import pytest
import torch

from daftrain.saved import records
from daftrain.saved.records import ExactRecord, Normalized, NormalizedRecord, PackedRecord

# (view, reduce): layer / RMS / group / instance norms normalise rows of the last dimension, batch norm
# each channel over the first and last; vectors along the middle dimension are F.normalize's, and the
# rows of a permuted tensor's norm in memory order.
# Rows of 384 and channel planes of 128 values put groups of 256 across rows, where the encoding normalises
# (NOTE [ Normalising only where groups straddle statistics ]; rows holding whole groups: below).
_LAYOUTS = {"rows": ((96, 1, 384), (2,)), "channels": ((16, 24, 128), (0, 2)), "vectors": ((4, 256, 48), (1,))}


def _input(view: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    spread = torch.rand((*view[:2], 1), generator=gen) * torch.rand((view[0], 1, view[2]), generator=gen)
    x = torch.randn(view, generator=gen) * spread.mul(4) + 3.0
    return x.to(dtype).reshape(-1)


def _round_trip(enc: Normalized, flat: torch.Tensor, bits: int = 8) -> torch.Tensor:
    record = enc.encode(flat, bits, 256, seed=1)
    assert isinstance(record, NormalizedRecord)
    return record.decode().view(enc.view)


def _stats(x: torch.Tensor, reduce: tuple[int, ...], center: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mean = x.mean(reduce, keepdim=True) if center else torch.zeros(())
    return mean, (x - mean).square().mean(reduce, keepdim=True).sqrt()


@pytest.mark.parametrize("layout", _LAYOUTS)
@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restores_each_row_with_its_statistics_within_a_few_rounding_steps(layout: str, center: bool,
                                                                            dtype: torch.dtype) -> None:
    view, reduce = _LAYOUTS[layout]
    flat = _input(view, dtype)
    kept = flat.clone()
    record = Normalized(view, reduce, center).encode(flat, 8, 256, seed=1)
    assert isinstance(record, NormalizedRecord)
    got = record.decode().view(view).float()
    assert torch.equal(flat, kept)  # the saved tensor itself is never written
    x = flat.view(view).float()
    mean, spread = _stats(x, reduce, center)
    x_hat = (x - mean) / spread
    # The stored x_hat is quantized in groups of 256 at 8 bits: stochastic rounding moves a value by less
    # than its group's step, range / 255 rounded up to bfloat16 (at most 2**-7 more; layout.py), plus
    # float32 rounding of the normalisation (2**-20 of the value covers it).
    groups = x_hat.reshape(-1, 256)
    step = ((groups.amax(1, keepdim=True) - groups.amin(1, keepdim=True)) / 255).expand_as(groups).reshape(view)
    step = step * (1 + 2**-7)
    stored = record.inner.decode().view(view)
    assert bool(((stored - x_hat).abs() <= step + x_hat.abs() * 2**-20).all())
    # Restored, each row has x's own mean and spread (NOTE [ Normalised values keep their statistics ]):
    # float32 rounding of the reductions and the restore (2**-18 of the row's magnitude), a bfloat16
    # restore rounding each value to 8 significant bits on top (2**-8 relative; its mean and spread move
    # by at most that much of the row's magnitude).
    got_mean, got_spread = _stats(got, reduce, center)
    magnitude = x.abs().amax(reduce, keepdim=True)
    tolerance = magnitude * (2**-8 if dtype == torch.bfloat16 else 2**-18)
    assert bool(((got_mean - mean).abs() <= tolerance).all())
    assert bool(((got_spread - spread).abs() <= tolerance).all())
    # Shifting and scaling to those statistics moves a value of x_hat with error e by e - mean(e) and by
    # a scale within 1 +- rms(e) of 1: |restored x_hat - x_hat| <= (2 S + |x_hat| S) / (1 - S), S the
    # row's largest step.
    worst = step.amax(reduce, keepdim=True)
    bound = (2 * worst + x_hat.abs() * worst) / (1 - worst) * spread + x.abs() * (
        2**-8 if dtype == torch.bfloat16 else 2**-18)
    assert bool(((got - x).abs() <= bound).all())


@pytest.mark.parametrize("layout", _LAYOUTS)
def test_constant_rows_are_restored_exactly(layout: str) -> None:
    view, reduce = _LAYOUTS[layout]
    x = _input(view, torch.float32).view(view).clone()
    if layout == "rows":
        x[::7] = 0.0
        x[3::7] = 0.3
    elif layout == "channels":
        x[:, ::7] = 0.0
        x[:, 3::7] = -1.7
    else:
        x[:, :, ::7] = 0.0
        x[:, :, 3::7] = -1.7
    got = _round_trip(Normalized(view, reduce), x.reshape(-1), bits=2)
    constant = (x.amin(reduce, keepdim=True) == x.amax(reduce, keepdim=True)).expand_as(x)
    assert constant.any() and torch.equal(got[constant], x[constant])


def test_non_finite_input_is_kept_exact() -> None:
    view, reduce = _LAYOUTS["rows"]
    flat = _input(view, torch.float32)
    flat[100] = float("nan")
    record = Normalized(view, reduce).encode(flat, 4, 256, seed=1)
    assert isinstance(record, ExactRecord) and record.reason == "nonfinite"


def _permuted(shape: tuple[int, ...], order: tuple[int, ...]) -> torch.Tensor:
    """A dense tensor of logical ``shape`` whose dims lie in memory in ``order`` (outermost first)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).mul(4) + 1.0
    return x.permute(order).contiguous().permute(sorted(range(len(order)), key=order.__getitem__))


# (logical shape, the encoding the rule builds for it, memory order, the encoding in memory order)
_PERMUTED = {
    "batch norm, channels_last": ((4, 6, 5, 3), Normalized((4, 6, 15), (0, 2)), (0, 2, 3, 1),
                                  Normalized((60, 6, 1), (0, 2))),
    "layer norm, transposed": ((4, 7, 6), Normalized((28, 1, 6), (2,)), (0, 2, 1), Normalized((4, 6, 7), (1,))),
    "layer norm of channels, permuted to channels last": ((2, 5, 3, 8), Normalized((30, 1, 8), (2,)),
                                                          (0, 3, 1, 2), Normalized((2, 8, 15), (1,))),
    "instance norm, channels_last": ((4, 6, 5, 3), Normalized((4, 6, 15), (2,)), (0, 2, 3, 1),
                                     Normalized((4, 15, 6), (1,))),
    "group norm, channels_last": ((4, 6, 5, 3), Normalized((4, 2, 45), (2,)), (0, 2, 3, 1),
                                  Normalized((4, 15, 2, 3), (1, 3))),
    "instance norm, kept and reduced dims alternating twice": ((4, 6, 5, 3), Normalized((4, 6, 15), (2,)),
                                                               (0, 2, 1, 3), Normalized((4, 5, 6, 3), (1, 3))),
    "RMS over the last two dims, a size-1 dim between": ((3, 1, 4, 5), Normalized((3, 1, 20), (2,), center=False),
                                                         (2, 0, 3, 1), Normalized((4, 3, 5), (0, 2), center=False)),
}


@pytest.mark.parametrize("case", _PERMUTED)
def test_in_memory_order_normalises_the_values_the_logical_encoding_does(case: str) -> None:
    shape, logical, order, expected = _PERMUTED[case]
    t = _permuted(shape, order)
    assert not t.is_contiguous()
    found = logical.in_memory_order(t)
    assert found == expected
    # The same values share a mean and std: x_hat in memory order is the logical x_hat laid out like t.
    x_hat = logical._normalize(t.contiguous().view(logical.view))[0].view(shape)
    laid_out = torch.empty_like(t).copy_(x_hat).as_strided((t.numel(),), (1,))
    got = found._normalize(t.as_strided((t.numel(),), (1,)).view(found.view))[0].reshape(-1)
    torch.testing.assert_close(got, laid_out, rtol=1e-5, atol=1e-5)  # float32 reductions in other orders


def test_in_memory_order_refuses_a_dim_that_straddles_view_dims_unevenly() -> None:
    assert Normalized((4, 4, 15), (2,)).in_memory_order(_permuted((4, 6, 10), (0, 2, 1))) is None


@pytest.mark.parametrize("view, reduce, within", [
    ((96, 1, 512), (2,), True), ((96, 1, 384), (2,), False), ((96, 1, 256), (2,), True),
    ((4, 16, 1024), (0, 2), True), ((4, 16, 64), (0, 2), False), ((4, 1, 64), (0, 2), True),  # 4 x 64 in one set
    ((4, 256, 48), (1,), False), ((4, 256, 1), (1,), True), ((2, 8, 16, 4), (1, 3), False),
])
def test_groups_within_rows_is_the_trailing_run_of_reduced_dims(view: tuple[int, ...], reduce: tuple[int, ...],
                                                                within: bool) -> None:
    assert Normalized(view, reduce).groups_within_rows(256) is within


def test_rows_holding_whole_groups_are_quantized_as_they_are_with_the_same_rounding() -> None:
    # Each group of 256 lies in one row of 512: x_hat is x times a positive number plus another within the
    # group, so quantizing x draws the same noise against the same thresholds, up to the step's rounding
    # up to bfloat16 (2**-8 relative, layout.py), which differs between the two and moves a value across a
    # threshold only where it lies that close to one: about 0.2 % of values at 2 bits change code (a
    # step, most of a row's spread), the rest are restored within 2**-7 of the group's range of each
    # other, and every row's error variance is the normalised encoding's.
    view = (64, 1, 512)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(view, generator=gen) * torch.logspace(-3, 1, 64).view(64, 1, 1) + torch.randn(64, 1, 1)
    flat = x.reshape(-1)
    enc = Normalized(view, (2,))
    spread = x.std(2, keepdim=True, correction=0).expand_as(x).reshape(-1)
    group_range = flat.view(-1, 256).aminmax(dim=1)
    group_range = (group_range.max - group_range.min).repeat_interleave(256)
    flips = 0
    error_plain = error_normalised = torch.zeros(64, dtype=torch.float64)
    for seed in range(20):
        plain = enc.encode(flat, 2, 256, seed=seed)
        assert isinstance(plain, PackedRecord)
        normalised = records.decided(*enc.normalized_candidate(flat, 2, 256, seed=seed), flat)
        assert isinstance(normalised, NormalizedRecord)
        # the codes compared: x_hat as stored, restored without its statistics' shift and scale
        # (NOTE [ Normalised values keep their statistics ])
        assert normalised.mean is not None
        a, b = plain.decode(), (normalised.inner.decode().view(view) * normalised.std + normalised.mean).view(-1)
        flipped = (a - b).abs() > 0.1 * spread
        flips += int(flipped.sum())
        assert bool(((a - b).abs() <= 2**-7 * group_range + 1e-6 * flat.abs())[~flipped].all())
        error_plain = error_plain + ((a - flat) / spread).double().view(64, -1).square().mean(1)
        error_normalised = error_normalised + ((b - flat) / spread).double().view(64, -1).square().mean(1)
    assert flips <= 0.01 * 20 * flat.numel(), f"{flips} values changed code"
    ratio = error_plain / error_normalised
    assert bool(((ratio > 0.9) & (ratio < 1.1)).all()) and abs(float(ratio.mean()) - 1) < 0.03, ratio
    # restored with its statistics, the same rows are no noisier than quantized as they are
    restored = torch.zeros(64, dtype=torch.float64)
    for seed in range(20):
        normalised = records.decided(*enc.normalized_candidate(flat, 2, 256, seed=seed), flat)
        restored = restored + ((normalised.decode() - flat) / spread).double().view(64, -1).square().mean(1)
    assert bool((restored <= error_plain * 1.1).all()), restored / error_plain
    # other dtypes are quantized as they are too: every dtype gets a fitted grid
    assert isinstance(enc.encode(flat.bfloat16(), 2, 256, seed=0), PackedRecord)


def _outlier_rows(rows: int = 512, cols: int = 96) -> torch.Tensor:
    """A ``[tokens, features]`` activation with three outlier features, 30x the rest in every token."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    x[:, [5, 40, 77]] *= 30.0
    return x


def test_normalized_values_down_the_columns_round_trip_with_less_error() -> None:
    x = _outlier_rows()
    rows_enc = Normalized((512, 1, 96), (2,))
    cols_enc = rows_enc.down_columns(96)
    assert cols_enc is not None and cols_enc.cols == 96
    flat = x.reshape(-1)
    errors = {}
    for name, enc in (("rows", rows_enc), ("cols", cols_enc)):
        record = records.encode(flat, "quantize", 4, 256, seed=3, encoding=enc)
        assert isinstance(record, NormalizedRecord)
        restored = record.decode()
        assert restored.shape == flat.shape and restored.dtype == flat.dtype
        normal = torch.ones(96, dtype=torch.bool)
        normal[[5, 40, 77]] = False
        errors[name] = float((restored.view(512, 96) - x)[:, normal].pow(2).mean())
    # the ordinary features are rounded in their own column's steps, not in the outliers' (30x wider)
    assert errors["cols"] < errors["rows"] / 20, errors
    assert record.nbytes == records.encode(flat, "quantize", 4, 256, seed=3, encoding=rows_enc).nbytes


def test_normalized_down_columns_only_for_row_statistics() -> None:
    assert Normalized((512, 1, 96), (2,)).down_columns(48) is None  # not the rows' length
    assert Normalized((8, 16, 64), (0, 2)).down_columns(64) is None  # a batch norm's channels
    assert Normalized((8, 16, 64), (1,)).down_columns(64) is None  # F.normalize's vectors along dim 1


# NOTE [ Integer tensors in their narrowest type ]: offsets from the minimum in the narrowest type that holds
# the span, narrower than the tensor's own; else kept. An int64 span that wraps around (the full range) is kept.
@pytest.mark.parametrize(("dtype", "lo", "hi", "stored"), [
    (torch.int64, 0, 255, torch.uint8), (torch.int64, -5, 250, torch.uint8), (torch.int64, 0, 256, torch.int16),
    (torch.int64, 0, 12543, torch.int16), (torch.int64, -40_000, 40_000, torch.int32),
    (torch.int64, 7 - 2**40, 7, None), (torch.int64, -2**63, 2**63 - 1, None), (torch.int32, 0, 200, torch.uint8),
    (torch.int32, -2**31, 2**31 - 1, None), (torch.int32, 0, 1_000_000, None), (torch.int16, -100, 100, torch.uint8),
])
def test_integer_records_round_trip_in_the_narrowest_type(dtype: torch.dtype, lo: int, hi: int,
                                                          stored: torch.dtype | None) -> None:
    gen = torch.Generator().manual_seed(0)
    flat = torch.randint(lo, hi, (5000,), generator=gen, dtype=torch.int64).to(dtype)
    flat[0], flat[1] = lo, hi  # the ends of the span
    record, checks = records.narrowed(flat)
    assert checks == ()
    if stored is None:
        assert isinstance(record, ExactRecord) and record.reason == "integer" and record.flat is flat
        return
    assert isinstance(record, records.IntegerRecord) and record.values.dtype == stored
    assert record.nbytes == flat.numel() * stored.itemsize + flat.element_size()
    restored = record.decode()
    assert restored.dtype == dtype and torch.equal(restored, flat)


def test_integer_records_on_a_device_that_reads_later(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU the span is not read at once: int16 is made and its check read later (here: on the CPU tensor).
    monkeypatch.setattr(records, "reads_wait", lambda device: True)
    for hi, fits in ((100, True), (2**16 - 1, True), (2**16, False), (2**62, False)):
        flat = torch.tensor([0, hi, 3], dtype=torch.int64)
        record, checks = records.narrowed(flat)
        assert isinstance(record, records.IntegerRecord) and record.values.dtype == torch.int16
        assert len(checks) == 1 and bool(checks[0][0]) is fits and checks[0][1] == "integer"
        if fits:
            assert torch.equal(record.decode(), flat)
    wrapped = torch.tensor([-2**63, 2**63 - 1], dtype=torch.int64)
    assert not bool(records.narrowed(wrapped)[1][0][0])
    assert isinstance(records.narrowed(torch.tensor([1, 2], dtype=torch.int16))[0], ExactRecord)


def _pooled(dims: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool
            ) -> tuple[torch.Tensor, records.PoolWindows] | None:
    size = {1: (4, 3, 17), 2: (2, 3, 13, 11), 3: (2, 2, 7, 9, 6)}[dims]
    x = torch.randn(size, generator=torch.Generator().manual_seed(dims))
    pool = {1: torch.nn.functional.max_pool1d, 2: torch.nn.functional.max_pool2d, 3: torch.nn.functional.max_pool3d}
    try:
        _, indices = pool[dims](x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
    except RuntimeError:  # a window that lies in the padding alone
        return None
    windows = records.PoolWindows(size[2:], (kernel,) * dims, (stride,) * dims, (padding,) * dims, (dilation,) * dims,
                                  tuple(indices.shape), tuple(range(indices.dim())))
    return indices.reshape(-1), windows


# NOTE [ Max-pool indices as window positions ]: every index restores from its window position, in 1, 2 and
# 3 spatial dims, with padding, dilation, strides smaller than the kernel and ceil-mode windows past the edge.
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_max_pool_indices_round_trip_through_window_positions(dims: int) -> None:
    tried = 0
    for kernel, stride, padding, dilation, ceil_mode in itertools.product((2, 3), (1, 2), (0, 1), (1, 2),
                                                                         (False, True)):
        pooled = _pooled(dims, kernel, stride, padding, dilation, ceil_mode)
        if pooled is None:
            continue
        indices, windows = pooled
        record, checks = windows.candidate(indices, 8, 256, seed=0)
        assert checks == () and isinstance(record, records.PoolWindowsRecord)
        assert record.positions.dtype == torch.uint8 and record.nbytes == indices.numel()
        assert int(record.positions.max()) < kernel**dims
        restored = record.decode()
        assert restored.dtype == torch.int64 and torch.equal(restored, indices)
        tried += 1
    assert tried >= 28


def test_max_pool_indices_that_positions_do_not_restore_are_narrowed() -> None:
    # A window description that does not fit the indices (here: the wrong stride) must not restore wrong indices.
    indices, windows = _pooled(2, 3, 2, 1, 1, False)
    wrong = records.PoolWindows(windows.input_size, windows.kernel, (1, 1), windows.padding, windows.dilation,
                                windows.shape, windows.order)
    record, checks = wrong.candidate(indices, 8, 256, seed=0)
    assert isinstance(record, records.IntegerRecord) and checks == ()
    assert torch.equal(record.decode(), indices)


def test_max_pool_indices_in_channels_last_round_trip_in_memory_order() -> None:
    x = torch.randn(2, 5, 12, 10, generator=torch.Generator().manual_seed(0)).contiguous(
        memory_format=torch.channels_last)
    _, indices = torch.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)
    assert not indices.is_contiguous() and indices.is_contiguous(memory_format=torch.channels_last)
    flat = indices.permute(0, 2, 3, 1).reshape(-1)  # the order the hooks pack a dense tensor in
    windows = records.PoolWindows((12, 10), (3, 3), (2, 2), (1, 1), (1, 1), tuple(indices.shape), (0, 2, 3, 1))
    record, checks = windows.candidate(flat, 8, 256, seed=0)
    assert isinstance(record, records.PoolWindowsRecord) and checks == ()
    assert torch.equal(record.decode(), flat)


def test_probabilities_are_restored_with_rows_that_sum_to_one() -> None:
    # NOTE [ Probabilities keep their sums ]: softmax rows of 96 along the middle dim (groups of 256 straddle
    # rows), a fully masked row of zeros among them, at 2 bits.
    gen = torch.Generator().manual_seed(0)
    y = torch.softmax(torch.randn(8, 96, 5, generator=gen) * 3, dim=1)
    y[3, :, 2] = 0.0
    flat = y.reshape(-1)
    record = records.Probabilities((8, 96, 5)).encode(flat, 2, 256, seed=1)
    assert isinstance(record, records.ProbabilitiesRecord) and record.nbytes == record.inner.nbytes
    got = record.decode().view(8, 96, 5)
    sums = got.sum(1)
    # each row's sum is 1 up to float32 rounding of a 96-term sum and the division (2**-20 covers it)
    assert bool(((sums - 1).abs() <= 2**-20).logical_or(sums == 0).all())
    assert torch.equal(got[3, :, 2], torch.zeros(96)) and bool((got >= 0).all())
    # the stored values are the plain quantization's, draw for draw: the restore only rescales each row
    plain = records.encode(flat, "quantize", 2, 256, seed=1).decode().view(8, 96, 5)
    scale = plain.sum(1, keepdim=True)
    torch.testing.assert_close(got, plain / torch.where(scale > 0, scale, 1.0), rtol=2**-20, atol=0)


def test_log_probabilities_are_restored_with_rows_whose_logsumexp_is_zero() -> None:
    # NOTE [ Probabilities keep their sums ], log: log_softmax rows of 96 along the middle dim at 8 bits.
    gen = torch.Generator().manual_seed(0)
    y = torch.log_softmax(torch.randn(8, 96, 5, generator=gen) * 3, dim=1)
    flat = y.reshape(-1)
    got = records.Probabilities((8, 96, 5), log=True).encode(flat, 8, 256, seed=1).decode().view(8, 96, 5)
    # float32 rounding of a 96-term logsumexp and the shift (2**-18 of the rows' largest magnitude covers it)
    assert bool((torch.logsumexp(got, 1).abs() <= 2**-18 * y.abs().amax(1)).all())
    # the stored values are the plain quantization's, draw for draw: the restore only shifts each row
    plain = records.encode(flat, "quantize", 8, 256, seed=1).decode().view(8, 96, 5)
    torch.testing.assert_close(got, plain - torch.logsumexp(plain, 1, keepdim=True), rtol=0, atol=2**-18 * 20)
