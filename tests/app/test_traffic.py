"""Every run records what it sent and received, per round, node and message kind
(``traffic.json``), counted on the Grid: exactly the arrays on the wire, each way."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.server_app import app as server_app
from flwr_pfl.app.traffic import payload_bytes, totals


def config(tmp_path, name, **overrides) -> dict:
    base = {"dataset": "test-blobs", "model": "mlp", "num-clients": 3, "num-server-rounds": 2, "learning-rate": 0.1,
            "partitioner": "dirichlet", "test-fraction": 0.25, "output-dir": str(tmp_path), "run-name": name}
    return base | overrides


def traffic(tmp_path, name) -> list[dict]:
    return json.loads((tmp_path / name / "traffic.json").read_text())


def model_bytes(tmp_path, name) -> int:
    with np.load(tmp_path / name / "checkpoint.npz", allow_pickle=True) as saved:
        return sum(saved[k].nbytes for k in saved.files if k.startswith("global_"))


def test_payload_counts_arrays_and_byte_strings_not_scalars():
    content = RecordDict({
        "arrays": ArrayRecord({"w": Array(np.zeros((3, 4), dtype=np.float32))}),
        "config": ConfigRecord({"masked": [b"abcd", b"ef"], "key": b"123", "round": 7, "name": "x" * 50}),
    })
    assert payload_bytes(content) == len(Array(np.zeros((3, 4), dtype=np.float32)).data) + 6 + 3


def test_each_round_sends_and_receives_the_wire_arrays_of_every_client(tmp_path, blobs_dataset):
    run_inprocess(server_app, client_app, 3, config(tmp_path, "fedavg"))
    rows = traffic(tmp_path, "fedavg")
    model = model_bytes(tmp_path, "fedavg")
    train = [r for r in rows if r["kind"] == "train"]
    assert sorted((r["round"], r["partition_id"]) for r in train) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    overhead = 128 * 6  # numpy's serialization header of each of the MLP's six arrays, at most
    for row in train:
        assert model <= row["bytes_sent"] <= model + overhead and model <= row["bytes_received"] <= model + overhead
        assert row["messages"] == 1
    evaluation = [r for r in rows if r["kind"] == "evaluate"]
    assert all(r["bytes_received"] == 0 and r["bytes_sent"] == train[0]["bytes_sent"] for r in evaluation)
    assert totals(rows)["bytes_received_per_client_round"] == train[0]["bytes_received"]


def test_fedrep_uploads_its_body_only(tmp_path, blobs_dataset):
    run_inprocess(server_app, client_app, 3, config(tmp_path, "fedavg"))
    run_inprocess(server_app, client_app, 3, config(tmp_path, "fedrep", algorithm="fedrep"))
    up = {name: max(r["bytes_received"] for r in traffic(tmp_path, name) if r["kind"] == "train")
          for name in ("fedavg", "fedrep")}
    assert up["fedrep"] < up["fedavg"]
    assert up["fedavg"] - up["fedrep"] >= 4 * (200 * 4 + 4)  # the head (4 classes x 200, and its bias) stays home


def test_a_resumed_run_keeps_the_traffic_of_the_rounds_it_had_done(tmp_path, blobs_dataset):
    run_inprocess(server_app, client_app, 3, config(tmp_path, "run"))
    first = traffic(tmp_path, "run")
    run_inprocess(server_app, client_app, 3, config(tmp_path, "run", resume=True, **{"num-server-rounds": 3}))
    rows = traffic(tmp_path, "run")
    assert [r for r in rows if 1 <= r["round"] <= 2] == [r for r in first if 1 <= r["round"] <= 2]
    assert sorted({r["round"] for r in rows if r["kind"] == "train"}) == [1, 2, 3]
    setup = [r for r in rows if r["round"] == 0]  # both processes' start-up exchanges, added up:
    # the resumed one surveys the three nodes again, but takes its arrays from the checkpoint
    assert sum(r["messages"] for r in setup) == sum(r["messages"] for r in first if r["round"] == 0) + 3


def test_feddar_sa_packed_hessians_cut_the_upload_and_keep_the_heads(tmp_path, blobs_dataset):
    """``feddar.hessian-upload``: the upper triangle (float64) leaves the aggregated model equal up
    to float rounding; in float32 it moves it a little (the Newton solve amplifies the rounding),
    for about a half and a quarter of the Hessian bytes."""
    uploads, finals = {}, {}
    for how in ("full", "packed", "packed-float32"):
        run_inprocess(server_app, client_app, 3, config(tmp_path, how, algorithm="feddar-sa", **{
            "model": "linear", "feature-dim": 8, "feddar.head-epochs": 1, "feddar.hessian-upload": how}))
        uploads[how] = sum(r["bytes_received"] for r in traffic(tmp_path, how) if r["kind"] == "train")
        with np.load(tmp_path / how / "checkpoint.npz", allow_pickle=True) as saved:
            finals[how] = [saved[k] for k in sorted(k for k in saved.files if k.startswith("global_"))]
    p = 4 * 8  # four classes x eight features (FedDAR's linear heads here have no bias)
    hessian_values = 3 * 2 * p * p  # three clients, two rounds, one domain
    assert uploads["full"] - uploads["packed"] == pytest.approx(8 * (hessian_values - 3 * 2 * p * (p + 1) // 2), abs=2000)
    assert uploads["packed"] - uploads["packed-float32"] == pytest.approx(4 * 3 * 2 * p * (p + 1) // 2, abs=2000)
    for full, packed, single in zip(finals["full"], finals["packed"], finals["packed-float32"], strict=True):
        np.testing.assert_allclose(packed, full, rtol=0, atol=1e-6)  # measured: 6e-8, one float32 ulp of the model
        # float32 Hessians move the damped Newton solve visibly (measured: 3e-3 after two rounds)
        np.testing.assert_allclose(single, full, rtol=0, atol=2e-2)
