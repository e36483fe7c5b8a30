"""``python -m flwr_pfl.app.compare``: every algorithm name and config is checked before the
first run, so a mistake in the list stops the comparison at once."""

from __future__ import annotations

import pytest

from flwr_pfl.app import compare as compare_module
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.registry import ALGORITHMS
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
    assert message.endswith("allowed: " + ", ".join(sorted(ALGORITHMS)))
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


def test_paired_differences_call_a_win_only_when_every_seed_agrees_beyond_the_spread():
    def runs(*finals):
        return [[{"round": 1, "accuracy_wmean": 0.0}, {"round": 2, "accuracy_wmean": f}] for f in finals]

    curves = {
        "base": runs(0.50, 0.60, 0.70),
        "better": runs(0.55, 0.66, 0.74),    # +0.05, +0.06, +0.04: same sign, mean 0.05 > std 0.01
        "noisy": runs(0.60, 0.58, 0.75),     # +0.10, -0.02, +0.05: signs disagree
        "worse": runs(0.40, 0.50, 0.60),     # -0.10 on every seed, std 0
        "spread": runs(0.51, 0.70, 0.71),    # +0.01, +0.10, +0.01: same sign, mean 0.04 < std 0.052
    }
    paired = compare_module.paired_differences(curves, "accuracy_wmean", "base")
    assert paired["better"]["verdict"] == "ahead" and paired["better"]["mean"] == pytest.approx(0.05)
    assert paired["noisy"]["verdict"] == "tie"
    assert paired["worse"]["verdict"] == "behind" and paired["worse"]["min"] == pytest.approx(-0.10)
    assert paired["spread"]["verdict"] == "tie"
    assert compare_module.paired_differences({"base": runs(0.5), "x": runs(0.9)}, "accuracy_wmean", "base")["x"]["verdict"] == "one seed"
    table = compare_module.paired_markdown(paired, "accuracy_wmean", "base")
    assert "| better | +0.0500 ± 0.0100 | +0.0400..+0.0600 | ahead |" in table
