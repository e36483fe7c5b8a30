"""What each selection rule does to FEDORA's large client in the imbalanced setting (Table 5).

Reads the per-client rows (``clients.json``) of the app runs that
``python simulations/reproduce.py fedora-lambda-ablation --scale quick --columns "imbalanced: client 17 large"``
leaves under ``docs/reproduce/results/fedora-lambda-ablation/<scale>/imbalanced_client_17_large/<rule>/runs/``
and prints, per rule and seed, at the last evaluated round: the large client's accuracy and its
R-Acc against its in-run LOCAL model, the mean R-Acc of the other 35 clients, and which clients
end below LOCAL (PTR's losers). Writes them as JSON with ``--out``.

    python simulations/fedora_large_client.py --out docs/reproduce/fedora_large_client.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

RESULTS = Path("docs/reproduce/results/fedora-lambda-ablation")
COLUMN = "imbalanced_client_17_large"


def last_round_rows(run: Path) -> dict[int, dict]:
    """The last evaluated round's per-client rows of one run, by partition id."""
    rows = [r for r in json.loads((run / "clients.json").read_text()) if "r_acc" in r]
    last = max(r["round"] for r in rows)
    return {int(r["partition_id"]): r for r in rows if r["round"] == last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="quick")
    parser.add_argument("--large-client", type=int, default=17)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    big = args.large_client
    found = []
    for rule_dir in sorted((RESULTS / args.scale / COLUMN).iterdir()):
        for run in sorted((rule_dir / "runs").glob("fedora-s*")):
            if not (run / "clients.json").exists():
                continue
            rows = last_round_rows(run)
            others = [r["r_acc"] for k, r in rows.items() if k != big]
            found.append({
                "rule": rule_dir.name, "seed": int(run.name.split("-s")[-1]),
                "large_accuracy": rows[big]["accuracy"], "large_local_accuracy": rows[big]["local_accuracy"],
                "large_r_acc": rows[big]["r_acc"], "others_r_acc": float(np.mean(others)),
                "below_local": sorted(k for k, r in rows.items() if r["r_acc"] < 0),
            })
    print("| rule | seed | large client: Acc (LOCAL) | its R-Acc | others' mean R-Acc | clients below LOCAL |")
    print("|---|---|---|---|---|---|")
    for f in found:
        print(f"| {f['rule']} | {f['seed']} | {f['large_accuracy']:.3f} ({f['large_local_accuracy']:.3f}) "
              f"| {f['large_r_acc']:+.3f} | {f['others_r_acc']:+.4f} | {f['below_local']} |")
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
