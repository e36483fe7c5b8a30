"""A run killed and resumed ends exactly where an uninterrupted run ends.

"Killed" is simulated in-process: the results writer raises at a chosen point of a round (after
that round's checkpoint, or mid-round after its fit rows were appended), which stops the
ServerApp as a kill would: nothing after that point runs or is written. The run is then started
again with ``resume=true`` and the same configuration, and its ``metrics.json``,
``clients.json``, summary and final checkpoint are compared, byte for byte, with those of one
uninterrupted run.

What a resume preserves: the server's whole state (the checkpoint) and every result row up to
the checkpoint's round; rows a killed run wrote after its last checkpoint are dropped and those
rounds run again. The clients' own state (``context.state``: FedRep's and FedPer's heads, Local's
and FEDORA's personal models, pFedFDA's previous beta) lives on the nodes, not in the checkpoint.
So:

* algorithms whose state is all on the server (FedAvg, FedDAR, FMTL, FedGP) are checked with
  **fresh nodes** after the kill (a new grid, as a restarted simulation gives);
* personalized algorithms (FedRep, pFedFDA, FEDORA) are checked with **nodes that keep their
  state** across the server's restart (the same grid), which is what a deployment whose
  SuperNodes keep running gives, killed right after a checkpoint: a node's state holds every
  round it trained, so rounds run again after a resume would train it twice (mid-round kills
  are checked on the server-state algorithms); :func:`test_fresh_nodes_restart_personal_state`
  shows what a resume with fresh nodes keeps for them (the server's state) and what it does
  not (the heads).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from fakes import Killed, kill_at, register_domain_blobs
from flwr_pfl.app.client_app import app as client_app
from flwr_pfl.app.inprocess import InProcessGrid
from flwr_pfl.app.server_app import app as server_app

NUM_CLIENTS = 6


@pytest.fixture(scope="module")
def dataset() -> str:
    """'test-resume-domains': 4 classes x 3 domains (a covariate shift per domain), 1,440 samples."""
    return register_domain_blobs("test-resume-domains", seed=7, center_scale=0.5)  # overlapping classes: accuracies stay below 1


DOMAINS = {"partitioner": "domain-mixture", "domain-alpha": 0.5, "samples-per-client": 120}
#: per-algorithm settings that make the algorithm's server state matter within 5 rounds
EXTRA: dict[str, dict] = {
    "fedavg": {},
    "finetune": {"eval-every": 2, "finetune.epochs": 1},  # the run-wide schedule, counted across the resume
    "fedrep": {"fedrep.head-epochs": 1},
    "feddar-sa": DOMAINS | {"feddar.head-epochs": 1},
    "pfedfda": {"pfedfda.eval-every": 2},
    "fedora": {"fedora.eval-every": 2, "fedora.report-round": "best_val"},
    "fmtl": {"partitioner": "pathological", "classes-per-client": 2, "fmtl.t1-rounds": 2,
             "fmtl.participation": "population_renorm"},
    "fedgp": {"partitioner": "one-domain-per-client", "num-clients": 3, "fedgp.target-train-samples": 16,
              "fedgp.target-batch-size": 4, "fedgp.warmup-rounds": 1, "fedgp.auto-weight": True},
}


def config(tmp_path, dataset: str, algorithm: str, name: str, **overrides) -> dict:
    cfg = {
        "algorithm": algorithm,
        "dataset": dataset,
        "model": "mlp",
        "num-clients": NUM_CLIENTS,
        "num-server-rounds": 5,
        "fraction-fit": 1.0,
        "fraction-evaluate": 1.0,
        "learning-rate": 0.05,
        "batch-size": 16,
        "partitioner": "iid",
        "test-fraction": 0.25,
        "seed": 5,
        "output-dir": str(tmp_path),
        "run-name": name,
    }
    return cfg | EXTRA[algorithm] | overrides


def serve(grid: InProcessGrid, cfg: dict) -> None:
    """One ServerApp run on ``grid`` (its nodes keep their state from earlier runs)."""
    for context in grid.contexts.values():
        context.run_config = dict(cfg)
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(cfg)))


def new_grid(cfg: dict) -> InProcessGrid:
    return InProcessGrid(client_app, cfg["num-clients"], cfg)


def outcome(tmp_path, name: str) -> dict[str, object]:
    """What must match: metrics.json and clients.json bytes, the summary (without its own
    directory) and every array of the final checkpoint."""
    out = tmp_path / name
    with np.load(out / "checkpoint.npz", allow_pickle=False) as ckpt:
        arrays = {k: ckpt[k] for k in ckpt.files if k != "meta"}
    return {
        "metrics.json": (out / "metrics.json").read_bytes(),
        "clients.json": (out / "clients.json").read_bytes(),
        "summary": (out / "summary.txt").read_text().replace(str(out), "<run>"),
        "arrays": arrays,
    }


def assert_same(a: dict, b: dict) -> None:
    for key in ("metrics.json", "clients.json"):
        if a[key] != b[key]:
            rows_a, rows_b = json.loads(a[key]), json.loads(b[key])
            assert len(rows_a) == len(rows_b), f"{key}: {len(rows_a)} rows != {len(rows_b)}"
            diff = [f"{key}[{i}] {k}: {ra.get(k)!r} != {rb.get(k)!r}" for i, (ra, rb) in enumerate(zip(rows_a, rows_b))
                    for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)]
            raise AssertionError(diff[:10] or f"{key}: same values, different bytes")
    assert a["summary"] == b["summary"]
    assert a["arrays"].keys() == b["arrays"].keys()
    for k in a["arrays"]:
        np.testing.assert_array_equal(a["arrays"][k], b["arrays"][k], err_msg=k)


# (algorithm, fraction-fit, nodes keep their state, kill round, kill point, checkpoint interval)
CASES = [
    ("fedavg", 1.0, False, 2, "end", 1),
    ("fedavg", 0.5, False, 3, "fit", 2),
    ("finetune", 0.5, False, 3, "end", 1),
    ("fedrep", 0.5, True, 3, "end", 1),
    ("feddar-sa", 1.0, False, 2, "end", 1),
    ("feddar-sa", 0.5, False, 3, "head", 2),
    ("pfedfda", 1.0, True, 2, "end", 1),
    ("pfedfda", 0.5, True, 3, "fit", 1),
    ("fedora", 1.0, True, 3, "end", 1),
    ("fedora", 0.5, True, 3, "end", 3),
    ("fmtl", 1.0, False, 2, "end", 1),
    ("fmtl", 0.5, False, 3, "fit", 1),
    ("fedgp", 1.0, False, 3, "evaluate", 2),
]


def check_killed_and_resumed(tmp_path, dataset, monkeypatch, algorithm, fraction, keep_nodes, kill_round, where, interval,
                             killed: dict | None = None, resumed: dict | None = None) -> None:
    """A run killed at ``kill_round`` / ``where`` and resumed (``killed`` / ``resumed``: extra
    run-config keys of each half) ends exactly where an uninterrupted run ends."""
    straight = config(tmp_path, dataset, algorithm, "straight", **{"fraction-fit": fraction})
    serve(new_grid(straight), straight)

    cfg = config(tmp_path, dataset, algorithm, "killed", **{"fraction-fit": fraction, "checkpoint-interval": interval})
    grid = new_grid(cfg)
    with monkeypatch.context() as m:
        kill_at(m, kill_round, where)
        with pytest.raises(Killed):
            serve(grid, cfg | (killed or {}))
    checkpointed = kill_round if where == "end" and kill_round % interval == 0 else (kill_round - 1) // interval * interval
    rows = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["round"] == kill_round  # the killed run had written past its checkpoint ...
    with np.load(tmp_path / "killed" / "checkpoint.npz", allow_pickle=False) as ckpt:
        assert int(ckpt["rounds_done"]) == checkpointed  # ... which is where the resume starts
    serve(grid if keep_nodes else new_grid(cfg), cfg | {"resume": True} | (resumed or {}))
    assert_same(outcome(tmp_path, "straight"), outcome(tmp_path, "killed"))


@pytest.mark.parametrize(("algorithm", "fraction", "keep_nodes", "kill_round", "where", "interval"), CASES)
def test_killed_and_resumed_equals_uninterrupted(tmp_path, dataset, monkeypatch, algorithm, fraction, keep_nodes,
                                                 kill_round, where, interval):
    check_killed_and_resumed(tmp_path, dataset, monkeypatch, algorithm, fraction, keep_nodes, kill_round, where, interval)


def test_eval_every_evaluates_on_its_rounds_and_after_the_last_through_the_app(tmp_path, dataset):
    """``eval-every = 2`` over 5 rounds: every client evaluates in rounds 2, 4 and 5 and in no
    other; fit rows every round; the summary counts three evaluated rounds. Training is what it
    is with an evaluation every round (an evaluation fine-tunes a copy), and so are the shared
    rounds' evaluations."""
    cfg = config(tmp_path, dataset, "finetune", "sparse", **{"fraction-fit": 0.5})
    serve(new_grid(cfg), cfg)
    rows = json.loads((tmp_path / "sparse" / "metrics.json").read_text())
    assert [r["round"] for r in rows if r["phase"] == "evaluate"] == [2, 4, 5]
    assert all(r["num_clients"] == NUM_CLIENTS for r in rows if r["phase"] == "evaluate")
    assert [r["round"] for r in rows if r["phase"] == "fit"] == [1, 2, 3, 4, 5]
    assert "rounds evaluated: 3" in (tmp_path / "sparse" / "summary.txt").read_text()
    every = config(tmp_path, dataset, "finetune", "every", **{"fraction-fit": 0.5, "eval-every": 1})
    serve(new_grid(every), every)
    dense = json.loads((tmp_path / "every" / "metrics.json").read_text())
    assert [r for r in dense if r["phase"] == "fit"] == [r for r in rows if r["phase"] == "fit"]
    assert [r for r in dense if r["phase"] == "evaluate" and r["round"] in (2, 4, 5)] == [
        r for r in rows if r["phase"] == "evaluate"]


def test_finetune_trains_exactly_as_fedavg(tmp_path, dataset):
    """FedAvg + FT is FedAvg's training with a fine-tuned copy at evaluation: over partial
    participation its fit rows equal FedAvg's, and its global model scores what FedAvg's does
    (``global_accuracy`` against FedAvg's ``accuracy``), round by round."""
    runs = {}
    for algorithm in ("fedavg", "finetune"):
        cfg = config(tmp_path, dataset, algorithm, algorithm, **{"fraction-fit": 0.5, "eval-every": 1})
        serve(new_grid(cfg), cfg)
        runs[algorithm] = json.loads((tmp_path / algorithm / "metrics.json").read_text())
    fit = {a: [r for r in rows if r["phase"] == "fit"] for a, rows in runs.items()}
    assert fit["finetune"] == fit["fedavg"]
    evaluated = {a: [r for r in rows if r["phase"] == "evaluate"] for a, rows in runs.items()}
    assert [r["global_accuracy_wmean"] for r in evaluated["finetune"]] == [r["accuracy_wmean"] for r in evaluated["fedavg"]]
    assert [r["global_accuracy_wmean"] for r in evaluated["finetune"]] != [r["accuracy_wmean"] for r in evaluated["finetune"]]


def test_fedgp_target_placement_resumes_between_the_two_server_rounds(tmp_path, dataset, monkeypatch):
    """Under the target placement an FDA round spans two server rounds; a kill after the first
    (the sources' replies are kept on the server, nothing is evaluated) loses nothing."""
    extra = {"fedgp.placement": "target", "num-server-rounds": 5}
    straight = config(tmp_path, dataset, "fedgp", "straight", **extra)
    serve(new_grid(straight), straight)
    cfg = config(tmp_path, dataset, "fedgp", "killed", **extra)
    rows = json.loads((tmp_path / "straight" / "metrics.json").read_text())
    assert not any(r["phase"] == "evaluate" and r["round"] == 2 for r in rows)  # round 2: the sources' half
    with monkeypatch.context() as m:
        kill_at(m, 2, "end")
        with pytest.raises(Killed):
            serve(new_grid(cfg), cfg)
    with np.load(tmp_path / "killed" / "checkpoint.npz", allow_pickle=False) as ckpt:
        pending = [k for k in ckpt.files if k.startswith("array_")]
    assert pending, "the sources' kept models are not in the checkpoint"
    serve(new_grid(cfg), cfg | {"resume": True})
    assert_same(outcome(tmp_path, "straight"), outcome(tmp_path, "killed"))


def test_extending_a_finished_run_equals_the_longer_run(tmp_path, dataset):
    """A finished 3-round run resumed with num-server-rounds=5 ends as a 5-round run does, and
    keeps its first rows."""
    straight = config(tmp_path, dataset, "fedavg", "straight", **{"fraction-fit": 0.5})
    serve(new_grid(straight), straight)
    short = config(tmp_path, dataset, "fedavg", "extended", **{"fraction-fit": 0.5, "num-server-rounds": 3})
    serve(new_grid(short), short)
    first = json.loads((tmp_path / "extended" / "metrics.json").read_text())
    serve(new_grid(short), short | {"num-server-rounds": 5, "resume": True})
    after = json.loads((tmp_path / "extended" / "metrics.json").read_text())
    assert after[: len(first)] == first
    assert_same(outcome(tmp_path, "straight"), outcome(tmp_path, "extended"))


def test_resuming_a_finished_run_rewrites_the_same_summary(tmp_path, dataset):
    cfg = config(tmp_path, dataset, "fedavg", "done", **{"num-server-rounds": 2})
    serve(new_grid(cfg), cfg)
    before = {n: (tmp_path / "done" / n).read_bytes() for n in ("metrics.json", "metrics.csv", "clients.json", "summary.txt")}
    grid = new_grid(cfg)
    serve(grid, cfg | {"resume": True})
    # nothing trained or evaluated: the only contact is the federation-size and wire-layout
    # questions, which carry no arrays
    assert grid.bytes_sent == 0 and grid.bytes_received == 0
    after = {n: (tmp_path / "done" / n).read_bytes() for n in before}
    assert after == before
    assert "rounds evaluated: 2" in after["summary.txt"].decode()


def test_fresh_nodes_restart_personal_state(tmp_path, dataset, monkeypatch):
    """FedRep resumed with fresh nodes: the server's state (the global body) and the rows up to
    the checkpoint are kept, the clients' heads restart from the initial model, so the rounds
    after the resume differ from an uninterrupted run (node-local persistence would keep them)."""
    straight = config(tmp_path, dataset, "fedrep", "straight")
    serve(new_grid(straight), straight)
    cfg = config(tmp_path, dataset, "fedrep", "fresh")
    with monkeypatch.context() as m:
        kill_at(m, 2, "end")
        with pytest.raises(Killed):
            serve(new_grid(cfg), cfg)
    with np.load(tmp_path / "fresh" / "checkpoint.npz", allow_pickle=False) as ckpt:
        body_at_2 = [ckpt[k] for k in sorted(ckpt.files) if k.startswith("global_")]
    serve(new_grid(cfg), cfg | {"resume": True})
    a = json.loads((tmp_path / "straight" / "metrics.json").read_text())
    b = json.loads((tmp_path / "fresh" / "metrics.json").read_text())
    assert [r for r in a if r["round"] <= 2] == [r for r in b if r["round"] <= 2]
    assert [r for r in a if r["round"] == 3] != [r for r in b if r["round"] == 3]  # heads restarted
    assert body_at_2 and all(x.size for x in body_at_2)
