"""CIFAR-style ResNet-18 (no torchvision dependency).

The architecture follows He et al. (2016) as adapted for 32x32 inputs in the
common CIFAR training recipes: a 3x3 stride-1 stem convolution, no max-pool,
four stages of two ``BasicBlock`` each, adaptive average pooling and a linear
classifier.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import InvalidArgumentError

__all__ = ["BasicBlock", "ResNet", "resnet18"]


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 projection) shortcut."""

    expansion: int = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        # NOTE [ Non-inplace ReLU ]
        # ReLU is deliberately *not* in-place. In-place activations change which
        # tensors autograd saves (ReLU then saves its output, overwriting the
        # BN output), and in-place ops on tensors that a saved-tensor hook has
        # already packed make the measurement of saved activations depend on
        # op ordering. Plain, out-of-place ReLU gives the textbook saved set.
        self.relu1 = nn.ReLU(inplace=False)
        self.relu2 = nn.ReLU(inplace=False)
        self.shortcut: nn.Module
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block."""
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet with ``BasicBlock`` stages for small (e.g. 32x32) images."""

    def __init__(
        self,
        num_blocks: tuple[int, ...] | list[int] = (2, 2, 2, 2),
        num_classes: int = 10,
        in_channels: int = 3,
        width: int = 64,
    ) -> None:
        super().__init__()
        if width < 1:
            raise InvalidArgumentError(f"width must be >= 1, got {width}")
        if len(num_blocks) != 4:
            raise InvalidArgumentError(f"expected 4 stages, got {len(num_blocks)}")
        widths = [width, 2 * width, 4 * width, 8 * width]
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=False)
        in_planes = width
        stages: list[nn.Sequential] = []
        for i, (planes, n) in enumerate(zip(widths, num_blocks, strict=True)):
            stride = 1 if i == 0 else 2
            blocks: list[nn.Module] = []
            for s in [stride] + [1] * (n - 1):
                blocks.append(BasicBlock(in_planes, planes, s))
                in_planes = planes
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1], num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``[N, num_classes]``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = torch.flatten(self.avgpool(out), 1)
        return self.fc(out)


def resnet18(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> nn.Module:
    """CIFAR-style ResNet-18; ``width`` is the first stage width (64 = standard).

    All stage widths scale proportionally: ``width, 2*width, 4*width, 8*width``.
    The standard model (``width=64, num_classes=10``) has 11,173,962 parameters.
    """
    return ResNet((2, 2, 2, 2), num_classes=num_classes, in_channels=in_channels, width=width)
