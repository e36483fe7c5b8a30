"""simulations/pfedfda_adaptation.py: pFedFDA's exported heads against a trained linear head."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.inprocess import run_inprocess
from flwr_pfl.app.server_app import app as server_app

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "simulations"))

import pfedfda_adaptation as A  # noqa: E402


def run(tmp_path: Path, dataset: str, algorithm: str, name: str, **extra) -> Path:
    cfg = {"algorithm": algorithm, "dataset": dataset, "model": "mlp", "num-clients": 4, "num-server-rounds": 2,
           "partitioner": "dirichlet", "dirichlet-alpha": 0.5, "learning-rate": 0.05, "output-dir": str(tmp_path),
           "run-name": name, **extra}
    run_inprocess(server_app, client_app, 4, cfg)
    return tmp_path / name


def test_the_scores_of_every_client_by_algorithm(tmp_path, blobs_dataset):
    """pFedFDA runs get all three scores, a fine-tuning run no global-statistics head; with beta
    fixed at 0 the personalized head is the global-statistics head, so the two scores agree on
    every client; ``as run`` is the run's own figure (measure refuses a mismatch)."""
    global_only = run(tmp_path, blobs_dataset, "pfedfda", "beta0", **{"pfedfda.beta-mode": "fixed", "pfedfda.beta-fixed": 0.0})
    adapted = run(tmp_path, blobs_dataset, "pfedfda", "adapted")
    finetune = run(tmp_path, blobs_dataset, "finetune", "ft")
    found = A.measure([global_only, adapted, finetune], probe_epochs=3)
    runs = {r["run"]: r for r in found["runs"]}
    assert [r["algorithm"] for r in found["runs"]] == ["pfedfda", "pfedfda", "finetune"]
    for client in runs["beta0"]["clients"]:
        assert client["global-statistics head"] == pytest.approx(client["as run"], abs=1e-12)
    reported = {c["partition_id"]: c["accuracy"] for c in json.loads((adapted / "clients.json").read_text())}
    assert {c["partition_id"]: c["as run"] for c in runs["adapted"]["clients"]} == pytest.approx(reported, abs=1e-12)
    assert all(set(c) == {"partition_id", "domain", *A.WAYS} for c in runs["adapted"]["clients"])
    assert all("global-statistics head" not in c and "as run" in c for c in runs["ft"]["clients"])
    summary = found["by_algorithm_and_domain"]
    assert set(summary) == {"pfedfda", "finetune"} and set(summary["pfedfda"]) == {0}
    assert summary["pfedfda"][0]["as run"]["per_run"] == pytest.approx(
        [sum(c["as run"] for c in runs[r]["clients"]) / 4 for r in ("beta0", "adapted")])
    assert "global-statistics head" not in summary["finetune"][0]


def test_a_model_that_is_not_the_runs_is_refused(tmp_path, blobs_dataset):
    run_dir = run(tmp_path, blobs_dataset, "pfedfda", "edited")
    rows = json.loads((run_dir / "clients.json").read_text())
    rows[1]["accuracy"] += 0.25
    (run_dir / "clients.json").write_text(json.dumps(rows))
    with pytest.raises(SystemExit, match="client 1 scores .* as exported but .* in clients.json"):
        A.measure([run_dir], probe_epochs=1)
