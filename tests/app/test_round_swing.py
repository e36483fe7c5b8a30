"""simulations/round_swing.py: the round-to-round swing of a reproduce table's runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "simulations"))

import reproduce as R  # noqa: E402
import round_swing as S  # noqa: E402
from reproduce_tables import TABLES  # noqa: E402


def test_swing_is_the_mean_absolute_step_over_the_last_evaluations_only():
    # steps of the last four values: -0.2, +0.1, +0.3 -> mean |step| 0.2; the early 0.0 -> 0.9 jump is outside
    assert S.swing([0.0, 0.9, 0.5, 0.3, 0.4, 0.7], last=4) == pytest.approx(0.2)
    assert S.swing([0.5, 0.5, 0.5], last=10) == 0.0
    assert S.swing([0.5], last=10) is None


def test_evaluation_values_read_the_first_metric_key_a_run_reports_from_evaluation_rows_only():
    rows = [{"phase": "fit", "acc": 9.0}, {"phase": "evaluate", "acc": 0.1}, {"phase": "evaluate", "global_acc": 0.7},
            {"phase": "evaluate", "acc": 0.3}]
    assert S.evaluation_values(rows, ("acc", "global_acc")) == [0.1, 0.3]
    assert S.evaluation_values(rows, ("missing", "global_acc")) == [0.7]
    assert S.evaluation_values(rows, ("missing",)) == []


def test_measure_groups_runs_by_column_method_and_learning_rate_factor(tmp_path):
    table = TABLES["fedgp-label"]
    curves = {  # (method, factor) -> per-seed evaluation values; swing over the last 10 of each
        ("Target Only", 1.0): ([0.5, 0.6, 0.5, 0.6], [0.5, 0.7, 0.5, 0.7]),  # swings 0.1 and 0.2
        ("Target Only", 2.0): ([0.6, 0.6, 0.6], [0.6, 0.62, 0.64]),  # 0.0 and 0.02
        ("FedGP_Auto", 1.0): ([0.2, 0.8], [0.8, 0.2]),  # 0.6 twice
    }
    for run in R.plan(table, "quick", [0, 1], tmp_path, methods=["Target Only", "FedGP_Auto"], lr_factors=[2]):
        if (run.method, run.lr_factor) not in curves or run.column != table.columns[0].name:
            continue
        values = curves[(run.method, run.lr_factor)][run.seed]
        R.execute(run, lambda config, v=values: [{"round": i, "phase": "evaluate", "target_accuracy": x}
                                                 for i, x in enumerate(v, 1)])
    found = {(f["method"], f["lr_factor"]): f for f in S.measure("fedgp-label", "quick", last=10, results=tmp_path)}
    assert set(found) == set(curves)  # FedGP_Auto at x2 never ran: no cell
    assert found[("Target Only", 1.0)]["swing_per_seed"] == pytest.approx([0.1, 0.2])
    assert found[("Target Only", 1.0)]["swing_mean"] == pytest.approx(0.15)
    assert found[("Target Only", 2.0)]["swing_mean"] == pytest.approx(0.01)
    assert found[("FedGP_Auto", 1.0)]["swing_std"] == pytest.approx(0.0)
    # the table's own figure beside it: the mean of the last 5 evaluations (fedgp-label's `last`), over seeds
    assert found[("Target Only", 2.0)]["figure_mean"] == pytest.approx((0.6 + 0.62) / 2)
    assert found[("Target Only", 1.0)]["seeds"] == [0, 1]


def test_sweep_factors_come_from_the_result_file_names(tmp_path):
    (tmp_path / "col").mkdir()
    for name in ("FedAvg-s0.json", "FedAvg_lr-x0.5-s0.json", "FedAvg_+_FT_lr-x16-s2.json", "FedAvg_lr-x0.5-s1.json"):
        (tmp_path / "col" / name).write_text("{}")
    assert R.sweep_factors(tmp_path) == [0.5, 1.0, 16.0]
