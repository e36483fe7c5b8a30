"""``python -m flwr_pfl.app.compare``: every algorithm name and config is checked before the
first run, so a mistake in the list stops the comparison at once."""

from __future__ import annotations

import pytest

from flwr_pfl.app import compare as compare_module
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.errors import ConfigError


@pytest.fixture
def runs(monkeypatch) -> list[str]:
    """Replace the runs by a record of the algorithms run (each config still parsed, as a run does)."""
    done: list[str] = []

    def fake_run(config, engine, reuse=False):
        parse_experiment(config)
        done.append(config["algorithm"])
        return []

    monkeypatch.setattr(compare_module, "run_one", fake_run)
    return done


def _base(dataset: str, **extra) -> dict:
    return {"dataset": dataset, "model": "mlp", "num-clients": 4, **extra}


def test_unknown_algorithm_names_are_all_listed_before_any_run(tmp_path, blobs_dataset, runs):
    with pytest.raises(ConfigError) as err:
        compare_module.compare(_base(blobs_dataset), ["fedavg", "fedrepp", "nope"], [0, 1], tmp_path)
    message = str(err.value)
    assert "unknown algorithm name(s) 'fedrepp' (did you mean fedrep" in message and "'nope'" in message
    assert "allowed: fedavg, fedavg-mh" in message and "pfedfda" in message
    assert runs == []


def test_a_config_one_algorithm_refuses_stops_the_comparison_before_any_run(tmp_path, blobs_dataset, runs):
    with pytest.raises(ConfigError, match=r"nothing was run:\n  fedgp: fraction-fit=0.5 is not allowed for fedgp"):
        compare_module.compare(_base(blobs_dataset, **{"fraction-fit": 0.5}), ["fedavg", "fedgp"], [0], tmp_path)
    assert runs == []


def test_reuse_reads_finished_runs_and_reruns_changed_ones(tmp_path, blobs_dataset, monkeypatch):
    """``--reuse``: a finished run with the same config is read, not run; a changed config runs."""
    import flwr_pfl.app.inprocess as inprocess

    base = _base(blobs_dataset, **{"num-server-rounds": 2, "partitioner": "iid", "learning-rate": 0.1})
    first = compare_module.compare(base, ["fedavg"], [0], tmp_path, reuse=True)
    calls: list[int] = []
    real = inprocess.run_inprocess
    monkeypatch.setattr(inprocess, "run_inprocess", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = compare_module.compare(base, ["fedavg"], [0], tmp_path, reuse=True)
    assert calls == [] and again == first
    changed = compare_module.compare(base | {"learning-rate": 0.2}, ["fedavg"], [0], tmp_path, reuse=True)
    assert calls == [1] and changed != first
    compare_module.compare(base | {"learning-rate": 0.2}, ["fedavg"], [0], tmp_path)  # no reuse: runs
    assert calls == [1, 1]
