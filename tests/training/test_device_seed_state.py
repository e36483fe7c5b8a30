"""Device selection, seeding, and client state kept in a RecordDict."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from flwr_pfl.errors import ConfigError
from flwr_pfl.training.device import resolve_device, set_num_threads
from flwr_pfl.training.seed import client_seed, seed_everything
from flwr_pfl.training.state import load_arrays, load_scalars, save_arrays, save_scalars

# ---------------------------------------------------------------- devices


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_auto_is_cpu_without_cuda(no_cuda):
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device() == torch.device("cpu")


def test_auto_here_matches_the_machine():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.parametrize("spec", ["cpu", "CPU", " cpu "])
def test_cpu(spec):
    assert resolve_device(spec) == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "CUDA:1"])
def test_cuda_without_cuda_is_a_config_error(no_cuda, spec):
    with pytest.raises(ConfigError, match="CUDA is not available") as info:
        resolve_device(spec)
    assert spec.strip().lower() in str(info.value)
    assert "'auto'" in str(info.value) and "'cpu'" in str(info.value)


def test_cuda_with_cuda(two_gpus):
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("Cuda:0").type == "cuda"


def test_cuda_index_beyond_visible_devices(two_gpus):
    with pytest.raises(ConfigError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("spec", ["gpu", "", "cuda:", "cuda:x", "cuda:-1", "mps", "cpu:0", "auto:1"])
def test_bad_device_strings(two_gpus, spec):
    with pytest.raises(ConfigError, match="not allowed"):
        resolve_device(spec)


def test_set_num_threads():
    previous = torch.get_num_threads()
    try:
        set_num_threads(0)
        assert torch.get_num_threads() == previous
        set_num_threads(2)
        assert torch.get_num_threads() == 2
        with pytest.raises(ConfigError, match="num-threads"):
            set_num_threads(-1)
    finally:
        torch.set_num_threads(previous)


# ---------------------------------------------------------------- seeds


def _draws() -> tuple[float, np.ndarray, torch.Tensor]:
    return random.random(), np.random.rand(4), torch.randn(4)


def test_seed_everything_repeats_draws():
    seed_everything(123)
    a = _draws()
    seed_everything(123)
    b = _draws()
    assert a[0] == b[0]
    np.testing.assert_array_equal(a[1], b[1])
    assert torch.equal(a[2], b[2])
    seed_everything(124)
    c = _draws()
    assert a[0] != c[0]
    assert not np.array_equal(a[1], c[1])
    assert not torch.equal(a[2], c[2])


def test_seed_everything_accepts_large_seeds():
    seed_everything(2**40 + 5)
    a = np.random.rand(3)
    seed_everything(2**40 + 5)
    np.testing.assert_array_equal(a, np.random.rand(3))


def test_client_seed_is_distinct_and_reproducible():
    seeds = {client_seed(7, pid, rnd) for pid in range(50) for rnd in range(20)}
    assert len(seeds) == 50 * 20
    assert client_seed(7, 3, 2) == client_seed(7, 3, 2)
    assert client_seed(7, 3) == client_seed(7, 3, 0)
    assert client_seed(8, 3, 2) != client_seed(7, 3, 2)


# ---------------------------------------------------------------- state


def test_arrays_round_trip_in_order_with_dtypes():
    state = RecordDict()
    arrays = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array([1, 2, 3], dtype=np.int64),
        np.random.default_rng(0).normal(size=(3, 3)),  # float64
        np.array(5.0, dtype=np.float32),  # 0-d
    ] + [np.full((i + 1,), i, dtype=np.float32) for i in range(10)]  # > 10 arrays keeps order
    save_arrays(state, "head", arrays)
    assert isinstance(state["head"], ArrayRecord)
    loaded = load_arrays(state, "head")
    assert len(loaded) == len(arrays)
    for a, b in zip(arrays, loaded):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_save_arrays_copies_and_replaces():
    state = RecordDict()
    a = np.ones(3, dtype=np.float32)
    save_arrays(state, "x", [a])
    a[:] = 7.0
    np.testing.assert_array_equal(load_arrays(state, "x")[0], np.ones(3))
    save_arrays(state, "x", [np.zeros(2), np.zeros(1)])
    assert [b.shape for b in load_arrays(state, "x")] == [(2,), (1,)]


def test_save_arrays_accepts_non_contiguous_arrays():
    state = RecordDict()
    a = np.arange(12, dtype=np.float32).reshape(3, 4).T
    save_arrays(state, "t", [a])
    np.testing.assert_array_equal(load_arrays(state, "t")[0], a)


def test_scalars_round_trip():
    state = RecordDict()
    values = {"beta": 0.25, "round": 3, "name": "fedrep", "done": True}
    save_scalars(state, "meta", values)
    assert isinstance(state["meta"], ConfigRecord)
    loaded = load_scalars(state, "meta")
    assert loaded == values
    assert type(loaded["round"]) is int and type(loaded["done"]) is bool
    loaded["beta"] = 9.0  # a copy
    assert load_scalars(state, "meta")["beta"] == 0.25
    save_scalars(state, "meta", {"beta": 0.5})
    assert load_scalars(state, "meta") == {"beta": 0.5}


def test_missing_keys():
    state = RecordDict()
    assert load_arrays(state, "nothing") is None
    assert load_scalars(state, "nothing") == {}


def test_wrong_record_type_raises():
    state = RecordDict()
    save_scalars(state, "s", {"a": 1})
    save_arrays(state, "a", [np.zeros(1)])
    with pytest.raises(TypeError, match="ArrayRecord"):
        load_arrays(state, "s")
    with pytest.raises(TypeError, match="ConfigRecord"):
        load_scalars(state, "a")


def test_state_survives_between_separate_uses():
    """Arrays stored by one client object are read back by the next one (same RecordDict)."""
    state = RecordDict()
    head = [np.random.default_rng(1).normal(size=(4, 2)).astype(np.float32), np.zeros(2, np.float32)]
    save_arrays(state, "personal_head", head)
    save_scalars(state, "personal_meta", {"rounds_trained": 1})
    again = load_arrays(state, "personal_head")
    for a, b in zip(head, again):
        np.testing.assert_array_equal(a, b)
    assert load_scalars(state, "personal_meta")["rounds_trained"] == 1


def test_model_with_batchnorm_round_trips_through_state():
    """0-d buffers (num_batches_tracked) must come back with shape (), or set_arrays fails."""
    from torch import nn

    from flwr_pfl.models import EncoderHeadModel
    from flwr_pfl.training.params import get_arrays, set_arrays

    def make() -> EncoderHeadModel:
        encoder = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
        return EncoderHeadModel(encoder, feature_dim=6, num_outputs=2, num_heads=2)

    torch.manual_seed(0)
    source, target = make(), make()
    source.train()
    source(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))  # moves the BatchNorm buffers
    assert int(source.encoder[1].num_batches_tracked) == 1
    state = RecordDict()
    save_arrays(state, "model", get_arrays(source, "all"))
    set_arrays(target, load_arrays(state, "model"), "all")
    for (k, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), k
