"""simulations/reproduce.py: skip / resume, the table maths and win rule, the protocols.

The runner is replaced by a fake run function (no training), except where a test checks that
the paper-scale configurations the app builds carry the paper's protocol.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from fakes import Killed, kill_at

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "simulations"))

import reproduce as R  # noqa: E402
import reproduce_report as report  # noqa: E402
from reproduce_tables import TABLES, Column, Method, Scale, Table  # noqa: E402


def _rows(value: float, rounds: int = 4) -> list[dict]:
    """Metric rows whose evaluation value ends at ``value`` (earlier rounds worse), plus fit rows."""
    rows = []
    for r in range(1, rounds + 1):
        rows.append({"round": r, "phase": "fit", "lambda_active_mean": 0.5})
        rows.append({"round": r, "phase": "evaluate", "acc": value - 0.1 * (rounds - r)})
    return rows


def _runs(tmp_path: Path, n: int = 5) -> list[R.Run]:
    return [R.Run("c", f"m{i % 2}", i, {"algorithm": "x", "seed": i, "lr": 0.1}, tmp_path / f"m{i % 2}-s{i}.json")
            for i in range(n)]


class FakeRunner:
    """Counts calls; optionally dies (like a kill) on the call number ``die_at``."""

    def __init__(self, die_at: int | None = None) -> None:
        self.calls: list[int] = []
        self.die_at = die_at

    def __call__(self, config: dict) -> list[dict]:
        if self.die_at is not None and len(self.calls) + 1 == self.die_at:
            raise KeyboardInterrupt("killed")
        self.calls.append(config["seed"])
        return _rows(0.5 + 0.01 * config["seed"])


def test_finished_runs_are_not_run_again(tmp_path):
    runs = _runs(tmp_path)
    first = FakeRunner()
    R.run_all(runs, first, log=lambda _: None)
    assert sorted(first.calls) == [0, 1, 2, 3, 4]
    again = FakeRunner()
    results = R.run_all(runs, again, log=lambda _: None)
    assert again.calls == []
    assert {r.seed for r in results} == {0, 1, 2, 3, 4}
    assert results[runs[3]]["rows"] == _rows(0.53)


def test_resume_after_a_kill_runs_only_what_is_missing(tmp_path):
    runs = _runs(tmp_path)
    killed = FakeRunner(die_at=3)
    with pytest.raises(KeyboardInterrupt):
        R.run_all(runs, killed, log=lambda _: None)
    assert killed.calls == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m0-s0.json", "m1-s1.json"]  # no temporary left over
    resumed = FakeRunner()
    R.run_all(runs, resumed, log=lambda _: None)
    assert resumed.calls == [2, 3, 4]


def _app_config(tmp_path: Path, dataset: str, rounds: int) -> dict:
    """A small real run of a personalized algorithm (its client state is what a resume would lose)."""
    return {"algorithm": "local", "dataset": dataset, "model": "mlp", "num-clients": 3, "num-server-rounds": rounds,
            "learning-rate": 0.1, "partitioner": "iid", "test-fraction": 0.25, "seed": 3,
            "output-dir": str(tmp_path), "run-name": "run"}


@pytest.mark.parametrize("before", ["killed at round 2 of 3", "finished with 1 round"])
def test_the_real_runner_starts_over_a_run_directory_it_did_not_finish(tmp_path, blobs_dataset, monkeypatch, before):
    """What the app left in a run's directory (a killed run, or a run of another configuration)
    neither blocks the driver (the app itself refuses to overwrite a run) nor leaks into the new run:
    it starts over (a resume from the checkpoint would lose the clients' in-memory state)."""
    straight = R.app_run(_app_config(tmp_path / "straight", blobs_dataset, 3))
    config = _app_config(tmp_path / "again", blobs_dataset, 3)
    if before.startswith("killed"):
        with monkeypatch.context() as m:
            kill_at(m, 2, "end")
            with pytest.raises(Killed):
                R.app_run(config)
    else:
        R.app_run(config | {"num-server-rounds": 1})
    assert (tmp_path / "again" / "run" / "checkpoint.npz").exists()  # the app would refuse this directory
    rows = R.app_run(config)
    assert rows == straight  # every round from the start, as an uninterrupted run
    assert [r["round"] for r in rows if r["phase"] == "evaluate"] == [1, 2, 3]


def test_changed_configuration_or_broken_file_runs_again(tmp_path):
    runs = _runs(tmp_path, 3)
    R.run_all(runs, FakeRunner(), log=lambda _: None)
    runs[2].result.write_text('{"config": {"algorithm"')  # half a file (written without the atomic rename)
    changed = [R.Run(r.column, r.method, r.seed, {**r.config, "lr": 0.2} if r.seed == 1 else r.config, r.result)
               for r in runs]
    again = FakeRunner()
    R.run_all(changed, again, log=lambda _: None)
    assert sorted(again.calls) == [1, 2]


def test_a_moved_output_folder_does_not_invalidate_finished_runs(tmp_path):
    runs = [R.Run("c", "m", 0, {"algorithm": "x", "seed": 0, "output-dir": "/old/place"}, tmp_path / "m-s0.json")]
    R.run_all(runs, FakeRunner(), log=lambda _: None)
    moved = [R.Run("c", "m", 0, {"algorithm": "x", "seed": 0, "output-dir": "/new/place"}, tmp_path / "m-s0.json")]
    again = FakeRunner()
    R.run_all(moved, again, log=lambda _: None)
    assert again.calls == []


def test_tracking_a_table_tracks_every_run_and_keeps_its_finished_runs(tmp_path):
    """``--tracking`` reaches every run's configuration (checked by the app like any key), and a
    run that finished untracked is not run again for it: a tracker changes no result."""
    table = TABLES["feddar-fig1"]
    plain = R.plan(table, "quick", [0], tmp_path, methods=["FedDAR-SA"])
    tracked = R.plan(table, "quick", [0], tmp_path, methods=["FedDAR-SA"], tracking="tensorboard")
    assert [r.config["tracking"] for r in tracked] == ["tensorboard"] * len(plain)
    assert all(r.config.get("tracking", "") == "" for r in plain)
    R.run_all(plain, FakeRunner(), log=lambda _: None)
    again = FakeRunner()
    R.run_all(tracked, again, log=lambda _: None)
    assert again.calls == []
    from flwr_pfl.errors import ConfigError

    with pytest.raises(ConfigError, match="tracking"):
        R.plan(table, "quick", [0], tmp_path, methods=["FedDAR-SA"], tracking="visdom")


def test_a_run_key_added_later_at_its_default_keeps_finished_runs(tmp_path):
    """A run stored before the app had ``aggregate`` stays finished while the key holds its
    default ("mean"); set to another value, the run is run again."""
    result = tmp_path / "m-s0.json"
    R.run_all([R.Run("c", "m", 0, {"algorithm": "x", "seed": 0}, result)], FakeRunner(), log=lambda _: None)
    at_default = FakeRunner()
    R.run_all([R.Run("c", "m", 0, {"algorithm": "x", "seed": 0, "aggregate": "mean"}, result)], at_default, log=lambda _: None)
    assert at_default.calls == []
    changed = FakeRunner()
    R.run_all([R.Run("c", "m", 0, {"algorithm": "x", "seed": 0, "aggregate": "trimmed-mean"}, result)], changed, log=lambda _: None)
    assert changed.calls == [0]


def test_write_atomic_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "r.json"
    R.write_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        R.write_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}


def test_progress_lines_carry_an_eta(tmp_path):
    lines: list[str] = []
    R.run_all(_runs(tmp_path, 3), FakeRunner(), log=lines.append)
    assert lines[0].startswith("3 runs: 0 finished before, 3 to run")
    assert all("ETA" in line for line in lines[1:]) and len(lines) == 4
    assert lines[-1].startswith("[3/3]") and "ETA 0.0 min" in lines[-1]


# ------------------------------------------------------------------------------------------
# table maths
# ------------------------------------------------------------------------------------------

def test_run_figure_averages_the_last_evaluation_rows_only():
    rows = _rows(0.9, rounds=5)  # evaluation values 0.5, 0.6, 0.7, 0.8, 0.9
    assert report.run_figure(rows, ("acc",), 1) == pytest.approx(0.9)
    assert report.run_figure(rows, ("acc",), 3) == pytest.approx(0.8)
    assert report.run_figure(rows, ("missing", "acc"), 2) == pytest.approx(0.85)
    assert report.run_figure(rows, ("missing",), 2) is None
    assert report.fit_mean(rows, "lambda_active_mean") == pytest.approx(0.5)


def test_mean_and_sample_std():
    mean, std = report.mean_std([0.70, 0.74, 0.78])
    assert mean == pytest.approx(0.74) and std == pytest.approx(0.04)  # ddof = 1 (population std: 0.0327)
    assert report.mean_std([0.5]) == (0.5, 0.0)
    assert all(math.isnan(v) for v in report.mean_std([]))


@pytest.mark.parametrize(
    "diffs, verdict",
    [
        ([0.02, 0.03, 0.025], "ahead"),          # consistent and beyond the spread
        ([-0.02, -0.03, -0.025], "behind"),
        ([0.001, 0.002, 0.30], "tie"),           # same sign but the mean (0.10) is inside the spread (0.17)
        ([0.10, 0.12, -0.01], "tie"),            # one seed disagrees
        ([0.05], "one seed"),
    ],
)
def test_win_rule_needs_every_seed_and_a_difference_beyond_the_spread(diffs, verdict):
    reference = {s: 0.5 for s in range(len(diffs))}
    method = {s: 0.5 + d for s, d in enumerate(diffs)}
    assert report.paired(method, reference, higher_is_better=True, log=False)["verdict"] == verdict
    flipped = {"ahead": "behind", "behind": "ahead"}.get(verdict, verdict)
    assert report.paired(method, reference, higher_is_better=False, log=False)["verdict"] == flipped


def test_win_rule_pairs_seeds_and_uses_log10_for_mse():
    # unpaired means would differ hugely, but seed by seed the method is 10x worse on every seed
    reference = {0: 1e-7, 1: 1e-3, 2: 1e-5}
    method = {0: 1e-6, 1: 1e-2, 2: 1e-4}
    d = report.paired(method, reference, higher_is_better=False, log=True)
    assert d["verdict"] == "behind" and d["mean"] == pytest.approx(-1.0) and d["std"] == pytest.approx(0.0, abs=1e-12)
    # on the linear scale seed 1 dominates and the spread swallows the difference
    assert report.paired({0: 2e-7, 1: 9e-4, 2: 3e-5}, reference, higher_is_better=False, log=False)["verdict"] == "tie"


def test_agreement_with_the_paper():
    assert report.paper_agreement("ahead", 0.80, 0.70, True) == "as paper"
    assert report.paper_agreement("behind", 0.80, 0.70, True) == "opposite of paper"
    assert report.paper_agreement("tie", 0.80, 0.70, True) == "not resolved"
    assert report.paper_agreement("ahead", 1e-3, 1e-1, False) == "as paper"
    assert report.paper_agreement("ahead", None, 0.7, True) == ""


def _toy_table() -> Table:
    return Table(
        name="toy", title="Toy", source="Table 0", description="toy",
        columns=(Column("col", "flwr_pfl/presets/tiny.toml"),),
        methods=(Method("new", "fedavg", {}, {"col": 0.80}), Method("base", "local", {}, {"col": 0.70}),
                 Method("noisy", "fedavg", {}, {"col": 0.75})),
        metric=("acc",), metric_label="accuracy", reference="new",
        scales={"quick": Scale({}, (0, 1, 2), "toy scale")}, extras={"fit:lambda_active_mean": "lambda active"},
    )


def _toy_page(tmp_path, values: dict[str, list[float]]) -> str:
    """The toy table's page from one figure per method and seed (seed = list position)."""
    results = {R.Run("col", m, s, {}, tmp_path / "x"): {"rows": _rows(v), "seconds": 60.0}
               for m, vs in values.items() for s, v in enumerate(vs)}
    return R.write_table(_toy_table(), "quick", results, "cmd", docs=tmp_path).read_text()


def test_table_page_shows_mean_std_paper_and_verdicts(tmp_path):
    page = _toy_page(tmp_path, {"new": [0.80, 0.82, 0.81], "base": [0.70, 0.71, 0.72], "noisy": [0.60, 0.95, 0.70]})
    lines = {line.split(" | ")[0].strip("| "): line for line in page.splitlines() if line.startswith("| ")}
    assert "0.8100 ± 0.0100" in lines["new"] and "reference" in lines["new"] and "0.8000" in lines["new"]
    assert "-0.1000 ± 0.0100" in lines["base"] and "| worse |" in lines["base"] and "as paper" in lines["base"]
    assert "| tie (within spread) |" in lines["noisy"] and "not resolved" in lines["noisy"]
    assert "0.5000 ± 0.0000" in lines["base"]  # the fit-row extra column
    assert (tmp_path / "toy-quick.png").stat().st_size > 1000
    summary = json.loads((tmp_path / "toy-quick.json").read_text())
    assert summary["col"]["noisy"]["paired"]["verdict"] == "tie"


def test_the_page_names_the_strongest_competitor_and_compares_it_seed_by_seed(tmp_path):
    # "noisy" has the best mean of the other rows (0.7667 > 0.71) and beats "new" on seed 1 only
    page = _toy_page(tmp_path, {"new": [0.80, 0.82, 0.81], "base": [0.70, 0.71, 0.72], "noisy": [0.60, 0.95, 0.75]})
    line = next(x for x in page.splitlines() if x.startswith("**Strongest competitor:**"))
    assert line == ("**Strongest competitor:** noisy (the best mean of the other rows). new minus noisy, seed by seed: "
                    "seed 0 +0.2000, seed 1 -0.1300, seed 2 +0.0600; new ahead on seeds 0, 2; behind on seed 1. "
                    "By the win rule: a tie (within spread).")
    # lower is better, on log10 values: the competitor with the lowest mean, differences of logs
    low = dataclasses.replace(_toy_table(), higher_is_better=False, log=True)
    rows = report.summarize(low, {"col": {"new": {0: 1e-4, 1: 1e-4}, "base": {0: 1e-2, 1: 1e-3}, "noisy": {0: 1.0, 1: 1.0}}}, {})
    assert report.strongest_competitor(low, rows["col"]) == (
        "**Strongest competitor:** base (the best mean of the other rows). new minus base, seed by seed (log10): "
        "seed 0 +2.0000, seed 1 +1.0000; new ahead on seeds 0, 1. By the win rule: new is better.")
    assert report.strongest_competitor(low, {"new": rows["col"]["new"]}) == ""


def test_a_run_the_app_judges_failed_is_marked_on_the_page_with_its_reason(tmp_path):
    """A seed whose round 2 lost every fit reply is a failed run (the app's own rule): its row
    says how many of its seeds failed and the page lists each with the reason; healthy rows are
    unmarked."""
    table = _toy_table()
    broken = _rows(0.12)
    for row in broken:
        if row["phase"] == "fit" and row["round"] == 2:
            row.update(participants=0, num_failures=3)
    results = {R.Run("col", m, s, {}, tmp_path / "x"): {"rows": broken if (m, s) == ("noisy", 1) else _rows(v), "seconds": 1.0}
               for m, v in (("new", 0.8), ("base", 0.7), ("noisy", 0.75)) for s in range(3)}
    page = R.write_table(table, "quick", results, "cmd", docs=tmp_path).read_text()
    lines = {line.split(" | ")[0].strip("| "): line for line in page.splitlines() if line.startswith("| ")}
    assert "(**1 of 3 failed**)" in lines["noisy"]
    assert "failed" not in lines["new"] and "failed" not in lines["base"]
    assert "- noisy, seed 1: round 2 trained nothing" in page
    summary = json.loads((tmp_path / "toy-quick.json").read_text())
    assert summary["col"]["noisy"]["failed"] == {"1": "round 2 trained nothing"} and summary["col"]["new"]["failed"] == {}


def test_a_page_written_from_part_of_a_table_names_what_has_not_run(tmp_path):
    toy = _toy_table()
    table = dataclasses.replace(toy, columns=toy.columns + (Column("later", "flwr_pfl/presets/tiny.toml"),))
    results = {R.Run("col", m, s, {}, tmp_path / "x"): {"rows": _rows(0.8), "seconds": 1.0}
               for m in ("new", "noisy") for s in (0, 1)}
    page = R.write_table(table, "quick", results, "cmd", docs=tmp_path).read_text()
    pending = next(line for line in page.splitlines() if line.startswith("**Not run yet"))
    assert pending.endswith("col: base; later (every method).")
    assert report.not_run(table, {"col": {m.label: {} for m in table.methods}, "later": {"new": {}}}) == ["later: base, noisy"]
    full = {R.Run(c.name, m.label, 0, {}, tmp_path / "x"): {"rows": _rows(0.8), "seconds": 1.0}
            for c in table.columns for m in table.methods}
    assert "Not run yet" not in R.write_table(table, "quick", full, "cmd", docs=tmp_path).read_text()


def test_each_run_records_its_machine_and_the_page_names_the_machines(tmp_path):
    import torch

    runs = _runs(tmp_path, 3)
    results = R.run_all(runs, FakeRunner(), log=lambda _: None)
    record = results[runs[0]]["machine"]
    assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and record["cpu_model"]
    assert record["torch"] == torch.__version__
    # a run file from before the driver kept the machine still counts, under its own label
    older = dict(results[runs[1]])
    del older["machine"]
    mixed = {R.Run("col", "new", s, {}, tmp_path / "x"): {"rows": _rows(0.8), "seconds": 1.0, "machine": record}
             for s in (0, 1)}
    mixed[R.Run("col", "base", 0, {}, tmp_path / "x")] = older | {"rows": _rows(0.7)}
    page = R.write_table(_toy_table(), "quick", mixed, "cmd", docs=tmp_path).read_text()
    line = next(x for x in page.splitlines() if x.startswith("Machines: "))
    assert f"{record['cpu_model']}, torch CPU kernels {record['cpu_capability']} (2 runs)" in line
    assert "not recorded (runs from before the driver kept it) (1 run)" in line


# ------------------------------------------------------------------------------------------
# protocols
# ------------------------------------------------------------------------------------------

def _config(table: str, scale: str, column: int = 0, method: int = 0) -> dict:
    t = TABLES[table]
    return R.base_config(t, scale, t.columns[column], t.methods[method])


def test_every_named_table_has_both_scales_and_three_seeds():
    assert set(TABLES) == {"feddar-fig1", "feddar-digits", "pfedfda", "fedora", "fedora-lambda-ablation",
                           "fmtl-table1", "fedgp-domain", "fedgp-label"}
    for t in TABLES.values():
        assert set(t.scales) == {"quick", "paper"}, t.name
        assert len(t.scales["quick"].seeds) >= 3 and len(t.scales["paper"].seeds) >= 3, t.name
        assert t.reference in {m.label for m in t.methods}, t.name
        assert len({m.label for m in t.methods}) == len(t.methods), t.name


def test_paper_scale_of_pfedfda():
    """Spec 3.4 / 5.3: R = 200, E = 5, q = 0.3, 100 clients (3 seeds: the paper states none)."""
    for column in range(2):
        c = _config("pfedfda", "paper", column)
        assert (c["num-server-rounds"], c["local-epochs"], c["fraction-fit"], c["num-clients"]) == (200, 5, 0.3, 100)
        assert (c["learning-rate"], c["momentum"], c["weight-decay"], c["batch-size"]) == (0.01, 0.5, 0.0005, 50)
    assert TABLES["pfedfda"].scales["paper"].seeds == (0, 1, 2)
    q = _config("pfedfda", "quick")
    assert (q["num-server-rounds"], q["local-epochs"]) == (20, 2)


def test_paper_scale_of_the_other_tables():
    fmtl = _config("fmtl-table1", "paper")
    assert (fmtl["num-server-rounds"], fmtl["fmtl.t1-rounds"], fmtl["learning-rate"]) == (110, 100, 0.01)
    assert (fmtl["num-clients"], fmtl["fraction-fit"], fmtl["local-epochs"]) == (100, 0.1, 1)
    rows = {m.label: i for i, m in enumerate(TABLES["fmtl-table1"].methods)}
    fedprox = _config("fmtl-table1", "paper", method=rows["FedProx"])  # spec P10: the T1 rounds only, mu 0.1
    assert (fedprox["num-server-rounds"], fedprox["fmtl.prox-mu"]) == (100, 0.1)
    assert _config("fmtl-table1", "quick", method=rows["FedProx"])["num-server-rounds"] == 15
    prox_ew = _config("fmtl-table1", "paper", method=rows["FedProx + EW"])
    assert (prox_ew["num-server-rounds"], prox_ew["fmtl.prox-mu"], prox_ew["fmtl.head-weighting"]) == (110, 0.1, "ew_participants")
    fig1 = _config("feddar-fig1", "paper")
    assert (fig1["num-clients"], fig1["num-server-rounds"], fig1["samples-per-client"] * (1 - fig1["test-fraction"])) == (100, 300, 10)
    assert fig1["learning-rate"] == 0.1 and _config("feddar-fig1", "paper", method=4)["learning-rate"] == 0.03
    digits = _config("feddar-digits", "paper", column=2)
    assert (digits["num-server-rounds"], digits["feddar.warmup-rounds"], digits["domain-alpha"]) == (100, 10, 1.0)
    for column, clients in ((0, 36), (1, 72)):
        fedora = _config("fedora", "paper", column)
        assert (fedora["num-server-rounds"], fedora["num-clients"], fedora["local-epochs"], fedora["fraction-fit"]) == (500, clients, 5, 1.0)
    assert _config("fedora", "quick", 1)["num-clients"] == 36
    for name in ("fedgp-domain", "fedgp-label"):
        assert _config(name, "paper")["num-server-rounds"] == 50
    layout = _config("fedgp-domain", "paper")  # App. C.7: 9 clean i.i.d. sources, target noise 0.4 unclipped
    assert (layout["num-clients"], layout["domain-clients"], layout["noise-std"], layout["noise-clip"]) == (10, "9,1", 0.4, False)
    assert (layout["max-samples"], layout["fedgp.target-train-samples"]) == (0, 100)


def test_lambda_ablation_rows_differ_only_in_the_selection_rule():
    t = TABLES["fedora-lambda-ablation"]
    configs = {m.label: R.base_config(t, "quick", t.columns[0], m) for m in t.methods}
    constant = configs["lambda = 1"]
    assert (constant["fedora.lambda-rule"], constant["fedora.lambda-constant"]) == ("constant", 1.0)
    assert configs["lambda = 10"]["fedora.lambda-constant"] == 10.0
    assert configs["adaptive, paper rule, error-rate Delta"]["fedora.val-metric"] == "error_rate"
    keys = {"fedora.lambda-rule", "fedora.lambda-constant", "fedora.val-metric", "fedora.preset"}
    stripped = [{k: v for k, v in c.items() if k not in keys} for c in configs.values()]
    assert all(s == stripped[0] for s in stripped)
    assert (constant["num-clients"], constant["rotation-step"]) == (36, 10.0)


def test_the_imbalanced_lambda_column_is_the_papers_app_b_split(data_dir):
    """Table 5 is the imbalanced setting: client 17 of 36 takes what the others' 469 leave."""
    from flwr_pfl.data import DataConfig, describe_partition

    c = _config("fedora-lambda-ablation", "quick", column=1)
    assert (c["large-client"], c["samples-per-client"], c["num-clients"]) == (17, 469, 36)
    data = DataConfig.from_run_config({**c, "data-dir": str(data_dir)})
    sizes = [(s.num_train, s.num_val, s.num_test) for s in describe_partition(data, 36)]
    assert sizes[17] == (35516, 17764, 277) and set(sizes[:17] + sizes[18:]) == {(128, 64, 277)}
    assert _config("fedora-lambda-ablation", "quick", column=0).get("large-client", -1) == -1


def test_the_scarce_fig1_column_has_five_training_samples_per_client():
    for scale in ("quick", "paper"):
        c = _config("feddar-fig1", scale, column=2)
        assert c["noise-free-test"] and c["samples-per-client"] * (1 - c["test-fraction"]) == 5


def test_unknown_method_or_column_names_stop_before_anything_runs(tmp_path):
    table = TABLES["fedgp-domain"]
    with pytest.raises(SystemExit, match="--methods: \\['FedGP'\\] not in table fedgp-domain"):
        R.plan(table, "quick", [0], tmp_path, methods=["FedGP"])
    with pytest.raises(SystemExit, match="--columns: \\['noise'\\] not in table fedgp-domain"):
        R.plan(table, "quick", [0], tmp_path, columns=["noise"])
    with pytest.raises(SystemExit, match="has scales"):
        R.plan(table, "huge", [0], tmp_path)


# ------------------------------------------------------------------------------------------
# learning-rate sweep (same tuning effort for every row)
# ------------------------------------------------------------------------------------------

import reproduce_tuning as tuning  # noqa: E402


def test_a_sweep_plan_multiplies_each_methods_own_learning_rate(tmp_path):
    table = TABLES["feddar-fig1"]
    plain = R.plan(table, "quick", [0], tmp_path, methods=["FedDAR-SA", "Separate FedAvg"])
    swept = R.plan(table, "quick", [0], tmp_path, methods=["FedDAR-SA", "Separate FedAvg"], lr_factors=[0.5, 2])
    assert len(swept) == 3 * len(plain)
    rates = {(r.method, r.lr_factor): r.config["learning-rate"] for r in swept}
    assert rates[("FedDAR-SA", 0.5)] == pytest.approx(0.1) and rates[("FedDAR-SA", 2.0)] == pytest.approx(0.4)
    assert rates[("Separate FedAvg", 0.5)] == pytest.approx(0.015) and rates[("Separate FedAvg", 2.0)] == pytest.approx(0.06)
    # factor 1 is the table's own run: same file, same configuration; the others have their own
    assert {r.result for r in plain} == {r.result for r in swept if r.lr_factor == 1.0}
    assert len({r.result for r in swept}) == len(swept)
    assert len({r.config["output-dir"] for r in swept}) == len(swept)
    assert [r for r in swept if r.lr_factor == 2.0][0].label == "FedDAR-SA (lr x2)"
    for bad in ([0.0], [-1.0], [math.inf]):
        with pytest.raises(SystemExit, match="--lr-factors"):
            R.plan(table, "quick", [0], tmp_path, lr_factors=bad)


@pytest.mark.parametrize("higher, log, values, best", [
    (True, False, {0.5: [0.6, 0.62], 1.0: [0.7, 0.7], 2.0: [0.65, 0.8]}, 2.0),    # best mean, not best seed
    (False, False, {0.5: [0.3, 0.3], 1.0: [0.2, 0.2], 2.0: [0.25, 0.25]}, 1.0),   # lower is better
    (False, True, {0.5: [1e-6, 1e-2], 1.0: [1e-3, 1e-3], 2.0: [1e-2, 1e-2]}, 0.5),  # log10 mean: -4 < -3
    (True, False, {0.25: [0.7], 1.0: [0.7], 4.0: [0.7]}, 1.0),                    # a tie goes to x1
    (True, False, {0.5: [0.7], 4.0: [0.7]}, 0.5),                                 # ... or the factor nearer 1
    (True, False, {0.5: [math.nan], 2.0: [0.1]}, 2.0),                            # NaN runs never win
])
def test_best_factor(higher, log, values, best):
    per_factor = {f: dict(enumerate(v)) for f, v in values.items()}
    assert tuning.best_factor(per_factor, higher, log) == best


def test_sweep_page_compares_every_row_at_its_best_rate(tmp_path):
    table = _toy_table()
    # "base" is worse than "new" at x1 but better at x2; "new" is best at x0.5 (an edge of the grid)
    values = {("new", 0.5): [0.84, 0.85, 0.86], ("new", 1.0): [0.80, 0.82, 0.81], ("new", 2.0): [0.5, 0.5, 0.5],
              ("base", 0.5): [0.6, 0.6, 0.6], ("base", 1.0): [0.70, 0.71, 0.72], ("base", 2.0): [0.90, 0.91, 0.92]}
    results = {R.Run("col", m, s, {}, tmp_path / f"{m}{f}{s}", f): {"rows": _rows(v), "seconds": 1.0}
               for (m, f), vs in values.items() for s, v in enumerate(vs)}
    summary = tuning.summarize(table, {"col": {m: {f: {s: v for s, v in enumerate(vs)} for (mm, f), vs in values.items() if mm == m}
                                               for m in ("new", "base")}})
    new, base = summary["col"]["new"], summary["col"]["base"]
    assert (new["best"], new["edge"], base["best"], base["edge"]) == (0.5, True, 2.0, True)
    assert base["untuned"]["verdict"] == "behind" and base["untuned"]["mean"] == pytest.approx(-0.1)
    assert base["tuned"]["verdict"] == "ahead" and base["tuned"]["mean"] == pytest.approx(0.91 - 0.85)
    page = R.write_sweep(table, "quick", results, "cmd --lr-factors 0.5 2", docs=tmp_path).read_text()
    line = next(x for x in page.splitlines() if x.startswith("| base |"))
    assert "**0.9100 ± 0.0100**" in line and "x2 (edge)" in line
    assert "-0.1000 ± 0.0100, worse" in line and "+0.0600 ± 0.0000, better" in line
    assert json.loads((tmp_path / "toy-quick-lr.json").read_text())["col"]["new"]["best"] == 0.5
    # the table's own page reads factor 1 only
    R.write_table(table, "quick", results, "cmd", docs=tmp_path)
    own = json.loads((tmp_path / "toy-quick.json").read_text())
    assert own["col"]["base"]["mean"] == pytest.approx(0.71) and own["col"]["new"]["n"] == 3


def test_a_run_of_one_method_adds_to_the_tables_page_and_writes_the_sweep(tmp_path):
    table = TABLES["fedgp-label"]
    for run in R.plan(table, "quick", [0, 1], tmp_path, methods=["Target Only", "FedGP_Auto"], lr_factors=[2]):
        value = 0.8 + 0.01 * run.seed + (0.05 if run.lr_factor == 2 and run.method == "Target Only" else 0)
        R.execute(run, lambda config, v=value: [{"round": 1, "phase": "evaluate", "target_accuracy": v}])
    R.main(["fedgp-label", "--seeds", "0", "1", "--methods", "Target Only", "--lr-factors", "2",
            "--results", str(tmp_path), "--docs", str(tmp_path), "--report-only"])
    page = (tmp_path / "fedgp-label-quick.md").read_text()
    assert "| FedGP_Auto |" in page and "| Target Only |" in page  # not only this invocation's method
    assert "--methods" not in page
    # the sweep's page too: a sweep of one row adds it and keeps the rows swept before
    sweep = json.loads((tmp_path / "fedgp-label-quick-lr.json").read_text())[table.columns[0].name]
    assert sorted(sweep) == ["FedGP_Auto", "Target Only"] and sweep["Target Only"]["best"] == 2.0
    assert sweep["FedGP_Auto"]["best"] == 1.0
    assert "--methods" not in (tmp_path / "fedgp-label-quick-lr.md").read_text()



@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_row_of_every_table_is_a_valid_run_configuration(name, tmp_path):
    """Each method on each column at each scale is checked as the app checks a run (the
    configuration parses, the strategy accepts it): a misspelt option key, a value out of range
    or an unregistered algorithm in a row fails here, not hours into a reproduction."""
    table = TABLES[name]
    for scale in table.scales:
        runs = R.plan(table, scale, [0], tmp_path)
        assert len(runs) == len(table.columns) * len(table.methods)
        assert {(r.column, r.method) for r in runs} == {(c.name, m.label) for c in table.columns for m in table.methods}
