"""The lean node install: ``pip install flwr_pfl`` requires only what a deployed ServerApp and
ClientApp need (flwr, torch, torchvision, numpy); Ray, Flower Datasets, matplotlib, tracking and
privacy accounting are extras. A federation of nodes training on their own files runs with every
extra's packages unimportable, and a feature that needs one names the extra."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
#: the top-level modules only the extras install (and what they pull in: pandas, pyarrow)
EXTRA_MODULES = ("ray", "flwr_datasets", "datasets", "pandas", "pyarrow", "matplotlib", "tensorboard", "mlflow", "wandb",
                 "dp_accounting")


def project() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def names(requirements: list[str]) -> set[str]:
    return {r.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip() for r in requirements}


def test_the_required_dependencies_are_the_nodes_and_everything_else_is_an_extra():
    meta = project()
    assert names(meta["dependencies"]) == {"flwr", "torch", "torchvision", "numpy"}
    assert not any("[" in r for r in meta["dependencies"])  # plain flwr: no Ray
    extras = meta["optional-dependencies"]
    assert names(extras["simulation"]) == {"flwr"} and "simulation" in extras["simulation"][0]
    assert names(extras["datasets"]) == {"flwr-datasets"} and names(extras["plots"]) == {"matplotlib"}
    assert extras["all"] == ["flwr_pfl[simulation,datasets,plots,tracking,privacy]"]
    # what scripts/setup.sh installs for the README's commands: everything, and the site's builder
    assert "flwr_pfl[all,docs]" in extras["test"] and names(extras["docs"]) == {"mkdocs", "mkdocs-material", "mkdocstrings"}
    assert set(extras) >= {"simulation", "datasets", "plots", "tracking", "privacy", "all", "docs", "test"}


#: the extras' modules made absent: ``None`` in ``sys.modules`` makes ``import`` raise
#: ModuleNotFoundError and ``importlib.util.find_spec`` answer None, as for an uninstalled package
BLOCKER = textwrap.dedent(f"""
    import sys
    BLOCKED = {EXTRA_MODULES!r}
    for name in BLOCKED:
        sys.modules[name] = None
""")


def run_blocked(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin",
                                                       "FLWR_TELEMETRY_ENABLED": "0", "HOME": str(cwd)})


def test_nodes_on_their_own_files_run_without_any_extra(tmp_path):
    """Two nodes, each with its own .npz file, a ServerApp and ClientApp in one process; none of
    the extras' modules can be imported. The run completes (no plots: matplotlib is an extra)."""
    import numpy as np

    for name, n, seed in (("a", 30, 1), ("b", 40, 2)):
        rng = np.random.default_rng(seed)
        y = np.arange(n) % 3
        np.savez(tmp_path / f"{name}.npz", x=(rng.normal(size=(n, 8)) + 3 * np.eye(3, 8)[y]).astype(np.float32), y=y)
    out = run_blocked(f"""
        import json, sys
        from flwr.app import Context, RecordDict
        from flwr_pfl.app.client_app import app as client_app
        from flwr_pfl.app.inprocess import InProcessGrid
        from flwr_pfl.app.server_app import app as server_app
        config = {{"algorithm": "fedrep", "model": "mlp", "num-server-rounds": 2, "output-dir": "out", "run-name": "run",
                   "wait-timeout": 5.0, "learning-rate": 0.2, "batch-size": 8}}
        grid = InProcessGrid(client_app, 2, config)
        for i, (context, path) in enumerate(zip(grid.contexts.values(), {[str(tmp_path / "a.npz"), str(tmp_path / "b.npz")]!r})):
            context.node_config = {{"partition-id": i, "num-partitions": 2, "data-path": path}}
        server_app(grid, Context(run_id=1, node_id=0, node_config={{}}, state=RecordDict(), run_config=config))
        print("LOADED", json.dumps(sorted(m for m, v in sys.modules.items() if m.split(".")[0] in BLOCKED and v)))
    """, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED []" in out.stdout
    status = json.loads((tmp_path / "out" / "run" / "summary.json").read_text())
    assert status["status"] == "completed"
    assert not (tmp_path / "out" / "run" / "learning_curves.png").exists()
    assert "no plots for this run" in out.stderr and 'flwr_pfl[plots]' in out.stderr


def test_features_that_need_an_extra_name_it(tmp_path):
    out = run_blocked("""
        from flwr_pfl.errors import MissingExtraError
        for what in ("flwr_pfl.data.partitioners", "flwr_pfl.app.plots"):
            try:
                __import__(what)
            except MissingExtraError as err:
                print("ERR", what, err)
        from flwr_pfl.app.simulation import run_ray_simulation
        try:
            run_ray_simulation({}, 2)
        except MissingExtraError as err:
            print("ERR ray", err)
    """, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("ERR")]
    assert len(lines) == 3, out.stdout
    assert "partitioning a dataset among simulated clients" in lines[0] and 'flwr_pfl[datasets]' in lines[0]
    assert "plotting learning curves" in lines[1] and 'flwr_pfl[plots]' in lines[1]
    assert "Ray simulation engine" in lines[2] and 'flwr_pfl[simulation]' in lines[2]
