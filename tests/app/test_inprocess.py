"""End to end through the real Strategy and NumPyClient pairs, in one process (no Ray)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.registry import ALGORITHMS
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.clients import FedAvgClient
from flwr_pfl.errors import ConfigError

BASELINES = ["fedavg", "local", "finetune", "fedrep", "fedper"]


def config(tmp_path, dataset, **overrides):
    base = {
        "dataset": dataset,
        "model": "mlp",
        "num-clients": 4,
        "num-server-rounds": 3,
        "learning-rate": 0.1,
        "partitioner": "iid",
        "test-fraction": 0.25,
        "output-dir": str(tmp_path),
        "run-name": "run",
    }
    return base | {k.replace("_", "-"): v for k, v in overrides.items()}


def read_rows(tmp_path, name="run"):
    return json.loads((tmp_path / name / "metrics.json").read_text())


@pytest.mark.parametrize("algorithm", BASELINES)
def test_baseline_trains_and_writes_results(tmp_path, blobs_dataset, algorithm):
    grid = run_inprocess(server_app, client_app, 4, config(tmp_path, blobs_dataset, algorithm=algorithm))
    out = tmp_path / "run"
    for name in ("config.json", "metrics.json", "metrics.csv", "clients.json", "clients.csv", "learning_curves.png", "summary.txt"):
        assert (out / name).exists(), name
    evaluations = [r for r in read_rows(tmp_path) if r["phase"] == "evaluate"]
    assert [r["round"] for r in evaluations] == [1, 2, 3]
    # 4 well-separated classes, chance 0.25; config seeds 0-7: 1.000 for all five baselines
    assert evaluations[-1]["accuracy_wmean"] > 0.6
    for key in ("accuracy_mean", "accuracy_min", "accuracy_max", "accuracy_std", "loss_wmean"):
        assert key in evaluations[-1]
    clients = json.loads((out / "clients.json").read_text())
    assert sorted(c["partition_id"] for c in clients) == [0, 1, 2, 3]
    personal = {"local", "fedrep", "fedper"}
    for context in grid.contexts.values():
        assert ("personal" in context.state) == (algorithm in personal)
    if algorithm == "local":
        assert grid.bytes_sent == 0 and grid.bytes_received == 0


def test_body_only_wire_is_smaller_than_fedavg(tmp_path, blobs_dataset):
    sent = {}
    for algorithm in ("fedavg", "fedrep"):
        grid = run_inprocess(server_app, client_app, 4, config(tmp_path, blobs_dataset, algorithm=algorithm, run_name=algorithm))
        sent[algorithm] = grid.bytes_received
    assert 0 < sent["fedrep"] < sent["fedavg"]


def test_finetune_reports_global_and_finetuned_accuracy(tmp_path, blobs_dataset):
    run_inprocess(server_app, client_app, 4, config(tmp_path, blobs_dataset, algorithm="finetune"))
    last = [r for r in read_rows(tmp_path) if r["phase"] == "evaluate"][-1]
    assert "global_accuracy_wmean" in last and "accuracy_wmean" in last


class _BadReplyClient(FedAvgClient):
    """Partition 0 corrupts its reply in the way named by the test."""

    fault = "nan"

    def fit(self, parameters, config):
        arrays, n, metrics = super().fit(parameters, config)
        if self.partition_id == 0:
            if self.fault == "nan":
                arrays[0] = np.full_like(arrays[0], np.nan)
            elif self.fault == "shape":
                arrays[0] = arrays[0][:1]
            elif self.fault == "count":
                arrays = arrays[:-1]
            elif self.fault == "examples":
                n = 0
            elif self.fault == "raise":
                raise RuntimeError("disk full")
        return arrays, n, metrics


@pytest.mark.parametrize("fault", ["nan", "shape", "count", "examples", "raise"])
def test_bad_reply_is_rejected_and_the_round_goes_on(tmp_path, blobs_dataset, monkeypatch, fault):
    client = type("BadClient", (_BadReplyClient,), {"fault": fault})
    monkeypatch.setitem(ALGORITHMS, "fedavg", dataclasses.replace(ALGORITHMS["fedavg"], client=client))
    run_inprocess(server_app, client_app, 4, config(tmp_path, blobs_dataset, num_server_rounds=2))
    fits = [r for r in read_rows(tmp_path) if r["phase"] == "fit"]
    assert [r["num_failures"] for r in fits] == [1.0, 1.0]
    assert all(r["num_clients"] == 3.0 for r in fits)  # the other three were aggregated
    if fault != "raise":
        assert all(r["num_rejected"] == 1.0 for r in fits)
    last = [r for r in read_rows(tmp_path) if r["phase"] == "evaluate"][-1]
    # config seeds 0-7 (fault "nan"): 1.000
    assert np.isfinite(last["loss_wmean"]) and last["accuracy_wmean"] > 0.5


def test_bad_config_stops_before_any_training(tmp_path, blobs_dataset):
    from flwr_pfl.app.inprocess import InProcessGrid
    from flwr.app import Context, RecordDict

    cfg = config(tmp_path, blobs_dataset, algorithm="fedfoo")
    grid = InProcessGrid(client_app, 4, cfg)
    with pytest.raises(ConfigError, match="fedfoo"):
        server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    assert grid.client_seconds == 0.0


def test_resume_continues_from_the_checkpoint(tmp_path, blobs_dataset):
    run_inprocess(server_app, client_app, 4, config(tmp_path, blobs_dataset, num_server_rounds=2))
    assert (tmp_path / "run" / "checkpoint.npz").exists()
    run_inprocess(server_app, client_app, 4, config(tmp_path, blobs_dataset, num_server_rounds=3, resume=True))
    rounds = [r["round"] for r in read_rows(tmp_path) if r["phase"] == "evaluate"]
    assert rounds == [1, 2, 3]  # the resumed run did only round 3 and kept rounds 1 and 2
    # round 3 started from the checkpointed model: the results are those of a 3-round run
    run_inprocess(server_app, client_app, 4, config(tmp_path, blobs_dataset, num_server_rounds=3, run_name="straight"))
    for name in ("metrics.json", "clients.json"):
        assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "straight" / name).read_bytes(), name


def test_resume_without_checkpoint_is_a_config_error(tmp_path, blobs_dataset):
    with pytest.raises(ConfigError, match="no checkpoint"):
        run_inprocess(server_app, client_app, 4, config(tmp_path, blobs_dataset, resume=True))


def test_runs_are_reproducible_under_a_seed(tmp_path, blobs_dataset):
    """The same seed gives the same bytes (every round's metrics, every client's results); another
    seed gives other numbers (the seed is what fixes them)."""
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        run_inprocess(server_app, client_app, 4, config(tmp_path, blobs_dataset, run_name=name, algorithm="fedrep", seed=seed))
    for name in ("metrics.json", "clients.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    losses = {run: [r["loss_wmean"] for r in read_rows(tmp_path, run) if r["phase"] == "evaluate"] for run in "ac"}
    assert len(losses["a"]) == 3 and losses["a"] != losses["c"]


def test_each_node_gets_its_own_copy_of_a_message():
    """A mod that edits the message it receives (Flower's secaggplus_mod pops its stage key)
    cannot change what the next node receives when the server sends one content object to
    many nodes, as over the wire."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.clientapp import ClientApp

    from flwr_pfl.app.inprocess import InProcessGrid

    app = ClientApp()

    @app.train()
    def pop_stage(message: Message, context) -> Message:
        stage = message.content.config_records["cfg"].pop("stage", "missing")
        return Message(RecordDict({"cfg": ConfigRecord({"stage": stage})}), reply_to=message)

    grid = InProcessGrid(app, num_nodes=3, run_config={})
    shared = RecordDict({"cfg": ConfigRecord({"stage": "setup"})})
    messages = [grid.create_message(shared, "train", node, "1") for node in grid.get_node_ids()]
    replies = grid.send_and_receive(messages)
    assert [r.content.config_records["cfg"]["stage"] for r in replies] == ["setup"] * 3
    assert shared.config_records["cfg"]["stage"] == "setup"
    assert [r.metadata.reply_to_message_id for r in replies] == [m.metadata.message_id for m in messages]
