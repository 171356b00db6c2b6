"""The demo behind ``daftrain demo``: ResNet-18 on Fashion-MNIST, plain PyTorch against daftrain. Not API."""

from .run import DemoArgs, DemoResult, demo

__all__ = ["DemoArgs", "DemoResult", "demo"]
