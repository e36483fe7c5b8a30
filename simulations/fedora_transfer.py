"""R-Acc and PTR of every algorithm of a comparison against its LOCAL run (Def. 3.2-3.3).

Reads ``<out>/runs/<algo>-s<seed>/clients.json`` written by ``python -m flwr_pfl.app.compare``
(same data, splits and seeds for every algorithm) and writes ``<out>/transfer.md``:

    python simulations/fedora_transfer.py docs/results/fedora_rotmnist
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from flwr_pfl.core.fedora import transfer_summary


def main(out: Path) -> None:
    runs = out / "runs"
    table = ["| algorithm | seed | Acc (mean over clients) | R-Acc | PTR (>=) | PTR (>) |", "|---|---|---|---|---|---|"]
    for run in sorted(runs.iterdir()):
        algo, seed = run.name.rsplit("-s", 1)
        local_file = runs / f"local-s{seed}" / "clients.json"
        if not local_file.exists():
            continue
        local = {c["partition_id"]: c["accuracy"] for c in json.loads(local_file.read_text())}
        mine = {c["partition_id"]: c["accuracy"] for c in json.loads((run / "clients.json").read_text())}
        keys = sorted(set(local) & set(mine))
        s = transfer_summary(np.array([mine[k] for k in keys]), np.array([local[k] for k in keys]))
        table.append(f"| {algo} | {seed} | {s.mean:.4f} | {s.relative:+.4f} | {s.ptr:.3f} | {s.ptr_strict:.3f} |")
    (out / "transfer.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
