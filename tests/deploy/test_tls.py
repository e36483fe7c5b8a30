"""The loopback deployment over TLS with SuperNode authentication, from the deployment guide's commands
(docs/deployment.md).

The certificates and keys come from the guide's TLS block (run as written), the `flwr` entry from
that section's `cat >> config.toml` (ports substituted), and every flag the test gives
`flower-superlink` / `flower-supernode` must appear in the guide's TLS commands. Two registered
SuperNodes finish a run; a node with an unregistered key, one without a key and one that does
not trust the CA are refused and exit.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from flwr.cli.flower_config import parse_superlink_connection

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
GUIDE_PORT = "39100"


def deployment_blocks() -> list[str]:
    """The ```bash blocks of the deployment guide (docs/deployment.md)."""
    return re.findall(r"```bash\n(.*?)```", GUIDE.read_text(), re.S)


def block_with(needle: str) -> str:
    blocks = [b for b in deployment_blocks() if needle in b]
    assert len(blocks) == 1, f"expected one docs/deployment.md block with {needle!r}, found {len(blocks)}"
    return blocks[0]


def config_append(block: str) -> str:
    """The block's `mkdir -p ... cat >> .../config.toml <<TOML ... TOML` lines."""
    match = re.search(r'^mkdir -p "\$\{FLWR_HOME.*?^TOML\n', block, re.S | re.M)
    assert match, "docs/deployment.md block has no `cat >> $FLWR_HOME/config.toml` heredoc"
    return match.group(0)


def run_bash(script: str, cwd: Path, env: dict[str, str]) -> None:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("existing", [False, True], ids=["no-config", "flwr-default-config"])
@pytest.mark.parametrize("needle,name", [("# 1. the SuperLink: one HTTP port", "fleet"), ("--enable-supernode-auth", "fleet-tls")])
def test_guide_config_entries_parse_with_and_without_flowers_default_file(make_fleet, tmp_path, existing, needle, name):
    fleet = make_fleet()
    if existing:  # any flwr command writes Flower's default config.toml first
        listed = fleet.flwr("config", "list", "--format", "json")
        assert listed.returncode == 0 and (fleet.flwr_home / "config.toml").exists(), listed.stdout + listed.stderr
    run_bash(config_append(block_with(needle)), tmp_path, fleet.env)
    config = tomllib.loads((fleet.flwr_home / "config.toml").read_text())
    connection = parse_superlink_connection(config["superlink"][name], name)
    assert connection.address == "127.0.0.1:39100"
    if name == "fleet":
        assert connection.insecure
    else:
        assert not connection.insecure and connection.root_certificates == f"{tmp_path}/certs/ca.crt"
    listed = fleet.flwr("config", "list", "--format", "json")
    assert listed.returncode == 0 and name in json.loads(listed.stdout)["superlink"], listed.stdout + listed.stderr


def wait_for_exit(fleet, name: str, timeout: float = 90) -> int:
    proc = fleet.procs[name]
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} was not refused within {timeout:.0f} s: {fleet.log(name)[-2000:]}")


@pytest.mark.slow
def test_tls_with_supernode_authentication_runs_registered_nodes_and_refuses_the_rest(make_fleet, tmp_path, data_dir):
    # nodes 0, 1: registered; 2: a key never registered; 3: no key; 4: does not trust the CA
    fleet = make_fleet(num_nodes=5, num_partitions=2)
    pki = tmp_path / "pki"
    pki.mkdir()
    run_bash(block_with("openssl req"), pki, fleet.env)
    certs, keys = pki / "certs", pki / "keys"
    fleet.superlink_security = [
        "--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.pem"),
        "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth",
    ]
    fleet.supernode_security = ["--root-certificates", str(certs / "ca.crt")]
    key_flag = "--auth-supernode-private-key"
    guide_tls = block_with("--enable-supernode-auth")
    for flag in [*fleet.superlink_security, *fleet.supernode_security, key_flag, "flwr supernode register"]:
        if flag.startswith("--") or flag.startswith("flwr"):
            assert flag in guide_tls, f"docs/deployment.md's TLS commands lack {flag}"
    assert "--insecure" not in guide_tls

    fleet.start_superlink()
    run_bash(config_append(guide_tls).replace(GUIDE_PORT, str(fleet.superlink_port)), pki, fleet.env)
    node_ids = []
    for i in (0, 1):
        registered = fleet.flwr("supernode", "register", str(keys / f"supernode-{i}.pub"), "fleet-tls", "--format", "json")
        assert registered.returncode == 0, registered.stdout + registered.stderr
        reply = json.loads(registered.stdout[registered.stdout.index("{"):])
        assert reply["success"]
        node_ids.append(reply["node-id"])
    for i in (0, 1):
        fleet.start_supernode(i, key_flag, str(keys / f"supernode-{i}"))

    fleet.start("stranger", fleet.supernode_args(2, key_flag, str(keys / "supernode-2"), partition_id=1))
    fleet.start("keyless", fleet.supernode_args(3, partition_id=1))
    fleet.supernode_security = []  # HTTPS with the system's CAs only
    fleet.start("untrusting", fleet.supernode_args(4, key_flag, str(keys / "supernode-1"), partition_id=1))
    refusals = {
        "stranger": "[code: 2004] Failed to activate SuperNode.",
        "keyless": "[code: 2001] SuperNode authentication is enabled. All SuperNodes must be registered via the CLI.",
        "untrusting": "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed",
    }
    for name, reason in refusals.items():
        assert wait_for_exit(fleet, name) != 0, fleet.log(name)[-2000:]
        log = fleet.log(name)
        assert "Exit Code: 305" in log and reason in log, log[-2000:]

    out = tmp_path / "out"
    overrides = (
        f"algorithm='fedavg' dataset='fashion-mnist' data-dir='{data_dir}' max-samples=300 model='mlp' "
        f"num-clients=2 min-clients=2 round-timeout=180.0 wait-timeout=60.0 num-server-rounds=2 "
        f"output-dir='{out}' run-name='run'"
    )
    fleet.submit_run(overrides, "fleet-tls")
    status = fleet.wait_for_run("fleet-tls", timeout=300)
    assert status == "finished:completed", (status, fleet.logs())
    rows = json.loads((out / "run" / "metrics.json").read_text())
    assert [r["round"] for r in rows if r["phase"] == "evaluate"] == [1, 2]
    assert all(r["participant_ids"] == "0 1" for r in rows if r["phase"] in ("fit", "evaluate")), rows

    listed = fleet.flwr("supernode", "list", "fleet-tls", "--format", "json")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    nodes = json.loads(listed.stdout[listed.stdout.index("{"):])["nodes"]
    assert sorted(int(n["node-id"]) for n in nodes) == sorted(node_ids), nodes
