"""Tests for the CIFAR-style ResNet-18."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from daftrain.demo.models.resnet import BasicBlock, resnet18


def _num_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_standard_parameter_count() -> None:
    # The usual CIFAR ResNet-18 (kuangliu/pytorch-cifar layout): 11,173,962.
    assert _num_params(resnet18()) == 11_173_962


def test_output_shape_standard() -> None:
    model = resnet18(num_classes=10).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)


def test_architecture_details() -> None:
    model = resnet18()
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    relus = [m for m in model.modules() if isinstance(m, nn.ReLU)]
    assert relus and not any(m.inplace for m in relus)
    stem = model.conv1
    assert isinstance(stem, nn.Conv2d)
    assert stem.kernel_size == (3, 3) and stem.stride == (1, 1)
    blocks = [m for m in model.modules() if isinstance(m, BasicBlock)]
    assert len(blocks) == 8
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 20


@pytest.mark.parametrize("width", [8, 16, 32])
def test_width_scaling(width: int) -> None:
    model = resnet18(num_classes=7, in_channels=1, width=width)
    assert model.conv1.out_channels == width
    assert model.conv1.in_channels == 1
    assert model.layer2[0].conv1.out_channels == 2 * width
    assert model.layer3[0].conv1.out_channels == 4 * width
    assert model.layer4[-1].conv2.out_channels == 8 * width
    assert model.fc.in_features == 8 * width and model.fc.out_features == 7
    # Conv weights dominate and scale with width^2.
    ratio = _num_params(model) / _num_params(resnet18(num_classes=7, in_channels=1, width=64))
    assert ratio == pytest.approx((width / 64) ** 2, rel=0.05)


def test_backward_all_parameters_get_gradients() -> None:
    torch.manual_seed(0)
    model = resnet18(num_classes=10, width=8)
    x = torch.randn(4, 3, 32, 32)
    y = torch.randint(0, 10, (4,))
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    assert model.fc.weight.grad.abs().sum() > 0


def test_odd_input_size_and_invalid_width() -> None:
    model = resnet18(width=4).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 28, 28)).shape == (1, 10)
    with pytest.raises(ValueError):
        resnet18(width=0)
