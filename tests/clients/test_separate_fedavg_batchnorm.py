"""Separate FedAvg trains one copy of the model per domain on that domain's samples alone; with a
BatchNorm model, a domain whose samples leave a last batch of exactly one sample (or that has one
sample only) must not stop the client with torch's "Expected more than 1 value per channel when
training": such a batch has no batch statistics to normalise with, and is left out of that
epoch (a different sample each epoch: the domain's loader shuffles)."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Context, RecordDict
from torch.utils.data import DataLoader, TensorDataset

from fakes import BatchNormDropoutNet
from flwr_pfl.clients import LocalData, TrainConfig
from flwr_pfl.clients.feddar import SeparateFedAvgClient


def client(domain_sizes: list[int], batch_size: int = 4) -> SeparateFedAvgClient:
    """A separate-FedAvg client over a BatchNorm1d model, ``domain_sizes[m]`` samples in domain m."""
    torch.manual_seed(0)
    n = sum(domain_sizes)
    x = torch.randn(n, 6)
    y = torch.randint(0, 3, (n,))
    d = torch.cat([torch.full((size,), m, dtype=torch.long) for m, size in enumerate(domain_sizes)])
    data = LocalData(train=DataLoader(TensorDataset(x, y, d), batch_size=batch_size, shuffle=True),
                     test=DataLoader(TensorDataset(x, y, d), batch_size=batch_size), num_domains=len(domain_sizes))
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2},
                      state=RecordDict(), run_config={})
    return SeparateFedAvgClient(context, BatchNormDropoutNet(), data, TrainConfig())


def test_a_domain_whose_last_batch_has_one_sample_trains_without_it() -> None:
    c = client([5, 8])  # domain 0: batches of 4 and 1
    before = [a.copy() for a in c.get_parameters({})]
    arrays, n, metrics = c.fit(before, {"server-round": 1})
    assert n == 13 and np.isfinite(metrics["train_loss"])
    per_model = (len(arrays) - 1) // 2
    assert any(not np.array_equal(a, b) for a, b in zip(arrays[:per_model], before[:per_model]))  # domain 0 trained
    assert any(not np.array_equal(a, b) for a, b in zip(arrays[per_model:-1], before[per_model:]))  # domain 1 trained
    np.testing.assert_array_equal(arrays[-1], [5.0, 8.0])  # the domain counts are the client's samples


def test_a_domain_with_one_sample_leaves_its_model_as_received() -> None:
    c = client([1, 8])
    before = [a.copy() for a in c.get_parameters({})]
    arrays, n, metrics = c.fit(before, {"server-round": 1})
    per_model = (len(arrays) - 1) // 2
    assert all(np.array_equal(a, b) for a, b in zip(arrays[:per_model], before[:per_model]))
    assert any(not np.array_equal(a, b) for a, b in zip(arrays[per_model:-1], before[per_model:]))
    assert np.isfinite(metrics["train_loss"])
