"""Partitioners: which samples each client gets, as indices into the pool.

Label-based schemes come from Flower Datasets (``IidPartitioner``, ``DirichletPartitioner``,
``PathologicalPartitioner``); the two domain-based schemes are written here as subclasses of
its ``Partitioner``, so Flower users can use them in a ``FederatedDataset`` too:

* :class:`DomainMixturePartitioner`: client k draws domain proportions pi_k ~ Dir(alpha * p),
  p the pooled domain distribution (FedDAR's controlled mixtures), and exactly
  ``samples_per_partition`` samples without replacement across clients.
* :class:`OneDomainPerClientPartitioner`: client k holds domain k mod M (Rotated MNIST in FEDORA,
  one corruption per client in pFedFDA), or each domain gets a given number of consecutive
  clients (FedGP's nine clean sources and one noisy target); the clients of a domain split it
  IID, or with Dirichlet label skew (``domain-dirichlet``).
* :class:`LabelShiftPartitioner`: FedGP's Fashion-MNIST label shift (App. C.7): the last client
  (the target) gets a fraction 1 - eta of a few "shifted" classes and eta of the others; the
  other clients (the sources) split the rest equally.

:func:`partition_indices` runs any of them on arrays (an in-memory ``datasets.Dataset`` with
columns idx, label and domain) and reads back the idx column. Nothing is fetched from the
Hugging Face Hub; importing this module sets ``HF_DATASETS_OFFLINE=1`` unless the variable is
already set, so that machines without internet never wait on the Hub.
"""

from __future__ import annotations

import os
import warnings
from abc import abstractmethod
from collections.abc import Sequence

import numpy as np

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before the first import of `datasets`

try:
    import datasets
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        Partitioner,
        PathologicalPartitioner,
    )
except ModuleNotFoundError as err:  # a node that trains on its own files never gets here
    from flwr_pfl.errors import missing_extra

    raise missing_extra(err.name or "flwr-datasets", "datasets",
                        "partitioning a dataset among simulated clients (Flower Datasets' partitioners)") from err

from flwr_pfl.data.config import DataConfig  # noqa: E402
from flwr_pfl.data.sampling import apportion, stage_rng, stage_seed  # noqa: E402
from flwr_pfl.errors import ConfigError  # noqa: E402


def _column(dataset: datasets.Dataset, name: str) -> np.ndarray:
    """A column as a numpy array, through Arrow (much faster than Python lists)."""
    return dataset.with_format("arrow")[name].to_numpy()


class IndexPartitioner(Partitioner):
    """A partitioner that computes every partition's row indices at once, on first use."""

    def __init__(self, num_partitions: int, partition_by: str, seed: int) -> None:
        super().__init__()
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1; got {num_partitions}")
        self._num_partitions = num_partitions
        self._partition_by = partition_by
        self._seed = seed
        self._indices: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        """Total number of partitions."""
        return self._num_partitions

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        """The rows of partition ``partition_id``."""
        return self.dataset.select(self.partition_indices()[partition_id])

    def partition_indices(self) -> list[np.ndarray]:
        """Row indices of every partition (computed once)."""
        if self._indices is None:
            self._indices = self._assign(_column(self.dataset, self._partition_by))
        return self._indices

    @abstractmethod
    def _assign(self, groups: np.ndarray) -> list[np.ndarray]:
        """Row indices per partition, given every row's domain."""


class DomainMixturePartitioner(IndexPartitioner):
    """Fixed-size clients whose domain proportions follow a Dirichlet distribution.

    Client k draws pi_k ~ Dir(alpha * p), where p is the share of each domain in the dataset,
    turns ``samples_per_partition * pi_k`` into whole counts that sum exactly to
    ``samples_per_partition`` (largest remainders), and takes that many samples of each domain
    without replacement, so no sample is in two clients. Small alpha gives clients dominated by
    one domain; large alpha gives every client close to the pooled mix.

    If the clients together ask for more samples of a domain than it has, partitioning stops with
    a :class:`~flwr_pfl.errors.ConfigError` that gives the domain, the number asked and the number
    available (nothing is redrawn or silently truncated, so sizes and proportions are always as
    documented).

    Attributes (after partitioning):
        proportions: the drawn pi, shape (num_partitions, number of domains present).
        counts: samples per client and domain, same shape; rows sum to samples_per_partition.
        domains: the domain values the columns refer to.
    """

    def __init__(
        self,
        num_partitions: int,
        samples_per_partition: int,
        alpha: float,
        partition_by: str = "domain",
        seed: int = 42,
    ) -> None:
        super().__init__(num_partitions, partition_by, seed)
        if samples_per_partition < 1 or alpha <= 0:
            raise ValueError(
                f"samples_per_partition must be >= 1 and alpha > 0; got {samples_per_partition} "
                f"and {alpha}"
            )
        self._size = samples_per_partition
        self._alpha = alpha
        self.proportions: np.ndarray | None = None
        self.counts: np.ndarray | None = None
        self.domains: np.ndarray | None = None

    def _assign(self, groups: np.ndarray) -> list[np.ndarray]:
        rng = np.random.default_rng(self._seed)
        domains, available = np.unique(groups, return_counts=True)
        prior = available / available.sum()
        proportions = rng.dirichlet(self._alpha * prior, size=self._num_partitions)
        counts = np.stack([apportion(self._size, row) for row in proportions])
        wanted = counts.sum(axis=0)
        short = np.flatnonzero(wanted > available)
        if short.size:
            m = short[0]
            raise ConfigError(
                f"domain-mixture partitioner: domain {domains[m]} has {available[m]} samples but "
                f"the {self._num_partitions} clients' Dirichlet draws ask for {wanted[m]} of them "
                f"(samples-per-client={self._size}, domain-alpha={self._alpha}; samples are drawn "
                f"without replacement). Lower samples-per-client or the number of clients, raise "
                f"domain-alpha for more even mixtures, or use more data (max-samples)."
            )
        starts = np.vstack([np.zeros(len(domains), dtype=np.int64), np.cumsum(counts, axis=0)])
        pools = [rng.permutation(np.flatnonzero(groups == d)) for d in domains]
        parts = [
            rng.permutation(
                np.concatenate([p[starts[k, m] : starts[k + 1, m]] for m, p in enumerate(pools)])
            )
            for k in range(self._num_partitions)
        ]
        self.proportions, self.counts, self.domains = proportions, counts, domains
        return parts


class OneDomainPerClientPartitioner(IndexPartitioner):
    """Client k holds only the (k mod M)-th domain; the clients sharing a domain split it.

    With ``domain_clients`` (one count per domain, summing to ``num_partitions``) the domains
    get consecutive clients instead: (9, 1) gives the first domain clients 0-8 and the second
    client 9.

    By default they split it IID. With ``label_alpha``, they split it with label skew: for each
    class of the domain, the class's samples are dealt to the domain's clients in proportions
    drawn from Dir(label_alpha), as Flower's Dirichlet partitioner does for a whole dataset
    (pFedFDA's setting: covariate shift per client plus Dirichlet label skew).

    With fewer clients than domains, the domains without a client are left out (with a
    warning).
    """

    def __init__(
        self,
        num_partitions: int,
        partition_by: str = "domain",
        seed: int = 42,
        label_alpha: float | None = None,
        label_column: str = "label",
        domain_clients: Sequence[int] | None = None,
    ) -> None:
        super().__init__(num_partitions, partition_by, seed)
        if label_alpha is not None and not label_alpha > 0:
            raise ValueError(f"label_alpha must be > 0 (or None for IID); got {label_alpha}")
        if domain_clients is not None and (
            min(domain_clients, default=0) < 1 or sum(domain_clients) != num_partitions
        ):
            raise ValueError(
                f"domain_clients must be counts >= 1 summing to num_partitions={num_partitions}; "
                f"got {list(domain_clients)}"
            )
        self._label_alpha = label_alpha
        self._label_column = label_column
        self._domain_clients = None if domain_clients is None else tuple(domain_clients)

    def partition_indices(self) -> list[np.ndarray]:
        """Row indices of every partition (computed once)."""
        if self._indices is None:
            labels = _column(self.dataset, self._label_column) if self._label_alpha else None
            self._indices = self._split(_column(self.dataset, self._partition_by), labels)
        return self._indices

    def _assign(self, groups: np.ndarray) -> list[np.ndarray]:
        return self._split(groups, None)

    def _split(self, groups: np.ndarray, labels: np.ndarray | None) -> list[np.ndarray]:
        rng = np.random.default_rng(self._seed)
        domains = np.unique(groups)
        clients_of = self._clients_of_domains(len(domains))
        if self._num_partitions < len(domains):
            warnings.warn(
                f"one-domain-per-client: {self._num_partitions} clients for {len(domains)} "
                f"domains; domains {domains[self._num_partitions:].tolist()} get no client",
                stacklevel=2,
            )
        parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * self._num_partitions
        for d, clients in zip(domains, clients_of):
            if not clients:
                continue
            rows = rng.permutation(np.flatnonzero(groups == d))
            if labels is None:
                chunks = np.array_split(rows, len(clients))
            else:
                chunks = self._label_skewed(rows, labels[rows], len(clients), rng)
            for k, chunk in zip(clients, chunks):
                parts[k] = chunk
        return parts

    def _clients_of_domains(self, num_domains: int) -> list[list[int]]:
        """The clients of each domain present: k mod M, or consecutive runs of the given counts."""
        if self._domain_clients is None:
            return [list(range(m, self._num_partitions, num_domains)) for m in range(num_domains)]
        if len(self._domain_clients) != num_domains:
            raise ValueError(
                f"domain_clients has {len(self._domain_clients)} counts "
                f"{list(self._domain_clients)} but the data holds {num_domains} domains"
            )
        ends = np.cumsum(self._domain_clients).tolist()
        return [list(range(end - n, end)) for n, end in zip(self._domain_clients, ends)]

    def _label_skewed(
        self, rows: np.ndarray, labels: np.ndarray, num_clients: int, rng: np.random.Generator
    ) -> list[np.ndarray]:
        """Deal each class of ``rows`` to ``num_clients`` clients in Dir(label_alpha) shares."""
        shares: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in np.unique(labels):
            members = rows[labels == c]
            counts = apportion(len(members), rng.dirichlet(np.full(num_clients, self._label_alpha)))
            for k, piece in enumerate(np.split(members, np.cumsum(counts)[:-1])):
                shares[k].append(piece)
        return [np.sort(np.concatenate(pieces)) for pieces in shares]


class LabelShiftPartitioner(IndexPartitioner):
    """A controlled label shift between N - 1 sources and one target (the last partition).

    Jiang et al. (ICLR 2024), App. C.7, "imbalance-class-eta": for every class in
    ``shifted_classes`` (D1) a fraction 1 - eta of its samples goes to the target and eta to
    the sources; for every other class (D2) eta goes to the target and 1 - eta to the sources.
    The sources split their share of each class equally. eta = 0.5 is no shift; at eta = 0 the
    target holds only D1 and the sources only D2.

    Args:
        num_partitions: N >= 2 (N - 1 sources and the target, partition N - 1).
        eta: the shift, in [0, 0.5].
        shifted_classes: D1 (the paper's code: classes 8, 6, 9 of Fashion-MNIST).
        partition_by: the label column.
        seed: the split of each class is a seeded permutation.
    """

    def __init__(
        self,
        num_partitions: int,
        eta: float,
        shifted_classes: tuple[int, ...] = (8, 6, 9),
        partition_by: str = "label",
        seed: int = 42,
    ) -> None:
        super().__init__(num_partitions, partition_by, seed)
        if num_partitions < 2:
            raise ValueError(f"label shift needs at least 2 partitions (sources and a target); got {num_partitions}")
        if not 0.0 <= eta <= 0.5:
            raise ValueError(f"eta must lie in [0, 0.5] (0.5 = no shift); got {eta}")
        self._eta = float(eta)
        self._shifted = frozenset(int(c) for c in shifted_classes)

    def _assign(self, groups: np.ndarray) -> list[np.ndarray]:
        rng = np.random.default_rng(self._seed)
        sources = self._num_partitions - 1
        parts: list[list[np.ndarray]] = [[] for _ in range(self._num_partitions)]
        for c in np.unique(groups):
            rows = rng.permutation(np.flatnonzero(groups == c))
            to_target = (1.0 - self._eta) if int(c) in self._shifted else self._eta
            n_target = int(round(to_target * len(rows)))
            parts[-1].append(rows[:n_target])
            for k, chunk in enumerate(np.array_split(rows[n_target:], sources)):
                parts[k].append(chunk)
        return [np.sort(np.concatenate(p)) for p in parts]


def make_partitioner(config: DataConfig, num_partitions: int, num_samples: int) -> Partitioner:
    """The partitioner the config names, seeded from the config's seed.

    Pathological assigns classes in Flower Datasets' "first-deterministic" mode: client k's first
    class is k mod C, so every class is used once there are at least C clients. Dirichlet asks
    for at least min(10, samples / clients) samples per client (redrawing up to 10 times).
    """
    seed = stage_seed(config.seed, f"partition:{config.partitioner}")
    if config.partitioner == "iid":
        return IidPartitioner(num_partitions)
    if config.partitioner == "dirichlet":
        return DirichletPartitioner(
            num_partitions,
            "label",
            config.dirichlet_alpha,
            min_partition_size=min(10, num_samples // num_partitions),
            seed=seed,
        )
    if config.partitioner == "pathological":
        return PathologicalPartitioner(
            num_partitions,
            "label",
            config.classes_per_client,
            class_assignment_mode="first-deterministic",
            seed=seed,
        )
    if config.partitioner == "domain-mixture":
        return DomainMixturePartitioner(
            num_partitions, config.samples_per_client, config.domain_alpha, seed=seed
        )
    if config.partitioner == "label-shift":
        return LabelShiftPartitioner(
            num_partitions, config.label_shift_eta, config.shifted_class_ids(), seed=seed
        )
    domain_clients = config.domain_client_counts(num_clients=num_partitions)
    if config.partitioner == "domain-dirichlet":
        return OneDomainPerClientPartitioner(
            num_partitions, seed=seed, label_alpha=config.dirichlet_alpha,
            domain_clients=domain_clients,
        )
    return OneDomainPerClientPartitioner(num_partitions, seed=seed, domain_clients=domain_clients)


def partition_indices(
    partitioner: Partitioner,
    labels: np.ndarray,
    domains: np.ndarray,
    seed: int,
) -> list[np.ndarray]:
    """Each partition's sample indices (into ``labels``/``domains``), via ``partitioner``.

    The rows are handed over in a seeded random order, so that schemes which cut contiguous
    blocks (Flower's IID shards, pathological splits of a class) cut random samples.
    """
    order = stage_rng(seed, "rows").permutation(len(labels))
    partitioner.dataset = datasets.Dataset.from_dict(
        {"idx": order, "label": labels[order], "domain": domains[order]}
    )
    try:
        return [
            _column(partitioner.load_partition(k), "idx").astype(np.int64)
            for k in range(partitioner.num_partitions)
        ]
    except ConfigError:
        raise
    except ValueError as err:  # Flower Datasets' messages on impossible settings
        raise ConfigError(
            f"partitioner {type(partitioner).__name__} cannot split these {len(labels)} "
            f"samples: {err}"
        ) from err
