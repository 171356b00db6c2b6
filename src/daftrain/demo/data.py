"""Offline real-image data sets for benchmarks and tests.

The primary source is Fashion-MNIST as installed by the Debian package
``dataset-fashion-mnist`` (idx files under /usr/share/datasets/fashion-mnist).
If it is missing, :func:`image_dataset` falls back to scikit-learn's bundled
8x8 digits, and says so in ``DatasetInfo.source``. Nothing is downloaded.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import DaftrainError, InvalidArgumentError

__all__ = [
    "DEFAULT_FASHION_MNIST_ROOT",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "DatasetInfo",
    "DatasetNotFoundError",
    "image_dataset",
    "load_fashion_mnist",
]

DEFAULT_FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")

# NOTE [ Normalisation constants ]
# Per-pixel mean/std of the Fashion-MNIST *training* images (28x28, scaled to
# [0, 1]), the values used by common training recipes. They are applied to
# both splits and to the zero padding (the padding is added to the uint8
# images first, so padded pixels become -mean/std, like a padded real image).
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530

_IMAGES_MAGIC = 2051  # 0x00000803: unsigned byte, 3 dimensions
_LABELS_MAGIC = 2049  # 0x00000801: unsigned byte, 1 dimension
_SPLIT_PREFIX = {"train": "train", "test": "t10k", "t10k": "t10k"}
_INSTALL_HINT = (
    "install it with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu) or pass root= pointing at the idx files"
)
_DIGITS_SEED = 0
_DIGITS_TRAIN_FRACTION = 0.8


class DatasetNotFoundError(DaftrainError, FileNotFoundError):
    """The data set's files are not installed; the message says how to install them."""


def _split_prefix(split: str) -> str:
    try:
        return _SPLIT_PREFIX[split]
    except KeyError:
        raise InvalidArgumentError(f"split must be 'train' or 'test', got {split!r}") from None


def _read_idx(root: Path, name: str) -> bytes:
    """Read ``name`` (gzip, or the same name without ``.gz``) from ``root``."""
    gz = root / name
    raw = root / name.removesuffix(".gz")
    if gz.is_file():
        with gzip.open(gz, "rb") as f:
            return f.read()
    if raw.is_file():
        return raw.read_bytes()
    raise DatasetNotFoundError(f"Fashion-MNIST file {gz} not found; {_INSTALL_HINT}")


def _parse_idx(data: bytes, magic: int, ndim: int, path: str) -> np.ndarray:
    header = 4 * (1 + ndim)
    if len(data) < header:
        raise InvalidArgumentError(f"{path}: truncated idx file ({len(data)} bytes); reinstall dataset-fashion-mnist")
    got_magic = int.from_bytes(data[0:4], "big")
    if got_magic != magic:
        raise InvalidArgumentError(
            f"{path}: bad idx magic number {got_magic} (expected {magic}); "
            "is this the right file? Reinstall dataset-fashion-mnist"
        )
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = int(np.prod(dims))
    if len(data) - header != expected:
        raise InvalidArgumentError(
            f"{path}: idx payload has {len(data) - header} bytes, header {dims} says {expected}; "
            "the file is corrupt or truncated, reinstall dataset-fashion-mnist"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def load_fashion_mnist(
    split: str = "train", root: str | Path = DEFAULT_FASHION_MNIST_ROOT
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load raw Fashion-MNIST from idx files: uint8 images ``[N, 28, 28]``, int64 labels ``[N]``.

    ``split`` is ``"train"`` (60,000) or ``"test"`` (10,000). Raises
    ``FileNotFoundError`` if the files are missing and ``ValueError`` if they
    are malformed, with the fix in the message.
    """
    prefix = _split_prefix(split)
    root = Path(root)
    if not root.is_dir():
        raise DatasetNotFoundError(f"Fashion-MNIST directory {root} does not exist; {_INSTALL_HINT}")
    img_name = f"{prefix}-images-idx3-ubyte.gz"
    lbl_name = f"{prefix}-labels-idx1-ubyte.gz"
    images = _parse_idx(_read_idx(root, img_name), _IMAGES_MAGIC, 3, str(root / img_name))
    labels = _parse_idx(_read_idx(root, lbl_name), _LABELS_MAGIC, 1, str(root / lbl_name))
    if images.shape[0] != labels.shape[0]:
        raise InvalidArgumentError(
            f"{root}: {images.shape[0]} images but {labels.shape[0]} labels for split {split!r}; "
            "reinstall dataset-fashion-mnist"
        )
    if images.shape[1:] != (28, 28):
        raise InvalidArgumentError(f"{root / img_name}: expected 28x28 images, got {images.shape[1:]}")
    if labels.size and int(labels.max()) > 9:
        raise InvalidArgumentError(f"{root / lbl_name}: label {int(labels.max())} out of range 0..9")
    # np.frombuffer is read-only; copy into tensors that own their memory.
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


@dataclass(frozen=True, eq=False)
class DatasetInfo:
    """An in-memory image classification data set ready for a model.

    ``images`` are float32 ``[N, C, H, W]`` normalised with ``mean``/``std``;
    ``labels`` are int64 ``[N]``; ``source`` says plainly where the data came
    from (and whether a fallback was used), for the caller to print.
    """

    name: str
    split: str
    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    source: str
    mean: float
    std: float
    fallback: bool = False

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def _to_model_input(
    pixels: torch.Tensor, mean: float, std: float, channels: int
) -> torch.Tensor:
    """``[N, H, W]`` float in [0, 1] -> normalised ``[N, C, H, W]`` float32."""
    x = (pixels.to(torch.float32) - mean) / std
    # expand + contiguous materialises the channel copies (models may write to
    # or channels_last-convert their input; a stride-0 view would surprise them).
    return x.unsqueeze(1).expand(-1, channels, -1, -1).contiguous()


def _fashion_mnist(split: str, root: Path, size: int, channels: int, limit: int | None) -> DatasetInfo:
    images, labels = load_fashion_mnist(split, root)
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    if size < 28:
        raise InvalidArgumentError(
            f"size must be >= 28 for Fashion-MNIST (images are padded, not cropped), got {size}"
        )
    before = (size - 28) // 2
    after = size - 28 - before
    # NOTE [ Pad before normalising ]
    # Zero-pad the uint8 images (black border, like the CIFAR-style 32x32 input
    # the ResNet expects) and only then normalise, so the border has the value
    # a black pixel gets, not 0 after normalisation.
    padded = F.pad(images, (before, after, before, after), value=0)
    x = _to_model_input(padded.to(torch.float32) / 255.0, FASHION_MNIST_MEAN, FASHION_MNIST_STD, channels)
    return DatasetInfo(
        name="fashion-mnist",
        split=split,
        images=x,
        labels=labels,
        num_classes=10,
        source=f"Fashion-MNIST ({split} split, {len(labels)} images) from {root}, 28x28 zero-padded to {size}x{size}",
        mean=FASHION_MNIST_MEAN,
        std=FASHION_MNIST_STD,
    )


def _digits(split: str, size: int, channels: int, limit: int | None, reason: str) -> DatasetInfo:
    from sklearn.datasets import load_digits  # caller checked importability

    bunch = load_digits()
    pixels = torch.as_tensor(np.asarray(bunch.images), dtype=torch.float32) / 16.0  # [N, 8, 8] in [0, 1]
    targets = torch.as_tensor(np.asarray(bunch.target), dtype=torch.int64)
    # NOTE [ Deterministic digits split ]
    # Fixed-seed permutation with a private generator: 80% train, 20% test,
    # identical on every call and independent of the global RNG state.
    gen = torch.Generator().manual_seed(_DIGITS_SEED)
    perm = torch.randperm(len(targets), generator=gen)
    n_train = round(_DIGITS_TRAIN_FRACTION * len(targets))
    idx = perm[:n_train] if _split_prefix(split) == "train" else perm[n_train:]
    train_pixels = pixels[perm[:n_train]]
    mean = float(train_pixels.mean())
    std = float(train_pixels.std())
    pixels, targets = pixels[idx], targets[idx]
    if limit is not None:
        pixels, targets = pixels[:limit], targets[:limit]
    up = F.interpolate(pixels.unsqueeze(1), size=(size, size), mode="bilinear", align_corners=False).squeeze(1)
    return DatasetInfo(
        name="digits",
        split="train" if _split_prefix(split) == "train" else "test",
        images=_to_model_input(up, mean, std, channels),
        labels=targets,
        num_classes=10,
        source=(
            f"FALLBACK: {reason}; using scikit-learn's bundled 8x8 digits instead "
            f"({split} split of a fixed-seed 80/20 split, {len(targets)} images, bilinearly upsampled "
            f"to {size}x{size}). Results are not comparable with Fashion-MNIST; "
            "`apt-get install dataset-fashion-mnist` to use the real data set."
        ),
        mean=mean,
        std=std,
        fallback=True,
    )


def image_dataset(
    split: str = "train",
    *,
    size: int = 32,
    channels: int = 3,
    limit: int | None = None,
    root: str | Path = DEFAULT_FASHION_MNIST_ROOT,
    allow_fallback: bool = True,
) -> DatasetInfo:
    """Load a real image data set as normalised float32 ``[N, channels, size, size]``.

    Uses Fashion-MNIST from ``root`` (28x28 padded to ``size``, repeated over
    ``channels``). If its files are missing and ``allow_fallback`` is set, uses
    scikit-learn's ``load_digits`` (if importable) and marks this in ``source``
    and ``fallback``. ``limit`` keeps the first ``limit`` samples of the split.
    """
    _split_prefix(split)
    if channels < 1:
        raise InvalidArgumentError(f"channels must be >= 1, got {channels}")
    if limit is not None and limit < 0:
        raise InvalidArgumentError(f"limit must be >= 0 or None, got {limit}")
    root = Path(root)
    try:
        return _fashion_mnist(split, root, size, channels, limit)
    except FileNotFoundError as exc:
        # NOTE [ Fallback only for missing files ]
        # Corrupt files (ValueError) are re-raised: silently swapping data sets
        # would hide a broken install. Only absence triggers the fallback.
        if not allow_fallback:
            raise
        missing = exc
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError:
        raise DatasetNotFoundError(
            f"no image data available: {missing}. Fix one of: (1) `apt-get install "
            "dataset-fashion-mnist` for Fashion-MNIST (preferred), or (2) `pip install "
            "scikit-learn` for the 8x8 digits fallback."
        ) from missing
    return _digits(split, size, channels, limit, reason=f"Fashion-MNIST not found ({missing})")
