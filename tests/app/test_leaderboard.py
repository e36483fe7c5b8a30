"""simulations/leaderboard.py: a row is at its best learning-rate factor by the mean of the
final-round figure over the seeds; a factor with a failed or missing seed cannot be the best; a
best factor at the grid's edge is flagged; the page states the rule and ranks by that mean."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "simulations"))

import leaderboard as lb  # noqa: E402


def report_with(runs: dict[tuple[str, float, int], dict], factors=(0.5, 1.0, 2.0), seeds=(0, 1, 2)) -> dict:
    return {
        "command": "python simulations/leaderboard.py", "factors": list(factors), "seeds": list(seeds),
        "settings": {"s": {"summary": "a setting", "learning_rate": 0.05}}, "extra": {},
        "runs": {lb.run_key("s", a, f, seed): r for (a, f, seed), r in runs.items()}, "rows": {},
    }


def run(acc: float, seconds: float = 1.0, **more) -> dict:
    return {"final_accuracy": acc, "seconds_per_round": seconds, **more}


def test_the_best_factor_has_the_highest_mean_over_seeds_not_the_best_single_run():
    runs = {("a", 0.5, s): run(v) for s, v in enumerate([0.60, 0.60, 0.60])}
    runs |= {("a", 1.0, s): run(v) for s, v in enumerate([0.90, 0.40, 0.41])}  # best single run, lower mean
    runs |= {("a", 2.0, s): run(v) for s, v in enumerate([0.55, 0.56, 0.57])}
    row = lb.row(report_with(runs), "s", "a", [0.5, 1.0, 2.0], [0, 1, 2])
    assert row["best_factor"] == 0.5 and row["at_edge"]
    assert row["per_factor"][0.5]["mean"] == pytest.approx(0.60) and row["per_factor"][0.5]["std"] == pytest.approx(0.0)
    assert row["per_factor"][1.0]["std"] == pytest.approx(float(__import__("numpy").std([0.90, 0.40, 0.41])))


def test_a_factor_with_a_failed_or_missing_seed_cannot_be_the_best():
    runs = {("a", 1.0, s): run(0.5) for s in range(3)}
    runs |= {("a", 2.0, 0): run(0.99), ("a", 2.0, 1): {"error": "ValueError: boom", "seconds_per_round": 1.0}, ("a", 2.0, 2): run(0.99)}
    runs |= {("a", 0.5, 0): run(0.98)}  # seeds 1 and 2 never ran
    row = lb.row(report_with(runs), "s", "a", [0.5, 1.0, 2.0], [0, 1, 2])
    assert row["best_factor"] == 1.0 and not row["at_edge"]
    assert row["per_factor"][2.0]["errors"] == ["ValueError: boom"]


def test_the_page_ranks_rows_by_their_best_mean_and_states_the_rule():
    runs = {("low", 1.0, s): run(0.3, 2.0) for s in range(3)} | {("high", 1.0, s): run(0.7, 0.5) for s in range(3)}
    report = report_with(runs, factors=(1.0,))
    report["rows"] = {f"s/{a}": lb.row(report, "s", a, [1.0], [0, 1, 2]) for a in ("low", "high")}
    page = lb.markdown(report)
    assert "final round" in page and "never its best round" in page and "grid x1" in page
    table = [line for line in page.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert table[0].startswith("| 1 | high | 0.700 ± 0.000 | x1 | 0.50 |") and table[1].startswith("| 2 | low | 0.300")


def test_a_partial_sweep_says_how_much_is_done_and_what_each_row_lacks():
    runs = {("a", 1.0, s): run(0.7) for s in range(3)} | {("a", 2.0, 0): run(0.9)}
    runs |= {("b", 1.0, 0): run(0.8)}
    report = report_with(runs)
    report["grid"] = {"settings": ["s"], "algorithms": ["a", "b"]}
    report["rows"] = {f"s/{a}": lb.row(report, "s", a, [0.5, 1.0, 2.0], [0, 1, 2]) for a in ("a", "b")}
    assert lb.progress(report) == (5, 18)
    page = lb.markdown(report)
    assert "Status: 5 of the grid's 18 runs are done" in page
    row_a = next(line for line in page.splitlines() if line.startswith("| 1 | a |"))
    assert "0.700 ± 0.000 | x1 |" in row_a and "not run: x0.5 (0 of 3 seeds), x2 (1 of 3 seeds)" in row_a
    row_b = next(line for line in page.splitlines() if "| b |" in line)
    assert row_b.startswith("| — | b |") and "x1 (1 of 3 seeds)" in row_b  # no complete factor: not ranked
    report["runs"] |= {lb.run_key("s", a, f, s): run(0.5) for a in ("a", "b") for f in (0.5, 1.0, 2.0) for s in range(3)}
    report["rows"] = {f"s/{a}": lb.row(report, "s", a, [0.5, 1.0, 2.0], [0, 1, 2]) for a in ("a", "b")}
    assert lb.progress(report) == (18, 18) and "Status" not in lb.markdown(report)


def test_a_row_equal_to_an_earlier_one_on_every_seed_says_it_reduces_to_it():
    """FedBN on a model without normalisation layers is FedAvg byte for byte: the page says so
    rather than leave a reader to suspect a bug; a row that differs on one seed is not named."""
    runs = {("fedavg", 1.0, s): run(v) for s, v in enumerate([0.71, 0.72, 0.73])}
    runs |= {("fedbn", 1.0, s): run(v) for s, v in enumerate([0.71, 0.72, 0.73])}
    runs |= {("fedprox", 1.0, s): run(v) for s, v in enumerate([0.71, 0.72, 0.7301])}
    report = report_with(runs, factors=(1.0,))
    report["rows"] = {f"s/{a}": lb.row(report, "s", a, [1.0], [0, 1, 2]) for a in ("fedavg", "fedbn", "fedprox")}
    assert lb.same_as(report, "s", "fedbn", ["fedavg"]) == "fedavg"
    assert lb.same_as(report, "s", "fedprox", ["fedavg", "fedbn"]) is None
    assert lb.same_as(report, "s", "fedavg", []) is None
    lines = {line.split(" | ")[1]: line for line in lb.markdown(report).splitlines() if line.startswith("| ")}
    assert "the same final accuracy as fedavg on every seed run: it reduces to fedavg on this setting" in lines["fedbn"]
    assert "reduces to" not in lines["fedprox"] and "reduces to" not in lines["fedavg"]
