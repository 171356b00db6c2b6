"""Tests for the offline image data loaders."""

from __future__ import annotations

import gzip
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from daftrain.demo.data import (
    DEFAULT_FASHION_MNIST_ROOT,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    image_dataset,
    load_fashion_mnist,
)

_FILES = [
    f"{p}-{kind}-idx{n}-ubyte.gz"
    for p in ("train", "t10k")
    for kind, n in (("images", 3), ("labels", 1))
]
HAVE_FMNIST = all((DEFAULT_FASHION_MNIST_ROOT / f).is_file() for f in _FILES)
needs_fmnist = pytest.mark.skipif(
    not HAVE_FMNIST,
    reason=f"Fashion-MNIST idx files not in {DEFAULT_FASHION_MNIST_ROOT} (apt-get install dataset-fashion-mnist)",
)


def _write_idx(root: Path, prefix: str, images: np.ndarray, labels: np.ndarray, *, magic: int = 2051) -> None:
    root.mkdir(parents=True, exist_ok=True)
    n, h, w = images.shape
    header = b"".join(int(v).to_bytes(4, "big") for v in (magic, n, h, w))
    with gzip.open(root / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
        f.write(header + images.astype(np.uint8).tobytes())
    lheader = b"".join(int(v).to_bytes(4, "big") for v in (2049, len(labels)))
    with gzip.open(root / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
        f.write(lheader + labels.astype(np.uint8).tobytes())


def _fake_sklearn(monkeypatch: pytest.MonkeyPatch, n: int = 50) -> None:
    """Install a stand-in ``sklearn.datasets.load_digits`` (sklearn is not installed here)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 17, size=(n, 8, 8)).astype(np.float64)
    target = np.arange(n) % 10

    def load_digits() -> types.SimpleNamespace:
        return types.SimpleNamespace(images=images.copy(), target=target.copy())

    sklearn = types.ModuleType("sklearn")
    datasets = types.ModuleType("sklearn.datasets")
    datasets.load_digits = load_digits  # type: ignore[attr-defined]
    sklearn.datasets = datasets  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sklearn", sklearn)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", datasets)


@needs_fmnist
def test_fashion_mnist_test_split() -> None:
    images, labels = load_fashion_mnist("test")
    assert images.shape == (10_000, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (10_000,) and labels.dtype == torch.int64
    assert int(labels.min()) == 0 and int(labels.max()) == 9
    assert torch.bincount(labels).tolist() == [1000] * 10


@needs_fmnist
def test_fashion_mnist_train_split_and_normalisation_constants() -> None:
    images, labels = load_fashion_mnist("train")
    assert images.shape == (60_000, 28, 28) and labels.shape == (60_000,)
    pixels = images.numpy()
    assert pixels.mean(dtype=np.float64) / 255 == pytest.approx(FASHION_MNIST_MEAN, abs=1e-3)
    assert pixels.std(dtype=np.float64) / 255 == pytest.approx(FASHION_MNIST_STD, abs=1e-3)


@needs_fmnist
def test_image_dataset_padding_channels_determinism() -> None:
    a = image_dataset("test", limit=256)
    b = image_dataset("test", limit=256)
    assert a.name == "fashion-mnist" and not a.fallback and a.num_classes == 10
    assert a.images.shape == (256, 3, 32, 32) and a.images.dtype == torch.float32
    assert len(a) == 256 and a.labels.shape == (256,)
    assert "Fashion-MNIST" in a.source
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.images[:, 0], a.images[:, 2])
    black = -FASHION_MNIST_MEAN / FASHION_MNIST_STD
    border = torch.cat([a.images[..., :2, :].flatten(), a.images[..., -2:, :].flatten(),
                        a.images[..., :, :2].flatten(), a.images[..., :, -2:].flatten()])
    assert torch.allclose(border, torch.full_like(border, black))
    raw, raw_labels = load_fashion_mnist("test")
    inner = a.images[:, 0, 2:30, 2:30]
    expected = (raw[:256].float() / 255 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    assert torch.allclose(inner, expected, atol=1e-6)
    assert torch.equal(a.labels, raw_labels[:256])


@needs_fmnist
def test_image_dataset_size_and_channels_options() -> None:
    d = image_dataset("test", size=28, channels=1, limit=8)
    assert d.images.shape == (8, 1, 28, 28)
    with pytest.raises(ValueError):
        image_dataset("test", size=20, limit=8)
    with pytest.raises(ValueError, match="split"):
        image_dataset("validation")


def test_synthetic_idx_roundtrip(tmp_path: Path) -> None:
    images = np.arange(3 * 28 * 28, dtype=np.int64).reshape(3, 28, 28) % 256
    labels = np.array([3, 1, 4])
    _write_idx(tmp_path, "t10k", images, labels)
    x, y = load_fashion_mnist("test", root=tmp_path)
    assert torch.equal(x, torch.from_numpy(images.astype(np.uint8)))
    assert y.tolist() == [3, 1, 4] and y.dtype == torch.int64


def test_missing_root_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist("train", root=tmp_path / "nope")
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        load_fashion_mnist("train", root=tmp_path / "empty")


def test_bad_magic_and_truncated_files(tmp_path: Path) -> None:
    images = np.zeros((2, 28, 28), dtype=np.uint8)
    _write_idx(tmp_path / "magic", "train", images, np.array([0, 1]), magic=1234)
    with pytest.raises(ValueError, match="magic"):
        load_fashion_mnist("train", root=tmp_path / "magic")
    _write_idx(tmp_path / "trunc", "train", images, np.array([0, 1]))
    path = tmp_path / "trunc" / "train-images-idx3-ubyte.gz"
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[:-10]))
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_fashion_mnist("train", root=tmp_path / "trunc")


def test_corrupt_files_do_not_fall_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_sklearn(monkeypatch)
    _write_idx(tmp_path, "train", np.zeros((2, 28, 28), dtype=np.uint8), np.array([0, 1]), magic=7)
    with pytest.raises(ValueError):
        image_dataset("train", root=tmp_path)


def test_fallback_to_digits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_sklearn(monkeypatch, n=50)
    root = tmp_path / "missing"
    train = image_dataset("train", root=root)
    test = image_dataset("test", root=root)
    assert train.fallback and test.fallback and train.name == "digits"
    assert train.source.startswith("FALLBACK") and "dataset-fashion-mnist" in train.source
    assert "digits" in train.source
    assert train.images.shape == (40, 3, 32, 32) and test.images.shape == (10, 3, 32, 32)
    assert train.images.dtype == torch.float32 and train.labels.dtype == torch.int64
    assert train.num_classes == 10
    # Normalised with train statistics.
    assert float(train.images.mean()) == pytest.approx(0.0, abs=0.05)
    # Deterministic, independent of the global RNG.
    torch.manual_seed(123)
    again = image_dataset("train", root=root)
    assert torch.equal(again.images, train.images) and torch.equal(again.labels, train.labels)
    limited = image_dataset("test", root=root, limit=4, channels=1, size=16)
    assert limited.images.shape == (4, 1, 16, 16)
    with pytest.raises(FileNotFoundError):
        image_dataset("train", root=root, allow_fallback=False)


def test_fallback_split_is_disjoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_sklearn(monkeypatch, n=50)
    root = tmp_path / "missing"
    train = image_dataset("train", root=root, channels=1)
    test = image_dataset("test", root=root, channels=1)
    # Every fake image is distinct, so no test image may appear in train.
    flat_train = {tuple(row.tolist()) for row in train.images.flatten(1)}
    assert not any(tuple(row.tolist()) in flat_train for row in test.images.flatten(1))


def test_no_data_at_all_names_both_fixes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)  # makes `import sklearn` raise ImportError
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(FileNotFoundError) as info:
        image_dataset("train", root=tmp_path / "missing")
    msg = str(info.value)
    assert "apt-get install dataset-fashion-mnist" in msg and "pip install scikit-learn" in msg
