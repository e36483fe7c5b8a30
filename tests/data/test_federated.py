"""The pipeline: config -> one client's ClientData, its caching, and describe_partition."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flwr_pfl.data import ClientData, DataConfig, describe_partition, load_client_data
from flwr_pfl.data.federated import client_splits, prepare_pool
from flwr_pfl.data.registry import DatasetPool, dataset_builder, register_dataset
from flwr_pfl.errors import ConfigError

from .conftest import NOISY_STD, NOISY_WEIGHTS

BASE = {"dataset": "toy-images", "val_fraction": 0.1, "test_fraction": 0.2}


def config(**changes) -> DataConfig:
    return DataConfig(**{**BASE, **changes})


def test_client_data_shapes_sizes_and_cache() -> None:
    data = load_client_data(config(), 3, 8)
    assert isinstance(data, ClientData)
    # 125 samples: test round(25) = 25, val round(12.5) = 13, train the other 87
    assert (len(data.train), len(data.val), len(data.test)) == (87, 13, 25)
    assert data.input_shape == (1, 8, 8) and data.num_classes == 10 and data.num_domains == 1
    assert data.train.x.dtype == torch.float32 and data.train.y.dtype == torch.int64
    assert load_client_data(config(), 3, 8) is data  # cached: cheap on every round


def test_clients_are_disjoint_and_cover_the_pool() -> None:
    seen = [describe_partition(config(), 8), describe_partition(config(), 8)]
    assert [s.to_dict() for s in seen[0]] == [s.to_dict() for s in seen[1]]
    assert sum(s.num_samples for s in seen[0]) == 1000
    pool = prepare_pool(config()).pool
    keys = set()
    for k in range(8):
        data = load_client_data(config(), k, 8)
        for part in (data.train, data.val, data.test):
            keys.update(map(bytes, (part.x * 0.25 + 0.5).mul(255).round().to(torch.uint8).numpy()))
    assert len(keys) == len({bytes(row) for row in pool.x.numpy()})


def test_describe_matches_the_client_data() -> None:
    cfg = config(partitioner="dirichlet", dirichlet_alpha=0.3)
    for summary in describe_partition(cfg, 5):
        data = load_client_data(cfg, summary.partition_id, 5)
        y = torch.cat([data.train.y, data.val.y, data.test.y])
        assert list(summary.label_counts) == torch.bincount(y, minlength=10).tolist()
        assert (summary.num_train, summary.num_val, summary.num_test) == (
            len(data.train), len(data.val), len(data.test),
        )
        assert summary.to_dict()["num_samples"] == len(y)


def test_train_fraction_keeps_a_share_of_every_clients_training_split() -> None:
    """train-fraction = 0.25 (pFedFDA's 25 % column): each client trains on a quarter of its own
    training split; its validation and test samples are the ones it has at 1."""
    for k in range(8):
        full, scarce = load_client_data(config(), k, 8), load_client_data(config(train_fraction=0.25), k, 8)
        assert len(scarce.train) == int(np.floor(len(full.train) * 0.25 + 0.5))
        assert torch.equal(scarce.val.x, full.val.x) and torch.equal(scarce.test.x, full.test.x)
        rows = {bytes(r) for r in full.train.x.numpy()}
        assert all(bytes(r) in rows for r in scarce.train.x.numpy())


@pytest.mark.parametrize("bad", [-1, 4, 1.0, True])
def test_partition_id_is_checked(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"partition_id must be an integer in \[0, 4\)"):
        load_client_data(config(), bad, 4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_partitions"):
        load_client_data(config(), 0, 0)


def test_rotation_domains_through_the_pipeline() -> None:
    cfg = config(domain_transform="rotation", num_domains=4, rotation_step=90.0)
    data = load_client_data(cfg, 0, 2)
    assert data.num_domains == 4 and set(data.train.domain.tolist()) == {0, 1, 2, 3}
    pool = prepare_pool(cfg).pool
    base = (pool.x.float() / 255 - 0.5) / 0.25
    for x, d in zip(data.train.x[:20], data.train.domain[:20]):
        rotated_back = torch.rot90(x, -int(d), dims=(-2, -1))
        assert (rotated_back - base).abs().flatten(1).max(1).values.min() < 1e-5


def test_color_domains_give_three_channels() -> None:
    data = load_client_data(config(domain_transform="color", num_domains=3), 1, 4)
    assert data.input_shape == (3, 8, 8) and data.train.x.shape[1] == 3
    summaries = describe_partition(config(domain_transform="color", num_domains=3), 4)
    assert sum(sum(s.domain_counts) for s in summaries) == 1000


def test_domain_mixture_clients_have_the_exact_size() -> None:
    cfg = config(
        domain_transform="corruption", num_domains=3, partitioner="domain-mixture",
        samples_per_client=60, domain_alpha=0.5,
    )
    summaries = describe_partition(cfg, 6)
    assert all(s.num_samples == 60 for s in summaries)
    assert all(len(s.domain_counts) == 3 for s in summaries)


def test_subsample_and_cap() -> None:
    cfg = config(max_samples=300, samples_per_client=20)
    pool = prepare_pool(cfg).pool
    assert len(pool) == 300 and torch.bincount(pool.y).tolist() == [30] * 10
    assert all(s.num_samples == 20 for s in describe_partition(cfg, 5))


def test_seed_changes_the_clients() -> None:
    a = load_client_data(config(seed=1), 0, 4).train.y
    b = load_client_data(config(seed=2), 0, 4).train.y
    assert not torch.equal(a, b)


def test_regression_pools() -> None:
    data = load_client_data(config(dataset="toy-regression"), 0, 3)
    assert data.task == "regression" and data.input_shape == (5,) and data.num_outputs == 1
    with pytest.raises(ConfigError, match="'partitioner' must not be 'dirichlet'"):
        load_client_data(config(dataset="toy-regression", partitioner="dirichlet"), 0, 3)
    with pytest.raises(ConfigError, match="not images"):
        rotated = config(dataset="toy-regression", domain_transform="rotation", num_domains=2)
        load_client_data(rotated, 0, 3)
    assert describe_partition(config(dataset="toy-regression"), 3)[0].label_counts == ()


def test_no_training_samples_left() -> None:
    with pytest.raises(ConfigError, match="none left for training") as err:
        load_client_data(config(val_fraction=0.45, test_fraction=0.5), 0, 100)  # 10 each
    # the same words as the client base's check (tests/clients/test_empty_client.py)
    assert str(err.value).startswith("partition 0 of 100 has no training samples (10 samples in all")
    assert "another partitioner" in str(err.value) and "val-fraction" in str(err.value)


def test_partitions_per_domain_are_consistent_with_labels() -> None:
    cfg = config(domain_transform="rotation", num_domains=2, partitioner="one-domain-per-client")
    for summary in describe_partition(cfg, 4):
        assert summary.domain_counts[summary.partition_id % 2] == summary.num_samples
    assert np.isclose(sum(s.num_samples for s in describe_partition(cfg, 4)), 1000)


def noisy_target_config(**changes) -> DataConfig:
    """FedGP's noisy-feature layout on the toy pool: 9 clean sources, 1 noisy target (client 9)."""
    layout = {
        "domain_transform": "corruption", "clean_domain": True, "num_domains": 2,
        "partitioner": "one-domain-per-client", "domain_clients": "9,1", "noise_std": 0.6,
        "noise_clip": False,
    }
    return config(**{**layout, **changes})


def test_nine_clean_sources_and_one_noisy_target() -> None:
    cfg = noisy_target_config()
    summaries = describe_partition(cfg, 10)
    assert [s.domain_counts for s in summaries] == [(100, 0)] * 9 + [(0, 100)]
    assert prepare_pool(cfg).pool.domain.bincount().tolist() == [900, 100]
    # the target's train AND test images carry the unclipped noise; the sources' are clean
    pool, splits = prepare_pool(cfg).pool, client_splits(cfg, 10)
    for k in (0, 4, 9):
        data = load_client_data(cfg, k, 10)
        for part, index in ((data.train, splits[k].train), (data.test, splits[k].test)):
            pixels = part.x * 0.25 + 0.5  # undo the toy pool's standardisation
            noise = pixels - pool.inputs(torch.from_numpy(index))
            if k < 9:
                assert noise.abs().max() < 1e-6
            else:
                assert abs(noise.std().item() - 0.6) < 0.03
                assert pixels.min() < -0.5 and pixels.max() > 1.5


def test_domain_shares_follow_the_client_counts() -> None:
    """Unequal counts: each client gets about 1000 / 10 samples (the paper's i.i.d. tenths)."""
    cfg = noisy_target_config(domain_clients="7,3", max_samples=997)
    sizes = [s.num_samples for s in describe_partition(cfg, 10)]
    assert sum(sizes) == 997 and max(sizes) - min(sizes) <= 2
    assert [sum(s.domain_counts) for s in describe_partition(cfg, 10)] == sizes


def test_domain_clients_of_one_each_is_the_default_layout() -> None:
    plain = config(domain_transform="corruption", num_domains=2, partitioner="one-domain-per-client")
    ones = config(
        domain_transform="corruption", num_domains=2, partitioner="one-domain-per-client",
        domain_clients="1,1",
    )
    for k in (0, 1):
        a, b = load_client_data(plain, k, 2), load_client_data(ones, k, 2)
        assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)


def test_domain_clients_are_checked_against_the_federation() -> None:
    with pytest.raises(ConfigError, match=r"'domain-clients'.*number of clients, 8 \(they sum to 10\)"):
        load_client_data(noisy_target_config(), 0, 8)
    # no transform: the dataset's own domains (one here) fix the count
    own = config(partitioner="one-domain-per-client", domain_clients="2,2")
    with pytest.raises(ConfigError, match="one client count per domain: 1 counts"):
        describe_partition(own, 4)


def large_client_config(**changes) -> DataConfig:
    """FEDORA's imbalanced layout on the toy pool (1000 images): 5 rotation domains, one client
    each, 60 samples per client but client 2, which takes the rest."""
    layout = {
        "domain_transform": "rotation", "num_domains": 5, "rotation_step": 72.0,
        "partitioner": "one-domain-per-client", "samples_per_client": 60, "large_client": 2,
    }
    return config(**{**layout, **changes})


@pytest.mark.parametrize("max_samples, large_size", [(0, 1000 - 4 * 60), (700, 700 - 4 * 60)])
def test_the_large_client_takes_the_rest_of_the_pool(max_samples: int, large_size: int) -> None:
    cfg = large_client_config(max_samples=max_samples)
    summaries = describe_partition(cfg, 5)
    assert [s.num_samples for s in summaries] == [60, 60, large_size, 60, 60]
    for k, s in enumerate(summaries):  # client k holds exactly domain k
        assert s.domain_counts == tuple(s.num_samples if m == k else 0 for m in range(5))
    # the others: test round(60 x 0.2) = 12, val round(60 x 0.1) = 6, train 42; the large client:
    # the same test split, the rest cut 1 : 7 into val and train as the others' 6 : 42
    assert {(s.num_train, s.num_val, s.num_test) for k, s in enumerate(summaries) if k != 2} == {(42, 6, 12)}
    big = summaries[2]
    assert big.num_test == 12 and big.num_val == round((large_size - 12) / 8)
    assert big.num_train == large_size - 12 - big.num_val
    # disjoint clients, and every label in the large client in its pool share (stratified)
    splits = client_splits(cfg, 5)
    everything = np.concatenate([s.concatenated() for s in splits])
    assert len(np.unique(everything)) == len(everything) == sum(s.num_samples for s in summaries)
    assert max(big.label_counts) - min(big.label_counts) <= 2


def test_the_large_client_sees_its_own_rotation() -> None:
    cfg = large_client_config()
    pool, split = prepare_pool(cfg).pool, client_splits(cfg, 5)[2]
    data = load_client_data(cfg, 2, 5)
    assert len(data.train) == len(split.train) and set(data.train.domain.tolist()) == {2}
    raw = pool.inputs(torch.from_numpy(split.train[:3]))
    expected = (prepare_pool(cfg).transform(raw, torch.full((3,), 2), torch.Generator()) - 0.5) / 0.25
    assert torch.allclose(data.train.x[:3], expected)


def test_the_large_client_layout_is_checked_against_the_pool_and_federation() -> None:
    with pytest.raises(ConfigError, match=r"one client per domain: 5 clients for the 5 domains; got 6"):
        client_splits(large_client_config(), 6)
    with pytest.raises(ConfigError, match=r"pool larger than num-domains x samples-per-client = 5 x 60 = 300.*has 300"):
        prepare_pool(large_client_config(max_samples=300))


def noisy_regression_config(**changes) -> DataConfig:
    """toy-noisy-regression in 3 unequal clients (domain 0's samples shared by clients 0 and 2,
    domain 1's all client 1's) after a subsample, with validation and test splits."""
    layout = {
        "dataset": "toy-noisy-regression", "partitioner": "one-domain-per-client",
        "max_samples": 450, "val_fraction": 0.1, "test_fraction": 0.3, "seed": 3,
    }
    return config(**{**layout, **changes})


def test_noise_free_test_targets_only_for_the_test_split() -> None:
    on, off = noisy_regression_config(noise_free_test=True), noisy_regression_config()
    pool, splits = prepare_pool(on).pool, client_splits(on, 3)
    assert pool.noise_free_y is not None and len(pool) == 450  # the subsample keeps them aligned
    weights = torch.tensor(NOISY_WEIGHTS)
    sizes = []
    for k in range(3):
        a, b = load_client_data(on, k, 3), load_client_data(off, k, 3)
        sizes.append(len(a.train) + len(a.val) + len(a.test))
        for part_on, part_off in zip((a.train, a.val, a.test), (b.train, b.val, b.test)):
            assert torch.equal(part_on.x, part_off.x) and torch.equal(part_on.domain, part_off.domain)
        # training and validation targets: the noisy ones, whatever the key
        assert torch.equal(a.train.y, b.train.y) and torch.equal(a.val.y, b.val.y)
        assert torch.equal(a.train.y, pool.y[torch.from_numpy(splits[k].train)])
        assert torch.equal(a.val.y, pool.y[torch.from_numpy(splits[k].val)])
        train_noise = a.train.y - a.train.x @ weights
        assert 0.5 * NOISY_STD < train_noise.std().item() < 1.5 * NOISY_STD
        # test targets: noise-free with the key, the noisy ones (as before the key) without it
        test = torch.from_numpy(splits[k].test)
        assert torch.equal(a.test.y, pool.noise_free_y[test])
        torch.testing.assert_close(a.test.y, a.test.x @ weights, atol=1e-5, rtol=0)
        assert torch.equal(b.test.y, pool.y[test])
        test_noise = b.test.y - b.test.x @ weights
        assert 0.5 * NOISY_STD < test_noise.std().item() < 1.5 * NOISY_STD
    assert sum(sizes) == 450 and len(set(sizes)) == 3  # (137, 177, 136)
    assert [s.to_dict() for s in describe_partition(on, 3)] == [
        s.to_dict() for s in describe_partition(off, 3)
    ]


def test_a_dataset_registered_with_noise_free_targets_must_give_them() -> None:
    register_dataset(
        "toy-broken-promise", dataset_builder("toy-regression"), replace=True, noise_free_targets=True
    )
    with pytest.raises(ValueError, match=r"'toy-broken-promise'.*noise_free_y is None"):
        load_client_data(config(dataset="toy-broken-promise", noise_free_test=True), 0, 3)
    register_dataset("toy-broken-promise", dataset_builder("toy-regression"), replace=True)
    with pytest.raises(ConfigError, match="'noise-free-test'"):  # re-registered without them
        config(dataset="toy-broken-promise", noise_free_test=True)


def test_noise_free_targets_must_match_the_targets() -> None:
    x, y, domain = torch.zeros(4, 2), torch.zeros(4), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"noise_free_y must have the shape and dtype of y"):
        DatasetPool(x, y, domain, 0, task="regression", noise_free_y=torch.zeros(3))
    with pytest.raises(ValueError, match=r"noise_free_y must have the shape and dtype of y"):
        DatasetPool(x, y, domain, 0, task="regression", noise_free_y=torch.zeros(4, dtype=torch.float64))
