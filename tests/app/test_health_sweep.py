"""simulations/health_sweep.py --quick: every registered algorithm ends above chance on the tiny
preset, with no failed client.

The tiny preset (3 IID clients of 240 training images, an MLP, 3 rounds, seed 0) takes a few
seconds per algorithm (FedDAR-SA's second-order head aggregation, in ``feddar`` and
``feddar-sa``, about a minute each). Measured over seeds 0-2, the healthy algorithms end
between 0.42 and 0.71 accuracy on 10 classes; the script's margin for this setting (+0.25 above
chance 0.10, so 0.35) leaves them 0.07 to spare and fails a run whose training loss climbs in
the second round (one such FedDAR-SA run ended at 0.24).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flwr_pfl.app.registry import ALGORITHMS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "simulations" / "health_sweep.py"


@pytest.mark.slow
def test_quick_sweep_every_algorithm_healthy_on_tiny(tmp_path: Path, data_dir: Path) -> None:
    out = tmp_path / "health"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "-c", f"data-dir='{data_dir}'"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    report_path = out / "health.json"
    assert report_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())

    tiny = report["settings"]["tiny"]
    assert tiny["status"] == "run"
    assert tiny["chance"] == pytest.approx(0.1)
    assert tiny["margin"] >= 0.2  # well above chance: a model that barely moves does not pass

    cells = {c["algorithm"]: c for c in report["cells"].values() if c["setting"] == "tiny"}
    assert set(cells) == set(ALGORITHMS), "every registered algorithm is swept"
    for cell in cells.values():
        assert cell["seeds"] == [0] and cell["rounds"] == 3
    assert (out / "health.md").read_text().count("| tiny |") == len(ALGORITHMS)

    failing = {
        name: "; ".join(c["reasons"]) for name, c in cells.items() if c["verdict"] != "PASS"
    }
    assert not failing, f"unhealthy on the tiny preset: {failing}"
    assert all(c["num_failures"] == 0 and c["num_rejected"] == 0 and c["num_dropped"] == 0 for c in cells.values())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
