"""checks.py: records decided by checks the host reads later (NOTE [ Checks the host does not wait for ]).

On the CPU checks are read at once; the deferred path runs here with a stand-in verdict that answers only
after a given number of polls, and on CUDA with the real one (pinned memory behind an event)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import daftrain
from daftrain.saved import records
from daftrain.saved.checks import DeviceVerdict, Settling, all_finite, first_failed
from daftrain.saved.records import ExactRecord, PackedRecord, UndecidedRecord, encode


class LaggingVerdict:
    """``DeviceVerdict``'s contract on the CPU: ready only after ``lag`` polls; ``failed()`` answers at once."""

    lag: ClassVar[int] = 3
    made: ClassVar[list[LaggingVerdict]] = []

    def __init__(self, checks: records.Checks) -> None:
        self._reason = first_failed(checks)
        self.polls, self.waited = 0, False
        LaggingVerdict.made.append(self)

    def ready(self) -> bool:
        self.polls += 1
        return self.polls > self.lag

    def failed(self) -> str | None:
        self.waited = self.waited or self.polls <= self.lag
        return self._reason


@pytest.fixture
def lagging(monkeypatch: pytest.MonkeyPatch) -> type[LaggingVerdict]:
    """Checks on the CPU read later, through ``LaggingVerdict``."""
    monkeypatch.setattr(records, "reads_wait", lambda device: True)
    monkeypatch.setattr(records, "DeviceVerdict", LaggingVerdict)
    LaggingVerdict.made = []
    return LaggingVerdict


def test_first_failed_reads_checks_in_order_and_stops_at_the_first_failure() -> None:
    yes, no = torch.tensor(True), torch.tensor(False)
    assert first_failed(()) is None
    assert first_failed(((yes, "a"), (yes, "b"))) is None
    assert first_failed(((yes, "a"), (no, "b"), (no, "c"))) == "b"
    assert first_failed(((torch.tensor(3.0), "a"), (torch.tensor(float("nan")), "b"), (no, "c"))) == "b"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_fails_on_any_nan_or_inf_and_on_overflow_only(dtype: torch.dtype) -> None:
    x, y = torch.randn(1000).to(dtype), torch.randn(10).to(dtype)
    assert first_failed(((all_finite(x, None, y), "r"),)) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        z = x.clone()
        z[17] = bad
        assert first_failed(((all_finite(y, z), "r"),)) == "r"
    # +Inf and -Inf together (their sum is NaN) and finite values whose float32 sum overflows
    both = x.clone()
    both[1], both[2] = float("inf"), -float("inf")
    assert first_failed(((all_finite(both), "r"),)) == "r"
    big = torch.full((4,), 2e38)
    assert first_failed(((all_finite(big), "r"),)) == "r"  # kept as it is: memory, never accuracy


def test_an_undecided_record_settles_on_its_packed_form_or_on_the_values(lagging: type[LaggingVerdict]) -> None:
    x = torch.randn(4096)
    record = encode(x, "quantize", 4, 256, seed=1)
    assert isinstance(record, UndecidedRecord) and record.held_bytes == x.nbytes and not record.ready()
    assert isinstance(record.settle(), PackedRecord) and record.held_bytes == 0
    assert record.settle() is record.settle() and record.nbytes == record.settle().nbytes
    bad = x.clone()
    bad[7] = float("inf")
    kept = encode(bad, "quantize", 4, 256, seed=1)
    assert torch.equal(kept.decode(), bad)  # a decode settles first
    assert isinstance(kept.settle(), ExactRecord) and kept.settle().reason == "nonfinite"
    # a lossless record fails on its first check: the reason is "constant", not "nonfinite"
    not_constant = encode(bad, "lossless", 1, 256, seed=1)
    assert not_constant.settle().reason == "constant"


def test_settling_keeps_order_and_waits_only_over_its_byte_limit(lagging: type[LaggingVerdict]) -> None:
    lagging.lag = 10**9  # never ready by polling
    settling = Settling(limit_bytes=3 * 4096 * 4)
    made = [encode(torch.randn(4096), "quantize", 2, 256, seed=i) for i in range(5)]
    for i, record in enumerate(made[:3]):
        assert settling.add(record, i) == []  # within the limit: nothing waited for
    settled = settling.add(made[3], 3)  # over it: the oldest is waited for, only until back under
    assert [tag for _, tag in settled] == [0] and settling.held_bytes == 3 * 4096 * 4
    assert settling.add(made[4], 4)[0][1] == 1
    assert [tag for _, tag in settling.settle_all()] == [2, 3, 4] and len(settling) == 0
    assert settling.held_bytes == 0 and all(isinstance(r.settle(), PackedRecord) for r in made)


def test_settling_takes_what_is_ready_without_waiting(lagging: type[LaggingVerdict]) -> None:
    lagging.lag = 1
    settling = Settling()
    first, second = (encode(torch.randn(4096), "quantize", 2, 256, seed=i) for i in range(2))
    assert settling.add(first, "a") == []  # polled once: not ready
    assert [tag for _, tag in settling.add(second, "b")] == ["a"]  # first ready at its second poll
    assert not any(v.waited for v in lagging.made)


class _Mixed(nn.Module):
    """Every kind of check: a quantized linear input with a NaN and an Inf, a normalisation of a row with an
    Inf, a constant that is not exact at 1 bit and one that is, a maximum against a 0-d floor with a NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(64, 64), nn.Linear(64, 64), nn.LayerNorm(64)
        self.register_buffer("scales", torch.rand(128, 64) + 0.5)
        self.register_buffer("dropout_like", (torch.rand(128, 64) > 0.5).float() * 2.0)

    def forward(self, x: torch.Tensor, poison: bool) -> torch.Tensor:
        h = self.a(x)
        if poison:
            h = h.clone()
            h[3, 5], h[7, 1] = float("nan"), float("inf")
        h = self.b(h * self.scales) + self.norm(h) * self.dropout_like
        return torch.maximum(F.gelu(h), torch.tensor(-0.05))


@pytest.mark.parametrize("poison", [False, True])
def test_checks_read_later_give_the_gradients_and_stats_of_checks_read_at_once(
        poison: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x = _Mixed(), torch.randn(128, 64, requires_grad=True)

    def step() -> tuple[list[torch.Tensor], daftrain.CompressionStats]:
        model.zero_grad()
        x.grad = None
        ctx = daftrain.compress(bits=2, min_numel=0, seed=5)
        for _ in range(2):  # the second step decides on choices made on the first
            with ctx:
                out = model(x, poison)
            out.nan_to_num().square().sum().backward()
        return [torch.nan_to_num(g, 7.0, 8.0, 9.0) for g in (x.grad, *[p.grad for p in model.parameters()])], ctx.stats

    at_once, stats_at_once = step()
    LaggingVerdict.lag, LaggingVerdict.made = 2, []
    monkeypatch.setattr(records, "reads_wait", lambda device: True)
    monkeypatch.setattr(records, "DeviceVerdict", LaggingVerdict)
    later, stats_later = step()
    assert LaggingVerdict.made  # the deferred path ran
    for a, b in zip(at_once, later, strict=True):
        assert torch.equal(a, b)
    assert stats_later.kept_reasons == stats_at_once.kept_reasons
    assert (stats_later.compressed, stats_later.kept, stats_later.packed_bytes, stats_later.kept_bytes) == (
        stats_at_once.compressed, stats_at_once.kept, stats_at_once.packed_bytes, stats_at_once.kept_bytes)
    if poison:
        assert stats_later.kept_reasons["nonfinite"] >= 2  # the linear's input and the norm's
    assert stats_later.kept_reasons["constant"] >= 1 and stats_later.bool_packed + stats_later.compressed > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_verdict_reads_the_checks_of_a_gpu_without_waiting_to_be_made() -> None:
    yes = torch.tensor(True, device="cuda")
    no = torch.tensor(False, device="cuda")
    verdict = DeviceVerdict(((yes, "a"), (no, "b"), (no, "c")))
    assert verdict.failed() == "b" and verdict.ready()
    assert DeviceVerdict(((yes, "a"),)).failed() is None
    nan = torch.tensor(float("nan"), device="cuda")
    assert DeviceVerdict(((torch.tensor(2.0, device="cuda"), "a"), (nan, "b"))).failed() == "b"
    x = torch.randn(1 << 16, device="cuda")
    x[5] = float("nan")
    record = encode(x, "quantize", 2, 256, seed=0)
    assert isinstance(record, UndecidedRecord)
    assert torch.equal(record.decode().isnan(), x.isnan()) and record.settle().reason == "nonfinite"
