"""From a :class:`DataConfig` to one client's data: the pipeline every client app calls.

pool (registry) -> optional stratified subsample (``max-samples``) -> optional domain transform
(``domain-transform``: domain labels assigned here, pixels transformed per client; with
``large-client`` one domain takes what the others do not) -> partition (``partitioner``) -> the
client's seeded train/val/test split -> :class:`ClientData`. With
``noise-free-test`` the test split takes the pool's noise-free targets instead of its noisy ones.

Every stage is seeded from ``config.seed`` and cached per process (``functools.lru_cache`` on the
hashable config), because Flower's simulation rebuilds every client each round in the same worker
process, and every worker must compute the same split. Only the dataset load and the
partitioning are costly; a client's tensors are assembled from cached indices in milliseconds.

Domain transforms are applied to the client's own samples when its data is assembled rather than
to the whole pool: the pool stays uint8 (a quarter of the memory) and each worker transforms only
the clients it serves. The gaussian-noise corruption draws from a generator seeded by the config
seed and the client id.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from flwr_pfl.data.config import DataConfig
from flwr_pfl.data.domains import DomainTransform, assign_domains, make_domain_transform
from flwr_pfl.data.partitioners import make_partitioner, partition_indices
from flwr_pfl.data.registry import DatasetPool, dataset_builder
from flwr_pfl.data.sampling import stage_rng, stage_seed, stratified_subsample
from flwr_pfl.data.splits import SplitIndices, split_indices
from flwr_pfl.data.types import ArraySplit, ClientData, no_training_samples
from flwr_pfl.errors import ConfigError

LABEL_PARTITIONERS = ("dirichlet", "pathological", "domain-dirichlet")


@dataclass(frozen=True, eq=False)
class PreparedPool:
    """The pool after subsampling and domain assignment, and the transform still to apply."""

    pool: DatasetPool
    labels: np.ndarray  # class labels, or zeros for regression (for stratification)
    transform: DomainTransform | None

    @property
    def num_domains(self) -> int:
        """Domains of the clients' data: the transform's, else the dataset's own."""
        return self.transform.num_domains if self.transform is not None else self.pool.num_domains


@dataclass(frozen=True)
class PartitionSummary:
    """Sizes and composition of one client's data (for logs and results files)."""

    partition_id: int
    num_train: int
    num_val: int
    num_test: int
    label_counts: tuple[int, ...]  # over all three splits; empty for regression
    domain_counts: tuple[int, ...]

    @property
    def num_samples(self) -> int:
        """Samples over the three splits."""
        return self.num_train + self.num_val + self.num_test

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (lists instead of tuples, plus num_samples)."""
        out = asdict(self)
        out.update(
            num_samples=self.num_samples,
            label_counts=list(self.label_counts),
            domain_counts=list(self.domain_counts),
        )
        return out


@functools.lru_cache(maxsize=4)
def prepare_pool(config: DataConfig) -> PreparedPool:
    """The dataset's pool, subsampled and split into domains as the config says (cached)."""
    pool = dataset_builder(config.dataset)(config)
    classification = pool.task == "classification"
    labels = pool.y.numpy() if classification else np.zeros(len(pool), dtype=np.int64)
    if config.max_samples:
        keep = stratified_subsample(labels, config.max_samples, stage_rng(config.seed, "subsample"))
        pool, labels = pool.select(torch.from_numpy(keep)), labels[keep]
    transform = make_domain_transform(
        config.domain_transform,
        config.num_domains,
        rotation_step=config.rotation_step,
        clean_domain=config.clean_domain,
        noise_std=config.noise_std,
        noise_clip=config.noise_clip,
    )
    if transform is not None:
        if pool.num_domains != 1:
            raise ConfigError(
                f"data config key 'domain-transform' must be 'none' for dataset "
                f"{config.dataset!r}, which already has {pool.num_domains} domains; got "
                f"{config.domain_transform!r}"
            )
        if pool.x.dim() != 4:
            raise ConfigError(
                f"data config key 'domain-transform' must be 'none' for dataset "
                f"{config.dataset!r}: its inputs of shape {tuple(pool.x.shape[1:])} are not "
                f"images; got {config.domain_transform!r}"
            )
        shares = _domain_shares(config, len(pool), transform.num_domains)
        domain = assign_domains(labels, transform.num_domains, config.seed, shares)
        pool = pool.with_domains(torch.from_numpy(domain), transform.num_domains)
    return PreparedPool(pool, labels, transform)


@functools.lru_cache(maxsize=16)
def client_splits(config: DataConfig, num_partitions: int) -> tuple[SplitIndices, ...]:
    """Every client's train/val/test indices into the prepared pool (cached, seeded)."""
    _check_num_partitions(num_partitions)
    prepared = prepare_pool(config)
    if config.partitioner in LABEL_PARTITIONERS and prepared.pool.task != "classification":
        raise ConfigError(
            f"data config key 'partitioner' must not be {config.partitioner!r} for the "
            f"regression dataset {config.dataset!r} (it needs class labels); use 'iid', "
            f"'domain-mixture' or 'one-domain-per-client'"
        )
    config.domain_client_counts(num_domains=prepared.num_domains, num_clients=num_partitions)
    partitioner = make_partitioner(config, num_partitions, len(prepared.pool))
    parts = partition_indices(
        partitioner, prepared.labels, prepared.pool.domain.numpy(), config.seed
    )
    large = config.large_client
    if large >= 0 and num_partitions != prepared.num_domains:
        raise ConfigError(
            f"data config key 'large-client' = {large} needs one client per domain: "
            f"{prepared.num_domains} clients for the {prepared.num_domains} domains; got "
            f"{num_partitions} clients"
        )
    if config.samples_per_client and config.partitioner != "domain-mixture":
        cap = config.samples_per_client  # parts are in random order
        parts = [p if k == large else p[:cap] for k, p in enumerate(parts)]
    return tuple(
        split_indices(
            p,
            config.val_fraction,
            config.test_fraction,
            stage_rng(config.seed, "split", k),
            test_size_of=config.samples_per_client if k == large else None,
            train_fraction=config.train_fraction,
        )
        for k, p in enumerate(parts)
    )


@functools.lru_cache(maxsize=32)
def load_client_data(config: DataConfig, partition_id: int, num_partitions: int) -> ClientData:
    """Client ``partition_id``'s train/val/test data out of ``num_partitions`` clients.

    Cached per process; the returned tensors are shared between calls, so treat them as
    read-only.

    Raises:
        ConfigError: bad partition id or count, or settings the data cannot satisfy.
        DataNotFoundError: the dataset is not on disk and could not be downloaded.
    """
    _check_num_partitions(num_partitions)
    if not _is_int(partition_id) or not 0 <= partition_id < num_partitions:
        raise ConfigError(
            f"partition_id must be an integer in [0, {num_partitions}); got {partition_id!r}"
        )
    prepared = prepare_pool(config)
    split = client_splits(config, num_partitions)[partition_id]
    if len(split.train) == 0:
        raise no_training_samples(
            f"partition {partition_id} of {num_partitions}",
            f" ({len(split)} samples in all, none left for training with partitioner="
            f"{config.partitioner!r}, val-fraction={config.val_fraction}, "
            f"test-fraction={config.test_fraction})",
        )
    targets = _targets(prepared.pool, split, config)
    data = _assemble(prepared, split.concatenated(), targets, config.seed, partition_id)
    n_train, n_val = len(split.train), len(split.val)
    parts = np.split(np.arange(len(split)), [n_train, n_train + n_val])
    train, val, test = (data.subset(torch.from_numpy(p)) for p in parts)
    return ClientData(
        train=train,
        val=val,
        test=test,
        num_classes=prepared.pool.num_classes,
        num_domains=prepared.num_domains,
        input_shape=tuple(data.x.shape[1:]),
        task=prepared.pool.task,
    )


def describe_partition(config: DataConfig, num_partitions: int) -> list[PartitionSummary]:
    """Per-client split sizes and sample counts by label and by domain.

    Computed from the cached indices; no client tensors are assembled.
    """
    prepared = prepare_pool(config)
    pool = prepared.pool
    summaries = []
    for k, split in enumerate(client_splits(config, num_partitions)):
        index = torch.from_numpy(split.concatenated())
        labels = (
            tuple(torch.bincount(pool.y[index], minlength=pool.num_classes).tolist())
            if pool.task == "classification"
            else ()
        )
        domains = torch.bincount(pool.domain[index], minlength=prepared.num_domains)
        sizes = (len(split.train), len(split.val), len(split.test))
        summaries.append(PartitionSummary(k, *sizes, labels, tuple(domains.tolist())))
    return summaries


def clear_caches() -> None:
    """Forget every cached pool, partition and client (e.g. after files changed on disk)."""
    from flwr_pfl.data.vision import load_vision_pool

    for cached in (prepare_pool, client_splits, load_client_data, load_vision_pool):
        cached.cache_clear()


def _domain_shares(config: DataConfig, pool_size: int, num_domains: int) -> tuple[int, ...] | None:
    """How many samples (or relative shares) each domain of the transform gets: as many as
    the domain's clients (``domain-clients``), or, with ``large-client``, exactly
    ``samples-per-client`` for every domain but the large client's, which takes the rest of
    the pool; None for equal domains."""
    if config.large_client < 0:
        return config.domain_client_counts()  # domains as large as their client counts
    regular = config.samples_per_client
    rest = pool_size - (num_domains - 1) * regular
    if rest <= regular:
        raise ConfigError(
            f"data config key 'large-client' = {config.large_client} needs a pool larger than "
            f"num-domains x samples-per-client = {num_domains} x {regular} = "
            f"{num_domains * regular}, so that the large client gets more than the others; the "
            f"pool has {pool_size} samples (max-samples = {config.max_samples}, 0 = all)"
        )
    shares = [regular] * num_domains
    shares[config.large_client] = rest
    return tuple(shares)


def _check_num_partitions(num_partitions: int) -> None:
    if not _is_int(num_partitions) or num_partitions < 1:
        raise ConfigError(f"num_partitions must be an integer >= 1; got {num_partitions!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _targets(pool: DatasetPool, split: SplitIndices, config: DataConfig) -> torch.Tensor:
    """The targets of ``split``'s samples, train, val and test one after the other: the pool's
    targets, except for the test samples' noise-free ones when ``noise-free-test`` is on."""
    if not config.noise_free_test:
        return pool.y[torch.from_numpy(split.concatenated())]
    if pool.noise_free_y is None:  # DataConfig checked the dataset; its builder broke the promise
        raise ValueError(
            f"dataset {config.dataset!r} is registered with noise-free targets but its pool has "
            f"none (DatasetPool.noise_free_y is None)"
        )
    seen = torch.from_numpy(np.concatenate([split.train, split.val]))
    return torch.cat([pool.y[seen], pool.noise_free_y[torch.from_numpy(split.test)]])


def _assemble(
    prepared: PreparedPool, index: np.ndarray, targets: torch.Tensor, seed: int, client: int
) -> ArraySplit:
    """The samples at ``index`` as model-ready tensors: float, domain-transformed, standardised,
    with their ``targets`` (aligned with ``index``)."""
    pool = prepared.pool
    t = torch.from_numpy(index)
    x, domain = pool.inputs(t), pool.domain[t]
    if prepared.transform is not None:
        generator = torch.Generator().manual_seed(stage_seed(seed, "domain-noise", client))
        x = prepared.transform(x, domain, generator)
    if pool.mean is not None and pool.std is not None:
        shape = (1, -1) + (1,) * (x.dim() - 2)  # per channel (dim 1); one value broadcasts
        mean = torch.tensor(pool.mean, dtype=x.dtype).view(shape)
        std = torch.tensor(pool.std, dtype=x.dtype).view(shape)
        x = (x - mean) / std
    return ArraySplit(x, targets, domain)
