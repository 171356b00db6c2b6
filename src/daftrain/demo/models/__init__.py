"""Model builders used by daftrain's benchmarks and tests.

The Hugging Face builders live in :mod:`daftrain.demo.models.transformers_zoo` and
are not imported here, so that ``import daftrain.demo.models`` stays cheap and does
not require ``transformers``/``peft``.
"""

from daftrain.demo.models.resnet import BasicBlock, ResNet, resnet18

__all__ = ["BasicBlock", "ResNet", "resnet18"]
