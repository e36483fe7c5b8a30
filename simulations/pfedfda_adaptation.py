"""Where pFedFDA's personalized model loses to fine-tuning: in its features or in its head?

pFedFDA personalizes only the classifier: each client keeps the global backbone and builds a
linear head from Gaussian class statistics interpolated between its own and the global ones
(Eq. 3-4). FedAvg + FT trains the whole global model for a few epochs on the client's data.
Where fine-tuning wins on some domain, this separates the two parts. For each finished run folder
(pFedFDA, FedAvg + FT or any algorithm whose ``model.pt`` holds the shared encoder) it rebuilds
every client's final model as exported (``model.pt`` and ``clients/<pid>.pt``, docs/export.md)
and scores it on the client's test split:

* ``as run``: the exported personalized model (equal to the run's ``clients.json`` accuracy;
  checked);
* ``global-statistics head`` (pFedFDA only): the generative head of the global statistics alone
  (beta = 0; ``extras.pt``) with the client's label priors;
* ``new linear head``: the run's global encoder, frozen, under a zero-initialised linear head
  trained on the client's training split (``--probe-epochs`` epochs of the run's optimizer and
  batch; the suite's :func:`flwr_pfl.training.train`, seeded per client): how well a trained
  linear classifier does on the same features.

Per domain: the mean over a run's clients, then the mean and spread over runs of the same
algorithm (seeds).

    python simulations/pfedfda_adaptation.py \\
        docs/reproduce/results/pfedfda/paper/covariate_shift_25_training_data/pFedFDA/runs/pfedfda-s* \\
        docs/reproduce/results/pfedfda/paper/covariate_shift_25_training_data/FedAvg_+_FT/runs/finetune-s* \\
        --out docs/reproduce/pfedfda_adaptation.json

The run folders are what ``simulations/reproduce.py`` leaves under ``.../<method>/runs/``
(not committed: rerun the table's runs to have them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flwr_pfl.app.config import parse_experiment
from flwr_pfl.core.pfedfda import label_priors, lda_head
from flwr_pfl.data.federated import load_client_data
from flwr_pfl.models import build_model
from flwr_pfl.models.base import EncoderHeadModel
from flwr_pfl.training import client_seed, evaluate, seeded, set_num_threads, train


sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce_report import mean_std  # noqa: E402

WAYS = ("as run", "global-statistics head", "new linear head")


def client_scores(run_dir: Path, partition_id: int, probe_epochs: int) -> dict[str, Any]:
    """Client ``partition_id``'s test accuracy under each of :data:`WAYS` that applies, and its domain."""
    experiment = parse_experiment(json.loads((run_dir / "config.json").read_text()))
    data = load_client_data(experiment.data, partition_id, experiment.run.num_clients)
    shared = torch.load(run_dir / "model.pt", weights_only=True)
    personal = run_dir / "clients" / f"{partition_id}.pt"
    device = torch.device("cpu")

    def fresh() -> EncoderHeadModel:
        return build_model(experiment.run.model, data.input_shape, data.num_outputs, feature_dim=experiment.run.feature_dim)

    def score(model: EncoderHeadModel) -> float:
        return evaluate(model, data.test, device=device, num_domains=data.num_domains).accuracy

    scores: dict[str, Any] = {"partition_id": partition_id, "domain": int(data.test.domain[0])}
    if personal.exists():
        model = fresh()
        model.load_state_dict(shared | torch.load(personal, weights_only=True))
        scores["as run"] = score(model)
    encoder = {k: v for k, v in shared.items() if k.startswith("encoder.")}
    extras = run_dir / "extras.pt"
    if extras.exists():
        statistics = torch.load(extras, weights_only=True)
        weight, bias = lda_head(statistics["pfedfda:means"], statistics["pfedfda:covariance"],
                                label_priors(data.train.y, data.num_outputs))
        model = fresh()
        model.load_state_dict(encoder | {"heads.0.weight": weight, "heads.0.bias": bias})
        scores["global-statistics head"] = score(model)
    model = fresh()
    model.load_state_dict(encoder, strict=False)
    for parameter in model.heads.parameters():
        torch.nn.init.zeros_(parameter)
    config = experiment.train_config
    with seeded(client_seed(experiment.run.seed, partition_id)):
        train(model, data.train.loader(config.batch_size, shuffle=True), optimizer=config.optimizer, device=device,
              epochs=probe_epochs, groups=("heads",), who=f"partition {partition_id}")
    scores["new linear head"] = score(model)
    return scores


def measure(run_dirs: list[Path], probe_epochs: int) -> dict[str, Any]:
    """Every client of every run (``as run`` checked against the run's own ``clients.json``), and
    per algorithm and domain the mean over a run's clients, then mean, std and per-run values over
    the runs."""
    per_run = []
    for run_dir in run_dirs:
        algorithm = json.loads((run_dir / "config.json").read_text())["algorithm"]
        reported = {c["partition_id"]: c["accuracy"] for c in json.loads((run_dir / "clients.json").read_text())}
        clients = [client_scores(run_dir, pid, probe_epochs) for pid in sorted(reported)]
        for c in clients:
            if "as run" in c and abs(c["as run"] - reported[c["partition_id"]]) > 1e-6:
                raise SystemExit(f"{run_dir}: client {c['partition_id']} scores {c['as run']:.6f} as exported but "
                                 f"{reported[c['partition_id']]:.6f} in clients.json: not the model the run evaluated")
        per_run.append({"run": run_dir.name, "algorithm": algorithm, "clients": clients})
    summary: dict[str, dict[int, dict[str, Any]]] = {}
    for algorithm in dict.fromkeys(r["algorithm"] for r in per_run):
        runs = [r for r in per_run if r["algorithm"] == algorithm]
        for d in sorted({c["domain"] for r in runs for c in r["clients"]}):
            for way in WAYS:
                values = [float(np.mean([c[way] for c in r["clients"] if c["domain"] == d and way in c])) for r in runs
                          if any(way in c for c in r["clients"])]
                if values:
                    mean, std = mean_std(values)
                    summary.setdefault(algorithm, {}).setdefault(d, {})[way] = {"mean": mean, "std": std,
                                                                                "per_run": values}
    return {"probe_epochs": probe_epochs, "runs": per_run, "by_algorithm_and_domain": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run folders (config.json, model.pt, clients/)")
    parser.add_argument("--probe-epochs", type=int, default=100, help="epochs of the new linear head")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    set_num_threads(1)
    found = measure(args.runs, args.probe_epochs)
    print("| algorithm | domain | " + " | ".join(WAYS) + " |  (test accuracy: mean over a run's clients, then over runs)")
    print("|---|---|" + "---|" * len(WAYS))
    for algorithm, domains in found["by_algorithm_and_domain"].items():
        for d, ways in domains.items():
            cells = [f"{ways[w]['mean']:.3f} ± {ways[w]['std']:.3f}" if w in ways else "-" for w in WAYS]
            print(f"| {algorithm} | {d} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
