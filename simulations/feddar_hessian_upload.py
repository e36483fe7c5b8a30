"""What packing FedDAR-SA's Hessians changes: bytes on the wire and final accuracy.

Runs ``feddar-sa`` on the app's default experiment (Fashion-MNIST, Dirichlet(0.3), the small CNN:
heads of 10 x (128 + 1) = 1,290 parameters, so each Hessian is 1,290 x 1,290) with each
``feddar.hessian-upload`` (``full``, ``packed``, ``packed-float32``) over several seeds, in-process,
and reads each run's ``traffic.json`` and final evaluation.

    python simulations/feddar_hessian_upload.py --seeds 0 1 2

Writes ``<out>/hessian_upload.json`` and ``.md`` (default ``docs/benchmark/feddar``); finished
runs are reused.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

from flwr_pfl.app.appdir import default_run_config
from flwr_pfl.app.compare import run_configs, run_one
from flwr_pfl.app.config import parse_experiment
from flwr_pfl.app.traffic import totals

REPO_ROOT = Path(__file__).resolve().parents[1]
KEY = "accuracy_wmean"
UPLOADS = ("full", "packed", "packed-float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmark" / "feddar")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    base = default_run_config()
    cells = []
    for how in UPLOADS:
        configs = run_configs({**base, "feddar.hessian-upload": how}, ["feddar-sa"], args.seeds,
                              args.out / "runs" / how)["feddar-sa"]
        finals, up = [], []
        for config in configs:
            rows = run_one(config, "inprocess", reuse=True)
            finals.append(float(rows[-1][KEY]))
            traffic = json.loads((parse_experiment(config).output_path() / "traffic.json").read_text())
            up.append(totals(traffic)["bytes_received_per_client_round"])
        cells.append({"hessian_upload": how, "seeds": args.seeds, "final_accuracy": finals,
                      "mean": statistics.mean(finals), "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                      "upload_per_client_round": statistics.mean(up)})
        print(f"{how}: {cells[-1]['mean']:.4f} +- {cells[-1]['std']:.4f}, up {cells[-1]['upload_per_client_round'] / 1e6:.2f} MB",
              flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hessian_upload.json").write_text(json.dumps(cells, indent=1) + "\n")
    full = cells[0]["upload_per_client_round"]
    lines = [
        "# FedDAR-SA: the Hessians on the wire",
        "",
        f"`feddar-sa` on the default experiment (Fashion-MNIST, Dirichlet(0.3), small CNN, {base['num-server-rounds']} "
        f"rounds, 10 clients; heads of 1,290 parameters), seeds {', '.join(map(str, args.seeds))}. Upload: the mean "
        "bytes a client sends per round (all its training messages, `traffic.json`). Accuracy: final-round "
        "example-weighted mean, mean +- std over seeds. Command: `python simulations/feddar_hessian_upload.py "
        f"--seeds {' '.join(map(str, args.seeds))}`.",
        "",
        "| feddar.hessian-upload | upload per client and round (MB) | vs full | final accuracy |",
        "|---|---|---|---|",
    ]
    for c in cells:
        lines.append(f"| {c['hessian_upload']} | {c['upload_per_client_round'] / 1e6:.2f} | "
                     f"{c['upload_per_client_round'] / full:.2f}x | {c['mean']:.4f} +- {c['std']:.4f} |")
    (args.out / "hessian_upload.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
