"""The deployment guide's own-data block (docs/deployment.md), run as written: a SuperLink, two SuperNodes each with
its own .npz file, FedGP role and settings in its node config, and `flwr run`. Only the ports
(free ones here), HOME and FLWR_HOME (private) differ. The block runs in its own process group,
which the fleet fixture kills at the end with every SuperLink / SuperNode it started."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import REPO_ROOT

MARKER = "<!-- own-data-deployment -->"


def guide_block() -> str:
    text = (REPO_ROOT / "docs" / "deployment.md").read_text()
    match = re.search(re.escape(MARKER) + r"\s*```bash\n(.*?)```", text, re.S)
    assert match, f"docs/deployment.md lost its {MARKER} block"
    return match.group(1)


@pytest.mark.slow
def test_the_guide_own_data_deployment_runs_as_written(make_fleet, tmp_path):
    fleet = make_fleet(num_nodes=2, num_partitions=2)
    home = tmp_path / "home"
    home.mkdir()
    fleet.env = {**fleet.env, "HOME": str(home)}
    ports = {"39200": fleet.superlink_port, "39210": fleet.node_ports[0], "39211": fleet.node_ports[1]}
    script = guide_block()
    for old, new in ports.items():
        assert old in script
        script = script.replace(old, str(new))
    (tmp_path / "block.sh").write_text(script)
    proc = subprocess.Popen(["bash", "-e", str(tmp_path / "block.sh")], env=fleet.env, cwd=REPO_ROOT,
                            stdout=(tmp_path / "block.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    fleet.procs["guide-block"] = proc  # its process group (SuperLink, SuperNodes) is killed at the end
    assert proc.wait(timeout=120) == 0, (tmp_path / "block.log").read_text()
    assert "Successfully started run" in (tmp_path / "block.log").read_text()
    status = fleet.wait_for_run("own-data", timeout=600)
    assert status == "finished:completed", (status, (tmp_path / "block.log").read_text()[-4000:])
    out = home / "flwr_pfl_outputs" / "own-data"
    clients = {c["partition_id"]: c for c in json.loads((out / "clients.json").read_text())}
    assert set(clients) == {0, 1} and clients[1].get("is_target") and not clients[0].get("is_target")
    rows = json.loads((out / "metrics.json").read_text())
    assert [r["round"] for r in rows if r["phase"] == "evaluate"] == [1, 2]
