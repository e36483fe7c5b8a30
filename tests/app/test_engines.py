"""The same apps through Flower's real engines: the Ray simulation and `flwr run .`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flwr_pfl.app.registry import ALGORITHMS

REPO_ROOT = Path(__file__).resolve().parents[2]


def tiny(data_dir: Path, out: Path, **extra) -> dict:
    return {
        "dataset": "fashion-mnist",
        "data-dir": str(data_dir),
        "max-samples": 900,
        "model": "mlp",
        "num-clients": 3,
        "num-server-rounds": 2,
        "output-dir": str(out),
        "run-name": "run",
        **extra,
    }


@pytest.mark.slow
def test_ray_simulation_engine(tmp_path, data_dir):
    from flwr_pfl.app.simulation import run_ray_simulation

    run_ray_simulation(tiny(data_dir, tmp_path, algorithm="fedrep"), num_clients=3, total_cpus=2)
    rows = json.loads((tmp_path / "run" / "metrics.json").read_text())
    evaluations = [r for r in rows if r["phase"] == "evaluate"]
    assert [r["round"] for r in evaluations] == [1, 2]
    # this config with "seed" 0-7 on the in-process engine: 0.633..0.694
    assert evaluations[-1]["num_clients"] == 3.0 and evaluations[-1]["accuracy_wmean"] > 0.3


def launch(tmp_path: Path, cfg: dict) -> subprocess.CompletedProcess:
    """Run the launcher (the real `flwr run .`) with ``cfg`` as overrides, privately."""
    overrides = " ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={v}" for k, v in cfg.items())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "flwr_pfl.app.launch", "--flwr-home", str(tmp_path / "flwr-home"),
         "--port", "39391", "-c", overrides],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.mark.slow
def test_flwr_run_end_to_end(tmp_path, data_dir):
    """The real `flwr run .` via the launcher: it must finish and write its results."""
    cfg = tiny(data_dir, tmp_path)
    result = launch(tmp_path, cfg)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "run status: finished:completed" in result.stdout
    out = tmp_path / "run"
    for name in ("config.json", "metrics.csv", "clients.csv", "learning_curves.png", "summary.txt"):
        assert (out / name).exists(), name
    assert json.loads((out / "config.json").read_text())["num-clients"] == 3


@pytest.mark.slow
def test_flwr_run_reports_a_failed_app(tmp_path, data_dir):
    """A bad value stops the ServerApp; `flwr run` exits 0 anyway, the launcher must not."""
    cfg = tiny(data_dir, tmp_path, **{"learning-rate": -1.0})
    result = launch(tmp_path, cfg)
    assert result.returncode == 1
    assert "learning-rate" in result.stdout + result.stderr
    assert "finished:failed" in result.stdout


def partial(data_dir: Path, out: Path, name: str, algorithm: str) -> dict:
    """Six clients, half of them sampled per round for fit and for evaluation."""
    return tiny(data_dir, out, algorithm=algorithm, **{
        "num-clients": 6, "num-server-rounds": 3, "max-samples": 1200, "fraction-fit": 0.5,
        "fraction-evaluate": 0.5, "seed": 2, "run-name": name,
    })


DOMAIN_ALGORITHMS = ("feddar", "feddar-sa", "feddar-wa", "separate-fedavg", "fedavg-rw", "fedavg-mh")
TARGET_ALGORITHMS = ("fedgp", "fedda", "target-only", "source-only")


def family(algorithm: str) -> dict:
    """What an algorithm's family needs on top of :func:`partial` (domains, tasks, a target)."""
    if algorithm == "fmtl":
        return {"partitioner": "pathological", "classes-per-client": 2, "fmtl.t1-rounds": 2}
    if algorithm in DOMAIN_ALGORITHMS:
        return {"domain-transform": "rotation", "num-domains": 3, "partitioner": "domain-mixture",
                "domain-alpha": 1.0, "samples-per-client": 100, "feddar.head-epochs": 1}
    if algorithm in TARGET_ALGORITHMS:  # full participation (the paper's protocol); evaluation sampled
        extra = {f"{algorithm}.warmup-rounds": 1, f"{algorithm}.auto-weight": True} if algorithm in ("fedgp", "fedda") else {}
        return {"domain-transform": "rotation", "num-domains": 3, "partitioner": "one-domain-per-client",
                "num-clients": 3, "fraction-fit": 1.0, f"{algorithm}.target-train-samples": 16,
                f"{algorithm}.target-batch-size": 4, **extra}
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedavg", "pfedfda", "fedora", "fmtl", "feddar-sa", "fedgp"])
def test_ray_reruns_are_identical_and_equal_to_the_inprocess_engine(tmp_path, data_dir, algorithm):
    """Partial participation on Ray, twice, and in-process: three byte-identical metrics.json.

    Ray runs each client in an actor process and answers in whatever order the actors finish;
    the same numbers come out because sampling is drawn by partition id from the strategy's
    own generator and replies are summed in partition order.
    """
    from flwr_pfl.app.client_app import app as client_app
    from flwr_pfl.app.inprocess import run_inprocess
    from flwr_pfl.app.server_app import app as server_app
    from flwr_pfl.app.simulation import run_ray_simulation

    def config(name: str) -> dict:
        return partial(data_dir, tmp_path, name, algorithm) | family(algorithm)

    clients = config("x")["num-clients"]
    for name in ("ray-a", "ray-b"):
        run_ray_simulation(config(name), num_clients=clients, total_cpus=2)
    run_inprocess(server_app, client_app, clients, config("inprocess"))
    files = {name: (tmp_path / name / "metrics.json").read_bytes() for name in ("ray-a", "ray-b", "inprocess")}
    rows = json.loads(files["ray-a"])
    phase = "evaluate" if algorithm == "fedgp" else "fit"  # FedGP trains every client (the paper's protocol)
    assert min(r["num_clients"] for r in rows if r["phase"] == phase) < clients, "no round sampled part of the clients"
    assert files["ray-a"] == files["ray-b"] == files["inprocess"]


@pytest.mark.slow
def test_flwr_run_reruns_are_identical(tmp_path, data_dir):
    """The real `flwr run .` twice with partial participation: identical metrics.json, equal
    to the in-process engine's on the same config (pyproject's defaults plus the overrides)."""
    from flwr.common.config import get_fused_config_from_dir

    from flwr_pfl.app.client_app import app as client_app
    from flwr_pfl.app.inprocess import run_inprocess
    from flwr_pfl.app.server_app import app as server_app

    for name in ("a", "b"):
        result = launch(tmp_path, partial(data_dir, tmp_path, name, "fedavg"))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    fused = dict(get_fused_config_from_dir(REPO_ROOT, partial(data_dir, tmp_path, "inprocess", "fedavg")))
    run_inprocess(server_app, client_app, 6, fused)
    a, b, c = ((tmp_path / name / "metrics.json").read_bytes() for name in ("a", "b", "inprocess"))
    assert a == b == c


TWICE_ON_RAY = ("fedavg", "pfedfda", "fedora", "fmtl", "feddar-sa", "fedgp")


def one_per_client_class() -> list[str]:
    """The first registered algorithm of every client class not run twice above.

    What an engine changes is where and how the clients run (Ray actors in other processes,
    ``context.state`` carried between them, the order replies arrive in); the strategy runs in
    the ServerApp's process on every engine. So every client class runs on Ray, and the
    variants that share their family's client and differ only in server arithmetic (FedDAR's
    ``feddar`` / ``feddar-wa`` beside ``feddar-sa``; FedGP's ``fedda``, ``target-only`` and
    ``source-only``; ``fedavg-mh`` beside ``fedavg-rw``) are covered by their family's run.
    """
    covered = {ALGORITHMS[name].client for name in TWICE_ON_RAY}
    chosen = []
    for name, spec in ALGORITHMS.items():
        if spec.client not in covered:
            covered.add(spec.client)
            chosen.append(name)
    return sorted(chosen)


def test_every_client_class_is_run_on_ray():
    """No client class escapes the engine tests (a new algorithm with a new client is picked up)."""
    ran = set(TWICE_ON_RAY) | set(one_per_client_class())
    assert {spec.client for spec in ALGORITHMS.values()} == {ALGORITHMS[name].client for name in ran}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", one_per_client_class())
def test_every_other_algorithm_gives_the_inprocess_numbers_on_ray(tmp_path, data_dir, algorithm):
    """Each client class not run twice above (:func:`one_per_client_class`): once on Ray,
    byte-identical to the in-process engine (whose reruns tests/app/test_reruns.py checks for
    every algorithm)."""
    from flwr_pfl.app.client_app import app as client_app
    from flwr_pfl.app.inprocess import run_inprocess
    from flwr_pfl.app.server_app import app as server_app
    from flwr_pfl.app.simulation import run_ray_simulation

    ray_config = partial(data_dir, tmp_path, "ray", algorithm) | family(algorithm)
    run_ray_simulation(ray_config, num_clients=ray_config["num-clients"], total_cpus=2)
    run_inprocess(server_app, client_app, ray_config["num-clients"], ray_config | {"run-name": "inprocess"})
    assert (tmp_path / "ray" / "metrics.json").read_bytes() == (tmp_path / "inprocess" / "metrics.json").read_bytes()
