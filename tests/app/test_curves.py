"""simulations/curves.py: a reproduce table's paired comparison at every chosen round."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "simulations"))

import curves as C  # noqa: E402
import reproduce as R  # noqa: E402
from reproduce_tables import TABLES  # noqa: E402

#: (method, seed) -> accuracy at rounds 10, 20, 30: FedAvg + FT trails pFedFDA at round 10 on
#: every seed, is level at 20 (signs differ), leads at 30 on every seed
CURVES = {
    ("pFedFDA", 0): [0.80, 0.90, 0.92], ("pFedFDA", 1): [0.82, 0.91, 0.93], ("pFedFDA", 2): [0.81, 0.90, 0.92],
    ("FedAvg + FT", 0): [0.70, 0.91, 0.95], ("FedAvg + FT", 1): [0.73, 0.90, 0.95], ("FedAvg + FT", 2): [0.70, 0.90, 0.96],
    ("FedAvg", 0): [0.50, 0.60, 0.70],  # one seed: no spread, no verdict
}


@pytest.fixture()
def results(tmp_path) -> Path:
    table = TABLES["pfedfda"]
    column = table.columns[0].name
    for run in R.plan(table, "quick", [0, 1, 2], tmp_path, methods=["pFedFDA", "FedAvg + FT", "FedAvg"], lr_factors=[2]):
        values = CURVES.get((run.method, run.seed))
        if values is None or run.column != column:
            continue
        if run.lr_factor != 1.0:
            values = [0.0, 0.0, 0.0]  # a sweep run: never part of the comparison
        R.execute(run, lambda config, v=values: [
            row for i, x in enumerate(v, 1) for row in ({"round": 10 * i, "phase": "fit", "accuracy_wmean": 9.0},
                                                        {"round": 10 * i, "phase": "evaluate", "accuracy_wmean": x,
                                                         "acc_d1": 1 - x})])
    return tmp_path


def test_each_round_is_paired_against_the_reference_at_the_same_round(results):
    cells = {c["method"]: c for c in C.measure("pfedfda", "quick", [10, 20, 30, 40], results=results)}
    assert set(cells) == {"pFedFDA", "FedAvg + FT", "FedAvg"}  # the x2 sweep runs are left out
    ft = cells["FedAvg + FT"]["rounds"]
    assert ft[10]["mean"] == pytest.approx(0.71) and ft[10]["per_seed"] == [0.70, 0.73, 0.70]
    assert ft[10]["vs_reference"]["verdict"] == "behind"
    assert ft[10]["vs_reference"]["mean"] == pytest.approx(-0.10)
    assert ft[20]["vs_reference"]["verdict"] == "tie"  # +0.01, -0.01, 0.00
    assert ft[30]["vs_reference"]["verdict"] == "ahead"
    assert ft[30]["vs_reference"]["mean"] == pytest.approx((0.03 + 0.02 + 0.04) / 3)
    assert 40 not in ft  # never evaluated there
    assert "vs_reference" not in cells["pFedFDA"]["rounds"][10]
    assert cells["FedAvg"]["rounds"][30]["vs_reference"]["verdict"] == "one seed"


def test_markdown_shows_every_round_and_the_verdicts(results):
    cells = C.measure("pfedfda", "quick", [10, 30, 40], results=results)
    text = C.markdown("pfedfda", cells, [10, 30, 40])
    assert "| method | round 10 | round 30 | round 40 |" in text
    ft = next(line for line in text.splitlines() if line.startswith("| FedAvg + FT |"))
    assert "0.710 ± 0.017<br>-0.100 ± 0.010 worse" in ft and "better" in ft and ft.endswith("| - |")


def test_another_metric_can_be_compared(results):
    """--metric acc_d1: the same pairing on another evaluation key (here 1 - accuracy, so every
    verdict turns over)."""
    cells = {c["method"]: c for c in C.measure("pfedfda", "quick", [10, 30], results=results, metric=("acc_d1",))}
    ft = cells["FedAvg + FT"]["rounds"]
    assert ft[10]["mean"] == pytest.approx(0.29)
    assert ft[10]["vs_reference"]["verdict"] == "ahead" and ft[30]["vs_reference"]["verdict"] == "behind"
    assert C.measure("pfedfda", "quick", [10], results=results, metric=("acc_d9",)) == []
