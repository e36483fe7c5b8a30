"""The torchvision loader on fake IDX files in torchvision's raw layout (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flwr_pfl.data.config import DataConfig
from flwr_pfl.data.federated import clear_caches, load_client_data
from flwr_pfl.data.vision import expected_files, load_vision_pool
from flwr_pfl.errors import DataNotFoundError


def write_idx(path: Path, array: np.ndarray) -> None:
    """An uncompressed IDX file: magic (0, 0, uint8 type 0x08, ndim), big-endian dims, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def fake_mnist(root: Path, folder: str = "MNIST", n_train: int = 40, n_test: int = 20) -> None:
    """Images whose every pixel is the sample number, labels = sample number mod 10."""
    raw = root / folder / "raw"
    for prefix, start, n in (("train", 0, n_train), ("t10k", n_train, n_test)):
        ids = np.arange(start, start + n)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", np.repeat(ids, 28 * 28).reshape(n, 28, 28))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", ids % 10)


@pytest.fixture(autouse=True)
def _fresh_caches() -> None:
    clear_caches()


def test_pool_is_train_then_test_as_uint8_images(tmp_path: Path) -> None:
    fake_mnist(tmp_path, "FashionMNIST")
    pool = load_vision_pool("fashion-mnist", str(tmp_path), False)
    assert pool.x.shape == (60, 1, 28, 28) and pool.x.dtype == torch.uint8
    assert torch.equal(pool.x[:, 0, 5, 5], torch.arange(60, dtype=torch.uint8))
    assert torch.equal(pool.y, torch.arange(60) % 10)
    assert (pool.num_classes, pool.num_domains) == (10, 1)
    assert (pool.mean, pool.std) == ((0.2860,), (0.3530,))
    assert load_vision_pool("fashion-mnist", str(tmp_path), False) is pool  # cached
    assert torch.allclose(pool.inputs(torch.tensor([51]))[0, 0, 0, 0], torch.tensor(51 / 255))


def test_client_data_is_standardised_per_dataset(tmp_path: Path) -> None:
    fake_mnist(tmp_path)
    config = DataConfig(dataset="mnist", data_dir=str(tmp_path), test_fraction=0.25)
    data = load_client_data(config, 0, 2)
    assert (len(data.train), len(data.val), len(data.test)) == (22, 0, 8)
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10 and data.num_domains == 1
    sample_ids = torch.round((data.train.x[:, 0, 0, 0] * 0.3081 + 0.1307) * 255).long()
    assert torch.equal(sample_ids % 10, data.train.y)


def test_missing_files_message_says_where_and_how(tmp_path: Path) -> None:
    fake_mnist(tmp_path)
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataNotFoundError) as info:
        load_vision_pool("mnist", str(tmp_path), False)
    message = str(info.value)
    assert str(tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte") in message
    assert "train-images-idx3-ubyte" not in message  # only what is missing
    assert f"python -m flwr_pfl.data.provision --data-dir {tmp_path} --datasets mnist" in message
    assert "download=true" in message


def test_cifar_message_offers_the_download_only(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError) as info:
        load_vision_pool("cifar10", str(tmp_path), False)
    message = str(info.value)
    assert str(tmp_path / "cifar-10-batches-py" / "data_batch_1") in message
    assert "provision" not in message and "download=true" in message


def test_expected_files_follow_torchvision_layout(tmp_path: Path) -> None:
    assert [p.relative_to(tmp_path).as_posix() for p in expected_files("mnist", tmp_path)] == [
        "MNIST/raw/train-images-idx3-ubyte",
        "MNIST/raw/train-labels-idx1-ubyte",
        "MNIST/raw/t10k-images-idx3-ubyte",
        "MNIST/raw/t10k-labels-idx1-ubyte",
    ]
    assert expected_files("cifar100", tmp_path)[0] == tmp_path / "cifar-100-python" / "train"


def test_idx_files_are_read_as_torchvision_reads_them(tmp_path: Path) -> None:
    """The IDX reader and torchvision's MNIST class give the same pool on the same files, and
    the file names are torchvision's own."""
    from torchvision import datasets

    from flwr_pfl.data.vision import IDX_FILES

    for cls in (datasets.MNIST, datasets.FashionMNIST):
        assert tuple(Path(url).name.removesuffix(".gz") for url, _ in cls.resources) == IDX_FILES
    fake_mnist(tmp_path, "MNIST", n_train=30, n_test=12)
    pool = load_vision_pool("mnist", str(tmp_path), False)
    parts = [datasets.MNIST(str(tmp_path), train=train, download=False) for train in (True, False)]
    assert torch.equal(pool.x, torch.cat([p.data for p in parts]).unsqueeze(1))
    assert torch.equal(pool.y, torch.cat([p.targets for p in parts]).long())


def test_a_corrupt_idx_file_is_reported(tmp_path: Path) -> None:
    fake_mnist(tmp_path)
    (tmp_path / "MNIST" / "raw" / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x09abc")
    with pytest.raises(DataNotFoundError, match="train-labels-idx1-ubyte holds 3 values"):
        load_vision_pool("mnist", str(tmp_path), False)
