"""simulations/peak_round.py: when each row of a reproduce table is at its best, and what it gives back."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "simulations"))

import peak_round as P  # noqa: E402
import reproduce as R  # noqa: E402
from reproduce_tables import TABLES  # noqa: E402


def _rows(metric: str, values: list[float], val_losses: list[float] | None = None, every: int = 10) -> list[dict]:
    """Evaluation rows every ``every`` rounds (fit rows between them carry decoys of the same keys)."""
    rows = []
    for i, value in enumerate(values, 1):
        rows.append({"round": i * every, "phase": "fit", metric: 99.0, "val_loss_mean": -1.0})
        row = {"round": i * every, "phase": "evaluate", metric: value}
        if val_losses is not None:
            row["val_loss_mean"] = val_losses[i - 1]
        rows.append(row)
    return rows


def test_peak_is_the_first_best_point_in_the_metrics_direction():
    series = [(10, 0.5), (20, 0.8), (30, 0.8), (40, 0.6)]
    assert P.peak(series) == (20, 0.8)
    assert P.peak(series, higher_is_better=False) == (10, 0.5)
    with pytest.raises(ValueError, match="no value"):
        P.peak([])


def test_a_run_that_peaks_then_declines_gives_back_the_difference():
    # best 0.09 at round 20, last 0.06: give-back 0.03; validation loss lowest at round 30 (metric 0.08 there)
    rows = _rows("r_acc", [0.05, 0.09, 0.08, 0.06], val_losses=[0.9, 0.6, 0.55, 0.7])
    figures = P.run_peaks(rows, ("r_acc",), True, "val_loss_mean")
    assert figures == {"best_round": 20, "best": 0.09, "last": 0.06, "give_back": pytest.approx(0.03),
                       "val_min_round": 30, "at_val_min": 0.08}


def test_a_lower_is_better_metric_peaks_at_its_minimum_and_give_back_stays_positive():
    rows = _rows("loss_wmean", [1e-2, 1e-4, 3e-4])
    figures = P.run_peaks(rows, ("loss_wmean",), False, "val_loss_mean")
    assert (figures["best_round"], figures["best"]) == (20, 1e-4)
    assert figures["give_back"] == pytest.approx(2e-4)
    assert figures["val_min_round"] is None and figures["at_val_min"] is None  # no validation loss reported


def test_a_run_still_at_its_best_at_the_end_gives_back_nothing_and_no_metric_is_no_figures():
    assert P.run_peaks(_rows("r_acc", [0.01, 0.02, 0.03]), ("r_acc",), True, "val_loss_mean")["give_back"] == 0.0
    assert P.run_peaks(_rows("other", [0.5]), ("r_acc",), True, "val_loss_mean") is None


def test_measure_averages_each_figure_over_the_seeds_of_a_cell(tmp_path):
    table = TABLES["fedora-lambda-ablation"]
    curves = {  # method -> per seed: (R-Acc, validation loss) at rounds 10, 20, 30
        "lambda = 1": (([0.08, 0.07, 0.05], [0.5, 0.6, 0.7]), ([0.06, 0.09, 0.07], [0.6, 0.5, 0.8])),
        "adaptive, paper rule (default)": (([0.02, 0.05, 0.08], [0.8, 0.7, 0.6]), ([0.01, 0.04, 0.07], [0.9, 0.6, 0.7])),
    }
    for run in R.plan(table, "quick", [0, 1], tmp_path, methods=list(curves), columns=[table.columns[0].name]):
        metric, val = curves[run.method][run.seed]
        R.execute(run, lambda config, m=metric, v=val: _rows("r_acc", m, v))
    found = {f["method"]: f for f in P.measure(table.name, "quick", results=tmp_path)}
    assert set(found) == set(curves)
    pull = found["lambda = 1"]
    assert pull["seeds"] == [0, 1]
    assert pull["best_round_per_seed"] == [10, 20]
    assert pull["best_mean"] == pytest.approx(0.085)
    assert pull["give_back_per_seed"] == pytest.approx([0.03, 0.02])
    assert pull["give_back_mean"] == pytest.approx(0.025)
    assert pull["give_back_std"] == pytest.approx(math.sqrt(2) * 0.005)
    assert pull["val_min_round_per_seed"] == [10, 20]
    assert pull["at_val_min_mean"] == pytest.approx(0.085)
    default = found["adaptive, paper rule (default)"]
    assert default["give_back_mean"] == 0.0 and default["best_round_per_seed"] == [30, 30]
    assert default["val_min_round_per_seed"] == [30, 20]
    assert default["at_val_min_per_seed"] == pytest.approx([0.08, 0.04])
