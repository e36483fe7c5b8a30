"""A client without training samples is refused when it is built, with one message for every
algorithm naming its partition and what to change."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Context, RecordDict

from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.clients.base import LocalData, PFLClient, TrainConfig
from flwr_pfl.data.types import ArraySplit, ClientData
from flwr_pfl.errors import ConfigError
from flwr_pfl.models import build_model

EMPTY = ArraySplit(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
TEST = ArraySplit(torch.randn(10, 6), torch.arange(10) % 2, torch.zeros(10, dtype=torch.long))
MESSAGE = r"^partition 7 has no training samples .*fewer clients \(num-clients\), another partitioner"


def _context() -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": 7, "num-partitions": 8},
                   state=RecordDict(), run_config={})


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithms_client_refuses_an_empty_training_set(name: str) -> None:
    spec = ALGORITHMS[name]
    options = spec.options()
    model = build_model("mlp", (6,), 2, num_heads=spec.num_heads(options, 1), feature_dim=4)
    data = LocalData(train=EMPTY.loader(4, shuffle=False), test=TEST.loader(4, shuffle=False))
    with pytest.raises(ConfigError, match=MESSAGE):
        spec.client(_context(), model, data, TrainConfig(device="cpu"), **spec.client_kwargs(options))


def test_client_data_with_an_empty_train_split_reaches_the_named_error() -> None:
    """torch refuses to shuffle an empty dataset; the client's message must come first."""
    client_data = ClientData(train=EMPTY, val=EMPTY, test=TEST, num_classes=2, num_domains=1,
                             input_shape=(6,), task="classification")
    data = LocalData.from_client_data(client_data, batch_size=4)
    with pytest.raises(ConfigError, match=MESSAGE):
        PFLClient(_context(), build_model("mlp", (6,), 2, feature_dim=4), data, TrainConfig(device="cpu"))
