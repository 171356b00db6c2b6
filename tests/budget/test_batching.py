"""Batches: their size, slices and copies of them, balanced micro-batches, token counts."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from daftrain.budget.batching import (
    balanced_sizes,
    batch_size,
    head_copy,
    shapes_of,
    slice_copy,
    split_batch,
    token_count,
)
from daftrain.errors import ArgumentTypeError, InvalidArgumentError


def test_split_batch_structures():
    x, y = torch.arange(10).view(5, 2), torch.arange(5)
    parts = split_batch({"a": x, "b": (y, "tag")}, [2, 3])
    assert parts[1]["a"].shape == (3, 2) and parts[1]["b"][1] == "tag"
    assert parts[0]["a"].data_ptr() == x.data_ptr()  # views, no copy


def test_split_batch_keeps_namedtuples_and_scalars():
    Pair = namedtuple("Pair", "x scale")
    parts = split_batch(Pair(torch.arange(6), torch.tensor(2.0)), [4, 2])
    assert isinstance(parts[1], Pair) and parts[1].x.tolist() == [4, 5] and parts[1].scale.item() == 2.0


def test_batch_size_reads_the_first_tensor():
    assert batch_size({"ids": torch.zeros(7, 3), "labels": torch.zeros(7)}) == 7
    assert batch_size(("tag", [torch.zeros(5, 2)])) == 5
    assert batch_size(torch.zeros(0, 4)) == 0


def test_batch_size_passes_over_0d_tensors():
    assert batch_size((torch.tensor(2.0), {"x": torch.zeros(6, 3)})) == 6


@pytest.mark.parametrize(("batch", "named"), [
    ((torch.zeros(20, 8, 4), torch.zeros(8)), r"batch\[1\] \(shape \(8,\)\) has 8 along dim 0 where batch\[0\]"),
    ({"ids": torch.zeros(8, 5), "weights": [torch.zeros(3)]}, r"batch\['weights'\]\[0\] \(shape \(3,\)\)"),
])
def test_batch_size_refuses_tensors_that_disagree_on_the_samples(batch, named):
    # NOTE [ Every tensor of a batch is split ]
    with pytest.raises(InvalidArgumentError, match=named + r".*put the sample dimension first"):
        batch_size(batch)


@pytest.mark.parametrize("bad", [{"tag": "x"}, torch.tensor(3.0), 12])
def test_batch_size_names_the_batch_and_what_to_pass(bad):
    with pytest.raises(ArgumentTypeError, match=r"batch .*pass the samples as tensors of shape \(batch, \.\.\.\)"):
        batch_size(bad)


def test_head_copy_owns_its_storage():
    x = torch.arange(12.0).view(6, 2)
    head = head_copy((x, "tag"), 2)
    assert torch.equal(head[0], x[:2]) and head[1] == "tag"
    assert head[0].untyped_storage().nbytes() == 2 * 2 * 4  # the slice, not the whole batch
    assert head_copy(x, 10).shape == (6, 2)


def test_slice_copy_owns_its_storage_and_stops_at_the_end():
    x = torch.arange(12.0).view(6, 2)
    middle = slice_copy({"x": x}, 2, 3)["x"]
    assert torch.equal(middle, x[2:5])
    assert middle.untyped_storage().nbytes() == 3 * 2 * 4
    assert torch.equal(slice_copy(x, 4, 10), x[4:])


@pytest.mark.parametrize(("total", "k", "sizes"), [(10, 3, [4, 3, 3]), (8, 4, [2, 2, 2, 2]), (3, 3, [1, 1, 1])])
def test_balanced_sizes(total, k, sizes):
    assert balanced_sizes(total, k) == sizes


def test_token_count_after_the_shift():
    labels = torch.tensor([[1, 2, -100, 4], [-100, -100, 3, 3]])
    assert token_count()({"labels": labels}).item() == 4  # columns 1..3: 2, -100, 4 / -100, 3, 3
    assert token_count(1, shift=False)((None, labels)).item() == 5


def test_shapes_of_names_every_tensor_with_the_slice_size():
    batch = {"ids": torch.zeros(8, 5, dtype=torch.long), "extra": (torch.zeros(8, 2, 3), torch.tensor(1.0)),
             "tag": "x"}
    assert shapes_of(batch) == ((8, 5), (8, 2, 3), ())
    assert shapes_of(batch, 3) == ((3, 5), (3, 2, 3), ())  # the 0-d tensor is passed to every slice whole
    assert shapes_of(split_batch(batch, [3, 5])[0]) == shapes_of(batch, 3)
    assert shapes_of(torch.zeros(4, 7), 2) == ((2, 7),)
