"""Partitioners: sizes and skews as asked, no sample in two clients, coverage, seeding."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_pfl.data.config import DataConfig
from flwr_pfl.data.partitioners import (
    DomainMixturePartitioner,
    LabelShiftPartitioner,
    OneDomainPerClientPartitioner,
    make_partitioner,
    partition_indices,
)
from flwr_pfl.errors import ConfigError

RNG = np.random.default_rng(0)
LABELS = RNG.permutation(np.arange(3000) % 10)
DOMAINS = RNG.permutation(np.repeat(np.arange(4), [1200, 900, 600, 300]))


def split(num_partitions: int, **changes) -> list[np.ndarray]:
    config = DataConfig(dataset="toy-images", **changes)
    partitioner = make_partitioner(config, num_partitions, len(LABELS))
    return partition_indices(partitioner, LABELS, DOMAINS, config.seed)


def assert_disjoint(parts: list[np.ndarray], cover: bool) -> None:
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined), "a sample is in two clients"
    if cover:
        assert len(joined) == len(LABELS)


def test_iid_equal_sizes_random_samples() -> None:
    parts = split(7)
    assert_disjoint(parts, cover=True)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert not (np.sort(parts[0]) == np.arange(len(parts[0]))).all()  # not a contiguous block
    for p in parts:  # every client sees (nearly) every label
        assert len(np.unique(LABELS[p])) == 10


def label_entropy(parts: list[np.ndarray]) -> float:
    entropies = []
    for p in parts:
        q = np.bincount(LABELS[p], minlength=10) / len(p)
        entropies.append(-(q[q > 0] * np.log(q[q > 0])).sum())
    return float(np.mean(entropies))


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    skewed, even = split(10, partitioner="dirichlet", dirichlet_alpha=0.1), split(
        10, partitioner="dirichlet", dirichlet_alpha=100.0
    )
    for parts in (skewed, even):
        assert_disjoint(parts, cover=True)
        assert min(len(p) for p in parts) >= 10
    # config seeds 0-7: skewed 0.84..0.99, even 2.30 (log(10) = 2.30); smallest skewed client 31..210
    assert label_entropy(skewed) < 1.2 < 2.2 < label_entropy(even)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pathological_clients_hold_exactly_k_labels(k: int) -> None:
    parts = split(20, partitioner="pathological", classes_per_client=k)
    assert_disjoint(parts, cover=True)  # 20 clients >= 10 classes: every class is used
    assert all(len(np.unique(LABELS[p])) == k for p in parts)


def test_pathological_impossible_setting_names_the_partitioner() -> None:
    with pytest.raises(ConfigError, match="PathologicalPartitioner"):
        split(5, partitioner="pathological", classes_per_client=11)


def test_domain_mixture_sizes_exact_and_proportions_follow_the_draws() -> None:
    config = DataConfig(
        dataset="toy-images", partitioner="domain-mixture", samples_per_client=200, domain_alpha=0.5
    )
    partitioner = make_partitioner(config, 10, len(LABELS))
    parts = partition_indices(partitioner, LABELS, DOMAINS, config.seed)
    assert isinstance(partitioner, DomainMixturePartitioner)
    assert_disjoint(parts, cover=False)
    assert all(len(p) == 200 for p in parts)
    pi = partitioner.proportions
    assert pi is not None and pi.shape == (10, 4) and np.allclose(pi.sum(1), 1)
    for k, p in enumerate(parts):
        counts = np.bincount(DOMAINS[p], minlength=4)
        assert (counts == partitioner.counts[k]).all()
        assert np.abs(counts / 200 - pi[k]).max() <= 1 / 200 + 1e-12
    # the draws are far from uniform with alpha = 0.5 (the pooled prior is 0.4/0.3/0.2/0.1)
    # config seeds 0-3 and 7: 0.790..0.896 (seeds 4-6 draw mixtures this pool cannot serve and stop
    # with a ConfigError, as designed)
    assert pi.max(axis=1).mean() > 0.5


def test_domain_mixture_draws_centre_on_the_pooled_distribution() -> None:
    import datasets

    partitioner = DomainMixturePartitioner(300, samples_per_partition=5, alpha=4.0, seed=1)
    partitioner.dataset = datasets.Dataset.from_dict({"domain": DOMAINS})
    partitioner.partition_indices()
    assert partitioner.proportions is not None
    np.testing.assert_allclose(partitioner.proportions.mean(0), [0.4, 0.3, 0.2, 0.1], atol=0.04)


def test_domain_mixture_running_out_names_the_numbers() -> None:
    with pytest.raises(ConfigError) as info:
        split(10, partitioner="domain-mixture", samples_per_client=290, domain_alpha=0.2)
    message = str(info.value)
    assert "domain" in message and "samples-per-client=290" in message
    assert any(f"has {n} samples" in message for n in (1200, 900, 600, 300))
    assert "ask for" in message


def test_domain_mixture_is_a_flower_partitioner() -> None:
    import datasets

    partitioner = DomainMixturePartitioner(4, samples_per_partition=50, alpha=1.0)
    partitioner.dataset = datasets.Dataset.from_dict({"x": np.arange(3000), "domain": DOMAINS})
    part = partitioner.load_partition(2)
    assert part.num_rows == 50 and partitioner.num_partitions == 4


def test_one_domain_per_client() -> None:
    parts = split(10, partitioner="one-domain-per-client")
    assert_disjoint(parts, cover=True)
    for k, p in enumerate(parts):
        assert set(DOMAINS[p].tolist()) == {k % 4}
    for m, size in enumerate([1200, 900, 600, 300]):
        sizes = [len(p) for k, p in enumerate(parts) if k % 4 == m]
        assert sum(sizes) == size and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("partitioner", ["one-domain-per-client", "domain-dirichlet"])
def test_domain_clients_give_each_domain_its_run_of_clients(partitioner: str) -> None:
    counts = [3, 2, 1, 4]  # DOMAINS has 1200, 900, 600, 300 samples
    parts = split(10, partitioner=partitioner, domain_clients="3,2,1,4", dirichlet_alpha=50.0)
    assert_disjoint(parts, cover=True)
    owner = np.repeat(np.arange(4), counts)  # clients 0-2: domain 0, 3-4: 1, 5: 2, 6-9: 3
    for k, p in enumerate(parts):
        assert set(DOMAINS[p].tolist()) == {owner[k]}
    for m, size in enumerate([1200, 900, 600, 300]):
        sizes = [len(p) for k, p in enumerate(parts) if owner[k] == m]
        assert sum(sizes) == size and len(sizes) == counts[m]
        if partitioner == "one-domain-per-client":
            assert max(sizes) - min(sizes) <= 1


def test_domain_clients_must_fit_the_clients_and_the_domains() -> None:
    with pytest.raises(ConfigError, match=r"'domain-clients'.*summing to the number of clients, 9"):
        split(9, partitioner="one-domain-per-client", domain_clients="3,2,1,4")
    with pytest.raises(ConfigError, match=r"3 counts \[4, 4, 2\] but the data holds 4 domains"):
        split(10, partitioner="one-domain-per-client", domain_clients="4,4,2")
    with pytest.raises(ValueError, match="summing to num_partitions=5"):
        OneDomainPerClientPartitioner(5, domain_clients=(2, 2))


def test_domain_dirichlet_keeps_one_domain_per_client_and_skews_labels() -> None:
    skewed = split(12, partitioner="domain-dirichlet", dirichlet_alpha=0.1)
    even = split(12, partitioner="domain-dirichlet", dirichlet_alpha=100.0)
    iid = split(12, partitioner="one-domain-per-client")
    for parts in (skewed, even):
        assert_disjoint(parts, cover=True)
        for k, p in enumerate(parts):
            assert set(DOMAINS[p].tolist()) == {k % 4}
        for m, size in enumerate([1200, 900, 600, 300]):  # each domain dealt whole to its clients
            assert sum(len(p) for k, p in enumerate(parts) if k % 4 == m) == size
    assert label_entropy(skewed) < 1.5 < 2.2 < label_entropy(even)
    assert abs(label_entropy(even) - label_entropy(iid)) < 0.05


def test_domain_dirichlet_is_a_label_partitioner() -> None:
    with pytest.raises(ValueError, match="label_alpha"):
        OneDomainPerClientPartitioner(4, label_alpha=0.0)


def test_one_domain_per_client_warns_about_unused_domains() -> None:
    with pytest.warns(UserWarning, match=r"domains \[2, 3\] get no client"):
        parts = partition_indices(OneDomainPerClientPartitioner(2), LABELS, DOMAINS, seed=0)
    assert set(DOMAINS[np.concatenate(parts)].tolist()) == {0, 1}


@pytest.mark.parametrize("eta", [0.0, 0.1, 0.3, 0.5])
def test_label_shift_gives_the_target_its_eta_shares(eta: float) -> None:
    """App. C.7: the target (last client) holds 1 - eta of each shifted class (8, 6, 9) and
    eta of the others; the 4 sources split the rest equally; every sample is dealt once."""
    parts = split(5, partitioner="label-shift", label_shift_eta=eta)
    assert_disjoint(parts, cover=True)
    target = LABELS[parts[-1]]
    for c in range(10):
        share = np.sum(target == c) / np.sum(LABELS == c)
        assert share == pytest.approx((1 - eta) if c in (6, 8, 9) else eta, abs=0.002)
        counts = [np.sum(LABELS[p] == c) for p in parts[:-1]]
        assert max(counts) - min(counts) <= 1
    if eta == 0.0:
        assert set(target.tolist()) == {6, 8, 9}


def test_label_shift_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="at least 2 partitions"):
        LabelShiftPartitioner(1, eta=0.1)
    with pytest.raises(ValueError, match=r"eta must lie in \[0, 0.5\]"):
        LabelShiftPartitioner(4, eta=0.7)
    with pytest.raises(ConfigError, match="label-shift-eta"):
        DataConfig(dataset="toy-images", label_shift_eta=0.6)
    with pytest.raises(ConfigError, match="shifted-classes"):
        DataConfig(dataset="toy-images", shifted_classes="eight")
    assert DataConfig(dataset="toy-images", shifted_classes="1, 2").shifted_class_ids() == (1, 2)


@pytest.mark.filterwarnings("ignore:Classes.*will NOT be used")  # 6 clients, 10 classes
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"partitioner": "dirichlet"},
        {"partitioner": "pathological"},
        {"partitioner": "domain-mixture", "samples_per_client": 50},
        {"partitioner": "one-domain-per-client"},
        {"partitioner": "domain-dirichlet"},
        {"partitioner": "label-shift"},
    ],
)
def test_seeded(changes: dict) -> None:
    a, b = split(6, seed=1, **changes), split(6, seed=1, **changes)
    c = split(6, seed=2, **changes)
    assert all((x == y).all() for x, y in zip(a, b))
    assert any(len(x) != len(y) or (x != y).any() for x, y in zip(a, c))
