"""PersonalCopyClient: the personal copy of the whole model swaps in for a block, is stored in
``context.state`` (buffers included), survives a new client object on the same context, and the
global model comes back unchanged after the block, also when the block raises."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from torch.utils.data import DataLoader, TensorDataset

from fakes import BatchNormDropoutNet
from flwr_pfl.clients.base import LocalData, TrainConfig
from flwr_pfl.clients.personal import PersonalCopyClient
from flwr_pfl.training import get_arrays


def make_client(state: RecordDict, seed: int = 0) -> PersonalCopyClient:
    torch.manual_seed(seed)
    x, y = torch.randn(12, 6), torch.arange(12) % 3
    loader = DataLoader(TensorDataset(x, y), batch_size=12)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 2}, state=state, run_config={})
    return PersonalCopyClient(ctx, BatchNormDropoutNet(), LocalData(loader, loader), TrainConfig(device="cpu"), head="fc2")


def snapshot(client: PersonalCopyClient) -> list[np.ndarray]:
    return get_arrays(client.model, "all")


def test_the_copy_starts_from_the_model_then_persists_across_client_objects():
    state = RecordDict()
    client = make_client(state)
    assert not client.has_personal_model() and client.personal_state() == {}
    global_before = snapshot(client)
    with client.personal_model() as anchor:
        assert all(torch.equal(anchor[k], v) for k, v in client.model.state_dict().items())
        for key, tensor in client.model.state_dict().items():
            tensor.add_(1)  # parameters and buffers (running statistics, counters) alike
    assert all(np.array_equal(a, b) for a, b in zip(snapshot(client), global_before))
    personal = client.personal_state()
    assert set(personal) == set(client.model.state_dict())
    assert all(torch.equal(personal[k], torch.as_tensor(g) + 1) for k, g in zip(client.model.state_dict(), global_before))

    fresh = make_client(state, seed=5)  # another global model, the same context
    assert fresh.has_personal_model()
    with fresh.personal_model() as anchor:
        assert all(torch.equal(v, personal[k]) for k, v in fresh.model.state_dict().items())
        assert not torch.equal(anchor["module.fc2.weight"], personal["module.fc2.weight"])


def test_store_false_leaves_the_stored_copy_as_it_was():
    state = RecordDict()
    client = make_client(state)
    with client.personal_model():
        client.model.state_dict()["module.fc2.bias"].fill_(3.0)
    with client.personal_model(store=False):
        client.model.state_dict()["module.fc2.bias"].fill_(-9.0)
    assert torch.all(client.personal_state()["module.fc2.bias"] == 3.0)


def test_a_raising_block_stores_nothing_and_restores_the_global_model():
    state = RecordDict()
    client = make_client(state)
    before = snapshot(client)
    with pytest.raises(RuntimeError, match="boom"):
        with client.personal_model():
            client.model.state_dict()["module.fc2.bias"].fill_(7.0)
            raise RuntimeError("boom")
    assert not client.has_personal_model()
    assert all(np.array_equal(a, b) for a, b in zip(snapshot(client), before))


def test_the_evaluation_keeps_the_personal_models_own_figures_beside_the_global_ones():
    from flwr_pfl.core.metrics import ONE_CLASS

    client = make_client(RecordDict())
    with client.personal_model():
        client.model.state_dict()["module.fc2.bias"].copy_(torch.tensor([100.0, 0.0, 0.0]))  # answers class 0 alone
    metrics = client.local_evaluate({}).metrics()
    assert metrics[ONE_CLASS] == 1.0  # the personal model's collapse is reported, not dropped
    assert f"global_{ONE_CLASS}" not in metrics and {"global_loss", "global_accuracy"} <= set(metrics)
    assert metrics["accuracy"] == pytest.approx(4 / 12) and metrics["loss"] > 10 * metrics["global_loss"]
