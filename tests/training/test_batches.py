"""Reading batches: tuples and dicts (Hugging Face / flwr-datasets) give the same numbers, and a
batch that cannot be read says which keys it has and how to name them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from fakes import DictImages, QuickNet, image_tensors
from flwr_pfl.errors import ConfigError
from flwr_pfl.models import split_model
from flwr_pfl.training import (
    BatchKeys,
    OptimizerConfig,
    collect_features,
    dataset_targets,
    evaluate,
    get_arrays,
    loader_like,
    num_samples,
    read_batch,
    train,
)

CPU = torch.device("cpu")
SGD = OptimizerConfig("sgd", learning_rate=0.1)


# ---------------------------------------------------------------- tuples


def test_a_pair_gets_domain_zero():
    x, y = torch.randn(3, 2), torch.tensor([1, 0, 1])
    ux, uy, ud = read_batch([x, y], CPU)
    assert torch.equal(ux, x) and torch.equal(uy, y)
    assert ud.dtype == torch.long and torch.equal(ud, torch.zeros(3, dtype=torch.long))


def test_a_triple_keeps_its_domain():
    x, y, d = torch.randn(3, 2), torch.tensor([1, 0, 1]), torch.tensor([2, 0, 1])
    ux, uy, ud = read_batch((x, y, d), CPU)
    assert torch.equal(ux, x) and torch.equal(uy, y) and torch.equal(ud, d)


@pytest.mark.parametrize("n", [1, 4])
def test_tuples_of_other_lengths_are_refused(n):
    with pytest.raises(ValueError, match=rf"a batch must be \(x, y\), \(x, y, domain\) or a dict; got {n} elements"):
        read_batch([torch.zeros(2)] * n, CPU)


def test_other_batch_types_are_refused():
    with pytest.raises(TypeError, match=r"or a dict; got a Tensor"):
        read_batch(torch.zeros(2, 3), CPU)


# ---------------------------------------------------------------- dicts


@pytest.mark.parametrize("input_key, target_key", [("image", "label"), ("img", "label"), ("img", "fine_label")])
def test_default_keys_read_flwr_datasets_image_datasets(input_key, target_key):
    """MNIST / Fashion-MNIST, CIFAR-10 and CIFAR-100 columns, with and without a domain."""
    x, y, d = torch.randn(4, 1, 2, 2), torch.tensor([3, 1, 0, 2]), torch.tensor([1, 0, 1, 1])
    ux, uy, ud = read_batch({input_key: x, target_key: y, "id": torch.arange(4)}, CPU)
    assert torch.equal(ux, x) and torch.equal(uy, y) and torch.equal(ud, torch.zeros(4, dtype=torch.long))
    _, _, ud = read_batch({input_key: x, target_key: y, "domain": d}, CPU)
    assert torch.equal(ud, d)


def test_label_wins_over_fine_label_and_img_over_image():
    batch = {"image": torch.zeros(2, 1), "img": torch.ones(2, 1), "fine_label": torch.tensor([5, 6]),
             "label": torch.tensor([1, 2])}
    x, y, _ = read_batch(batch, CPU)
    assert torch.equal(x, torch.ones(2, 1)) and torch.equal(y, torch.tensor([1, 2]))


def test_custom_keys_name_the_entries():
    batch = {"pixels": torch.randn(3, 2), "y": torch.tensor([0, 1, 0]), "site": torch.tensor([2, 2, 1])}
    keys = BatchKeys(input="pixels", target="y", domain="site")
    x, y, d = read_batch(batch, CPU, keys)
    assert torch.equal(x, batch["pixels"]) and torch.equal(y, batch["y"]) and torch.equal(d, batch["site"])
    x2, _, _ = read_batch({"a": torch.ones(1), "b": torch.zeros(1), "t": torch.zeros(1)}, CPU,
                          BatchKeys(input=["x", "a"], target=("t",), domain=None))
    assert torch.equal(x2, torch.ones(1))


def test_a_dict_without_the_keys_names_what_it_has_and_how_to_configure():
    with pytest.raises(ConfigError, match=r"^a batch is a dict with keys \['pixels', 'y'\]: no input key \(looked for "
                                          r"'img', 'image'\); no target key \(looked for 'label', 'fine_label'\)\. "
                                          r"Name its entries with LocalData\(\.\.\., batch_keys=BatchKeys\(input=\.\.\., "
                                          r"target=\.\.\., domain=\.\.\.\)\)"):
        read_batch({"pixels": torch.zeros(2, 1), "y": torch.zeros(2)}, CPU)


def test_a_domain_key_you_name_must_be_there():
    with pytest.raises(ConfigError, match=r"keys \['img', 'label'\]: no domain key \(looked for 'site'\)"):
        read_batch({"img": torch.zeros(2, 1), "label": torch.zeros(2)}, CPU, BatchKeys(domain="site"))


def test_entries_that_are_not_tensors_say_how_to_get_tensors():
    with pytest.raises(ConfigError, match=r"batch\['img'\] is a list, not a tensor; .*with_format\('torch'\)"):
        read_batch({"img": [[0.0]], "label": torch.zeros(1)}, CPU)


@pytest.mark.parametrize("kwargs", [{"input": ""}, {"target": []}, {"domain": [3]}])
def test_bad_batch_keys_are_refused(kwargs):
    with pytest.raises(ConfigError, match=r"BatchKeys"):
        BatchKeys(**kwargs)


# ---------------------------------------------------------------- the same numbers


def _tuple_loader(n: int = 40, shuffle: bool = True) -> DataLoader:
    x, y, d = image_tensors(n, seed=7)
    return DataLoader(TensorDataset(x, y, d), batch_size=8, shuffle=shuffle)


def _dict_loader(n: int = 40, shuffle: bool = True, keys=("img", "label", "domain")) -> DataLoader:
    x, y, d = image_tensors(n, seed=7)
    return DataLoader(DictImages(x, y, d, *keys), batch_size=8, shuffle=shuffle)


def _hf_loader(n: int = 40, shuffle: bool = True) -> DataLoader:
    """A real Hugging Face Dataset in torch format, as a flwr-datasets partition gives it."""
    datasets = pytest.importorskip("datasets")
    x, y, d = image_tensors(n, seed=7)
    ds = datasets.Dataset.from_dict({"image": x.numpy(), "label": y.numpy(), "domain": d.numpy()}).with_format("torch")
    return DataLoader(ds, batch_size=8, shuffle=shuffle)


def _trained(loader: DataLoader, keys: BatchKeys | None = None) -> tuple[list[np.ndarray], float, int]:
    torch.manual_seed(0)
    model = split_model(QuickNet(), "fc3")
    torch.manual_seed(1)
    stats = train(model, loader, optimizer=SGD, device=CPU, epochs=2, keys=keys)
    return get_arrays(model), stats.loss, stats.num_examples


LOADERS = {
    "default keys": (lambda: _dict_loader(), None),
    "custom keys": (lambda: _dict_loader(keys=("pixels", "y", "site")), BatchKeys("pixels", "y", "site")),
    "hugging face": (_hf_loader, None),
}


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_training_on_dict_batches_gives_the_bytes_of_training_on_tuples(name):
    make, keys = LOADERS[name]
    expected, expected_loss, expected_n = _trained(_tuple_loader())
    arrays, loss, n = _trained(make(), keys)
    assert loss == expected_loss and n == expected_n == 40
    for a, b in zip(arrays, expected):
        assert a.tobytes() == b.tobytes()
    assert not all(a.tobytes() == b.tobytes() for a, b in zip(expected, _trained(_tuple_loader(n=32))[0]))


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_evaluation_and_features_on_dict_batches_equal_those_on_tuples(name):
    make, keys = LOADERS[name]
    torch.manual_seed(0)
    model = split_model(QuickNet(), "fc3")
    expected = evaluate(model, _tuple_loader(shuffle=False), device=CPU, num_domains=2)
    result = evaluate(model, _unshuffled(make), device=CPU, num_domains=2, keys=keys)
    assert result == expected and expected.per_domain_count == [21, 19]
    z0, y0, d0 = collect_features(model, _tuple_loader(shuffle=False), device=CPU)
    z, y, d = collect_features(model, _unshuffled(make), device=CPU, keys=keys)
    assert torch.equal(z, z0) and torch.equal(y, y0) and torch.equal(d, d0)


def _unshuffled(make) -> DataLoader:
    return loader_like(make())


# ---------------------------------------------------------------- counts and passes


def test_num_samples_is_the_dataset_length_and_refuses_a_dataset_without_one():
    assert num_samples(_dict_loader(n=24)) == 24

    class Stream(IterableDataset):
        def __iter__(self):
            yield {"img": torch.zeros(1), "label": torch.zeros(())}

    with pytest.raises(ConfigError, match=r"the loader's dataset \(Stream\) has no length; clients report their number "
                                          r"of examples"):
        num_samples(DataLoader(Stream(), batch_size=2))


def test_dataset_targets_read_every_sample_in_dataset_order_without_random_draws():
    y0, d0 = dataset_targets(_tuple_loader())
    state = torch.get_rng_state()
    y, d = dataset_targets(_dict_loader(keys=("pixels", "y", "site")), BatchKeys("pixels", "y", "site"))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(y, y0) and torch.equal(d, d0) and d.dtype == torch.long
    _, d_plain = dataset_targets(DataLoader(TensorDataset(torch.zeros(3, 1), torch.zeros(3)), batch_size=2))
    assert torch.equal(d_plain, torch.zeros(3, dtype=torch.long))


def test_loader_like_keeps_the_users_collate_fn_and_batch_size():
    def collate(items):
        return {"img": torch.stack([i["img"] for i in items]) * 2, "label": torch.stack([i["label"] for i in items])}

    loader = DataLoader(DictImages(*image_tensors(10, seed=1)), batch_size=4, collate_fn=collate)
    again = loader_like(loader)
    assert again.collate_fn is collate and again.batch_size == 4
    first = next(iter(again))
    assert torch.equal(first["img"], 2 * loader.dataset.x[:4])
    assert loader_like(loader, batch_size=3, shuffle=True, drop_last=True).drop_last


def test_a_user_model_trains_from_a_copy_of_its_loader_too():
    """train() on a dict loader rebuilt by loader_like (what FedGP and Separate FedAvg do)."""
    loader = _dict_loader()
    expected, _, _ = _trained(loader)
    torch.manual_seed(0)
    model = split_model(QuickNet(), "fc3")
    torch.manual_seed(1)
    train(model, loader_like(loader, shuffle=True), optimizer=SGD, device=CPU, epochs=2)
    for a, b in zip(get_arrays(model), expected):
        assert a.tobytes() == b.tobytes()
