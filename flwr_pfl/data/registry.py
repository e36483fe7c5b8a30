"""Datasets by name: the pool type every dataset builder returns, and the registry of builders.

A *pool* is the whole dataset before it is split among clients (for the torchvision datasets,
train and test concatenated). The federated pipeline (``flwr_pfl.data.federated``) turns a pool
into clients: subsample, domain transform, partition, local train/val/test split.

New datasets (synthetic problems, local files) join the pipeline by name::

    def build(config: DataConfig) -> DatasetPool: ...
    register_dataset("my-dataset", build)

after which ``DataConfig(dataset="my-dataset")`` is valid. A builder may read the dataset-level
fields of the config (``data_dir``, ``download``, ``seed``, ``num_domains``) and should not depend
on the partitioning or split fields. The pipeline caches what a builder returns per config, so a
builder need not cache itself unless several configs share an expensive load (as the torchvision
loader does).

A generated dataset whose targets carry noise may also give the noise-free targets
(``DatasetPool.noise_free_y``) and say so when registering (``noise_free_targets=True``); the run
key ``noise-free-test`` then evaluates every client on them (``DataConfig.noise_free_test``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from flwr_pfl.data.types import Task, check_aligned

if TYPE_CHECKING:
    from flwr_pfl.data.config import DataConfig


@dataclass(frozen=True, eq=False)
class DatasetPool:
    """All samples of a dataset, before partitioning.

    Attributes:
        x: inputs, shape (N, *input_shape). Images are (N, C, H, W) and may be kept as uint8
            pixels (0..255) to save memory; :meth:`inputs` turns them into float32 in [0, 1].
        y: int64 class labels (classification) or float32 targets (regression), shape (N,) or
            (N, o).
        domain: int64 domain labels of shape (N,), in [0, num_domains).
        num_classes: number of classes (0 for regression).
        num_domains: number of domains the samples come from (1 for plain datasets).
        task: "classification" or "regression".
        mean, std: per-channel statistics used to standardise the inputs after any domain
            transform, or None to leave the inputs as they are.
        noise_free_y: for a dataset whose targets ``y`` carry noise, the same targets without
            it (same shape and dtype as ``y``), used for the test splits when the run key
            ``noise-free-test`` is on; None for datasets without them.
    """

    x: torch.Tensor
    y: torch.Tensor
    domain: torch.Tensor
    num_classes: int
    num_domains: int = 1
    task: Task = "classification"
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    noise_free_y: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_aligned(self.x, self.y, self.domain)
        if (self.mean is None) != (self.std is None):
            raise ValueError("mean and std must be given together")
        clean = self.noise_free_y
        if clean is not None and (clean.shape != self.y.shape or clean.dtype != self.y.dtype):
            raise ValueError(
                f"noise_free_y must have the shape and dtype of y, {tuple(self.y.shape)} "
                f"{self.y.dtype}; got {tuple(clean.shape)} {clean.dtype}"
            )

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def inputs(self, index: torch.Tensor) -> torch.Tensor:
        """The inputs at ``index`` as float32; uint8 pixels are scaled to [0, 1]."""
        x = self.x[index]
        if x.dtype == torch.uint8:
            return x.to(torch.float32).div_(255.0)
        return x.to(torch.float32)

    def select(self, index: torch.Tensor) -> DatasetPool:
        """A pool with the samples at ``index`` only (same metadata)."""
        clean = None if self.noise_free_y is None else self.noise_free_y[index]
        return replace(
            self, x=self.x[index], y=self.y[index], domain=self.domain[index], noise_free_y=clean
        )

    def with_domains(self, domain: torch.Tensor, num_domains: int) -> DatasetPool:
        """The same samples with new domain labels."""
        return replace(self, domain=domain, num_domains=num_domains)


DatasetBuilder = Callable[["DataConfig"], DatasetPool]

_BUILDERS: dict[str, DatasetBuilder] = {}
_NOISE_FREE: set[str] = set()  # datasets whose pools carry noise_free_y


def register_dataset(
    name: str,
    builder: DatasetBuilder,
    *,
    replace: bool = False,
    noise_free_targets: bool = False,
) -> None:
    """Make ``name`` a valid ``dataset`` value whose pool ``builder(config)`` returns.

    ``noise_free_targets`` declares that the pools carry ``noise_free_y`` (known before any pool
    is built, so a config asking for them is checked when it is made).

    Raises:
        ValueError: ``name`` is already registered and ``replace`` is false.
    """
    if name in _BUILDERS and not replace:
        raise ValueError(
            f"dataset {name!r} is already registered; pass replace=True to override it"
        )
    _BUILDERS[name] = builder
    _NOISE_FREE.discard(name)
    if noise_free_targets:
        _NOISE_FREE.add(name)


def dataset_builder(name: str) -> DatasetBuilder:
    """The builder registered under ``name`` (KeyError if none)."""
    return _BUILDERS[name]


def available_datasets() -> tuple[str, ...]:
    """Registered dataset names, in registration order."""
    return tuple(_BUILDERS)


def noise_free_datasets() -> tuple[str, ...]:
    """Registered datasets whose pools give noise-free targets, in registration order."""
    return tuple(name for name in _BUILDERS if name in _NOISE_FREE)


def _build_vision(config: DataConfig) -> DatasetPool:
    # Imported on use so that validating a config does not import torchvision's datasets.
    from flwr_pfl.data.vision import build_vision_pool

    return build_vision_pool(config)


VISION_DATASETS = ("mnist", "fashion-mnist", "cifar10", "cifar100")
for _name in VISION_DATASETS:
    register_dataset(_name, _build_vision)
