"""Small architectures written with ``torch.nn`` alone, for the zoo benchmarks beside the Hugging Face ones.

They cover what the ``transformers`` zoo does not: ``nn.LSTM`` / ``nn.GRU``, ``nn.Transformer`` (whose
attention runs inside ``F.multi_head_attention_forward``), a convolutional encoder-decoder, a mobile CNN
with squeeze-excitation and clips, an EfficientNet-style one (inverted residuals, in-place activations), an
MLP-Mixer (linear layers over a transposed view, which ``F.linear`` copies before saving), a recommender
(``nn.EmbeddingBag``), a spectral operator (complex FFT and complex parameters), einsum attention and a
vocoder-style 1-D convolution stack whose weights ``weight_norm`` computes in every forward. Each also runs
under bfloat16 autocast (suffix ``:bf16``), where ops save copies of their operands in the autocast dtype.
``zoo_model(name)`` takes the same seeds every time; ``zoo_inputs(name)`` gives the keyword inputs of
``model(**inputs)``, whose output is a dict, as ``transformers_zoo.zoo_gradient`` expects.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import InvalidArgumentError

__all__ = ["TORCH_ZOO", "zoo_inputs", "zoo_model"]


class _RecurrentLM(nn.Module):
    def __init__(self, cell: type[nn.Module], bidirectional: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.rnn = cell(32, 48, num_layers=2, batch_first=True, bidirectional=bidirectional, dropout=0.1)
        self.head = nn.Linear(96 if bidirectional else 48, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x))[0])


class _CausalEncoder(nn.Module):
    def __init__(self, norm_first: bool, activation: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, 0.1, activation, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.encoder(self.embed(x), mask=mask, is_causal=True))


class _Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.transformer = nn.Transformer(64, 4, 1, 1, 128, 0.1, batch_first=True)
        self.head = nn.Linear(64, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.transformer(h, h[:, :8]))


class _UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU())
        self.down2 = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.InstanceNorm2d(32, affine=True),
                                   nn.LeakyReLU(0.2, inplace=True))
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.out = nn.Conv2d(32, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.down1(x)
        b = self.down2(a)
        c = self.up(b) + F.interpolate(b, scale_factor=2, mode="bilinear", align_corners=False)[:, :16]
        return self.out(torch.cat([a, c], 1))


class _SqueezeExcite(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.gate = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c // 4, 1), nn.ReLU(inplace=True),
                                  nn.Conv2d(c // 4, c, 1), nn.Hardsigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(x)


def _mobile_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.Hardswish(inplace=True),
        nn.Conv2d(16, 16, 3, 1, 1, groups=16), nn.BatchNorm2d(16), nn.ReLU6(inplace=True), _SqueezeExcite(16),
        nn.Conv2d(16, 32, 1), nn.BatchNorm2d(32), nn.Mish(), nn.MaxPool2d(2), nn.Dropout2d(0.1),
        nn.Conv2d(32, 32, 3, padding=1), nn.ELU(), nn.AdaptiveMaxPool2d(2), nn.Flatten(), nn.Linear(128, 10))


class _InvertedResidual(nn.Module):
    """A 1x1 expansion, a depthwise 3x3 convolution, a squeeze-excitation gate and a 1x1 projection, each
    convolution batch-normalised, activations in place, a residual path where the shapes allow one."""

    def __init__(self, c_in: int, c_out: int, stride: int, act: type[nn.Module]) -> None:
        super().__init__()
        hidden = 4 * c_in
        self.expand = nn.Sequential(nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), act(inplace=True))
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                                       nn.BatchNorm2d(hidden), act(inplace=True))
        self.gate = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(hidden, c_in // 2, 1), act(inplace=True),
                                  nn.Conv2d(c_in // 2, hidden, 1), nn.Sigmoid())
        self.project = nn.Sequential(nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.depthwise(self.expand(x))
        h = self.project(h * self.gate(h))
        return x + h if self.residual else h


def _inverted_residual_cnn() -> nn.Module:
    """EfficientNet / MobileNetV3-style: in-place SiLU and Hardswish, as torchvision and timm build them."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.SiLU(inplace=True),
        _InvertedResidual(16, 16, 1, nn.SiLU), _InvertedResidual(16, 24, 2, nn.SiLU),
        _InvertedResidual(24, 24, 1, nn.Hardswish), _InvertedResidual(24, 40, 2, nn.Hardswish),
        nn.Conv2d(40, 160, 1, bias=False), nn.BatchNorm2d(160), nn.SiLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(160, 10))


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 64, 4, 4)
        self.norm1, self.norm2 = nn.LayerNorm(64), nn.LayerNorm(64)
        self.tokens = nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 64))
        self.channels = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        x = x + self.channels(self.norm2(x))
        return self.head(x.mean(1))


class _Recommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(1000, 32, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bag(x))


class _SpectralOperator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Linear(2, 16)
        self.modes = nn.Parameter(torch.randn(16, 16, 8, dtype=torch.cfloat) * 0.1)
        self.project = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x).transpose(1, 2)
        spectrum = torch.einsum("bix,iox->box", torch.fft.rfft(h)[..., :8], self.modes)
        return self.project(F.gelu(h + torch.fft.irfft(spectrum, n=h.shape[-1])).transpose(1, 2))


class _EinsumAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 4, 16).unbind(2)
        p = torch.einsum("bqhd,bkhd->bhqk", q, k).div(4).softmax(-1)
        return self.out(torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(x.shape))


class _Vocoder(nn.Module):
    """Upsampling and dilated residual 1-D convolutions, every weight under ``weight_norm`` (as in HiFi-GAN)."""

    def __init__(self) -> None:
        super().__init__()
        norm = nn.utils.parametrizations.weight_norm
        self.up = norm(nn.ConvTranspose1d(16, 64, 8, stride=4, padding=2))
        self.blocks = nn.ModuleList(norm(nn.Conv1d(64, 64, 3, dilation=d, padding=d)) for d in (1, 3, 5))
        self.out = norm(nn.Conv1d(64, 1, 7, padding=3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        for conv in self.blocks:
            h = h + conv(F.leaky_relu(h, 0.1))
        return torch.tanh(self.out(F.leaky_relu(h, 0.1)))


def _tokens() -> torch.Tensor:
    return torch.randint(0, 100, (8, 24))


def _images() -> torch.Tensor:
    return torch.randn(8, 3, 32, 32)


_ARCHITECTURES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "lstm": (lambda: _RecurrentLM(nn.LSTM), _tokens),
    "gru_bidirectional": (lambda: _RecurrentLM(nn.GRU, bidirectional=True), _tokens),
    "transformer_encoder_postnorm": (lambda: _CausalEncoder(False, "relu"), _tokens),
    "transformer_encoder_prenorm": (lambda: _CausalEncoder(True, "gelu"), _tokens),
    "transformer_seq2seq": (_Seq2Seq, _tokens),
    "unet": (_UNet, _images),
    "mobile_cnn": (_mobile_cnn, _images),
    "inverted_residual_cnn": (_inverted_residual_cnn, _images),
    "mlp_mixer": (_Mixer, _images),
    "recommender": (_Recommender, lambda: torch.randint(0, 1000, (64, 10))),
    "spectral_operator": (_SpectralOperator, lambda: torch.randn(8, 64, 2)),
    "einsum_attention": (_EinsumAttention, lambda: torch.randn(8, 24, 64)),
    "vocoder": (_Vocoder, lambda: torch.randn(8, 16, 32)),
}

_CONVOLUTIONAL = ("unet", "mobile_cnn", "inverted_residual_cnn")
"""Trained in channels_last too (the ``:channels_last`` entries)."""

TORCH_ZOO: tuple[str, ...] = tuple(
    n for name in _ARCHITECTURES
    for n in (name, f"{name}:bf16", *((f"{name}:channels_last",) if name in _CONVOLUTIONAL else ()))
)
"""Every architecture, in float32 and under bfloat16 autocast; the convolutional ones in channels_last too."""


class _Dict(nn.Module):
    """The architecture's output as ``{"logits": float32}``, its forward under autocast or its input in
    channels_last where asked."""

    def __init__(self, inner: nn.Module, variant: str) -> None:
        super().__init__()
        self.inner, self.variant = inner, variant
        if variant == "channels_last":
            self.inner.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.variant == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cpu", torch.bfloat16, enabled=self.variant == "bf16"):
            y = self.inner(x)
        return {"logits": y.float()}


def _split(name: str) -> tuple[str, str]:
    base, _, variant = name.partition(":")
    if name not in TORCH_ZOO:
        raise InvalidArgumentError(f"unknown torch zoo architecture {name!r}: use one of TORCH_ZOO")
    return base, variant


def zoo_model(name: str) -> nn.Module:
    """The architecture ``name`` of ``TORCH_ZOO`` in train mode, initialised from seed 0."""
    base, variant = _split(name)
    torch.manual_seed(0)
    return _Dict(_ARCHITECTURES[base][0](), variant).train()


def zoo_inputs(name: str) -> dict[str, torch.Tensor]:
    """The keyword inputs of ``zoo_model(name)``, drawn from seed 1."""
    base, _ = _split(name)
    torch.manual_seed(1)
    return {"x": _ARCHITECTURES[base][1]()}
