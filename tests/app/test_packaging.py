"""flwr_pfl as an installed package: public names, the app it carries, the launcher's own flwr,
and (slow) a wheel built, installed in a fresh environment and run from another directory."""

from __future__ import annotations

import importlib.metadata
import json
import os
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import flwr_pfl.clients
import flwr_pfl.strategies
from flwr_pfl.app import launch
from flwr_pfl.app.appdir import BUNDLED_APP, CHECKOUT_ROOT, app_dir, default_run_config, is_app_dir
from flwr_pfl.app.config import SIMULATED_CLIENTS
from flwr_pfl.app.registry import ALGORITHMS

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_is_public(name):
    """Its strategy and client are importable by class name from the two public packages."""
    spec = ALGORITHMS[name]
    for package, cls in ((flwr_pfl.strategies, spec.strategy), (flwr_pfl.clients, spec.client)):
        assert cls.__name__ in package.__all__, f"{package.__name__}.__all__ lacks {cls.__name__}"
        assert getattr(package, cls.__name__) is cls


@pytest.mark.parametrize("package", [flwr_pfl.strategies, flwr_pfl.clients], ids=lambda p: p.__name__)
def test_all_lists_only_what_exists(package):
    assert len(set(package.__all__)) == len(package.__all__)
    assert all(hasattr(package, name) for name in package.__all__)


def test_the_checkout_is_the_app_and_its_pyproject_the_default_config():
    assert app_dir() == CHECKOUT_ROOT == REPO_ROOT
    assert not BUNDLED_APP.exists()  # only wheels carry the copy
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert default_run_config()["learning-rate"] == config["tool"]["flwr"]["app"]["config"]["learning-rate"]
    assert default_run_config({"learning-rate": 0.5})["learning-rate"] == 0.5
    with pytest.raises(ValueError, match="no-such-key"):
        default_run_config({"no-such-key": 1})


def test_the_wheel_carries_the_pyproject_and_the_presets():
    """The build configuration puts the app's pyproject.toml where appdir looks for it."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    wheel = config["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["packages"] == ["flwr_pfl"]
    target = wheel["force-include"]["pyproject.toml"]
    assert REPO_ROOT / target == BUNDLED_APP / "pyproject.toml"
    assert (REPO_ROOT / "flwr_pfl" / "py.typed").exists()
    assert is_app_dir(REPO_ROOT) and not is_app_dir(REPO_ROOT / "flwr_pfl")


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_the_launcher_uses_the_flwr_beside_its_interpreter(tmp_path, monkeypatch):
    """Beside sys.executable first, PATH second; and its directory leads the children's PATH."""
    env_bin, other_bin = tmp_path / "venv" / "bin", tmp_path / "other"
    env_bin.mkdir(parents=True)
    other_bin.mkdir()
    _executable(other_bin / "flwr")
    monkeypatch.setenv("PATH", str(other_bin))
    monkeypatch.setattr(sys, "executable", str(env_bin / "python"))
    assert launch.flwr_executable() == other_bin / "flwr"
    ours = _executable(env_bin / "flwr")
    assert launch.flwr_executable() == ours
    env = launch.flwr_env(tmp_path / "home", 40000, ours)
    assert env["PATH"].split(os.pathsep)[:2] == [str(env_bin), str(other_bin)]
    assert env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1" and env["FLWR_HOME"] == str(tmp_path / "home")
    monkeypatch.setenv("PATH", "")
    (env_bin / "flwr").unlink()
    with pytest.raises(FileNotFoundError, match="flwr"):
        launch.flwr_executable()


def test_the_launcher_sizes_the_federation():
    assert launch.federation_size(4, None) == 4
    assert launch.federation_size(4, 4) == 4
    assert launch.federation_size(0, None) == SIMULATED_CLIENTS
    assert launch.federation_size(0, 6) == 6
    with pytest.raises(SystemExit, match="num-clients=4"):
        launch.federation_size(4, 6)


def test_the_launcher_keeps_run_state_out_of_the_installed_package(tmp_path):
    assert launch.default_flwr_home(REPO_ROOT) == REPO_ROOT / ".flwr"
    assert launch.default_flwr_home(tmp_path) == tmp_path / ".flwr"
    assert launch.default_flwr_home(BUNDLED_APP) == Path.home() / ".cache" / "flwr_pfl" / "flwr-home"


# ------------------------------------------------------------------------------- installed wheel
def _console_scripts(dist: str, bin_dir: Path, python: Path) -> None:
    """Write ``dist``'s console scripts into ``bin_dir`` for ``python``, as pip would install them."""
    for entry in importlib.metadata.distribution(dist).entry_points:
        if entry.group != "console_scripts":
            continue
        module, _, attr = entry.value.partition(":")
        script = bin_dir / entry.name
        script.write_text(
            f"#!{python}\nimport sys\nfrom {module} import {attr.split('.')[0]} as _entry\n"
            f"sys.exit(_entry{''.join('.' + a for a in attr.split('.')[1:])}())\n"
        )
        script.chmod(0o755)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel built from this checkout installed in it.

    The heavy dependencies (torch, flwr, ray, ...) are this environment's, reused through a
    ``.pth`` file that names its site-packages (a path line: the checkout's editable-install
    hook there is not run), so nothing is downloaded; Flower's commands are written into the new
    environment's bin from flwr's entry points, as pip writes them, so that they run its Python.
    """
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO_ROOT), "--no-deps", "-q", "-w", str(root / "dist")],
                   check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = (root / "dist").glob("flwr_pfl-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "reused-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    _console_scripts("flwr", venv / "bin", python)
    return venv


def _installed_env() -> dict[str, str]:
    """No checkout on the import path, no environment's bin on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"
    return env


@pytest.mark.slow
def test_the_installed_package_is_complete(installed, tmp_path):
    """It imports from the new environment, carries its app, presets and py.typed."""
    code = ("import json, flwr_pfl, flwr_pfl.app.appdir as a, flwr_pfl.app.presets as p; "
            "print(json.dumps([flwr_pfl.__file__, str(a.app_dir()), str(a.BUNDLED_APP), p.preset_names(), "
            "a.default_run_config()['algorithm']]))")
    out = subprocess.run([str(installed / "bin" / "python"), "-c", code], cwd=tmp_path, env=_installed_env(),
                         check=True, capture_output=True, text=True)
    module, app, bundled, presets, algorithm = json.loads(out.stdout)
    assert Path(module).is_relative_to(installed) and not Path(module).is_relative_to(REPO_ROOT)
    assert app == bundled and (Path(app) / "pyproject.toml").is_file()
    assert "tiny" in presets and algorithm == "fedavg"
    assert (Path(module).parent / "py.typed").is_file()


@pytest.mark.slow
def test_the_installed_compare_and_launcher_run_from_any_directory(installed, tmp_path, data_dir):
    """``python -m flwr_pfl.app.compare`` (in-process) and ``python -m flwr_pfl.app.launch`` (the
    real ``flwr run``) of the installed package, with a preset by name, from a directory that is
    not the checkout and with no environment on PATH."""
    python = str(installed / "bin" / "python")
    data = f"data-dir='{data_dir}'"
    compare = subprocess.run(
        [python, "-m", "flwr_pfl.app.compare", "-c", "tiny", "-c", f"{data} num-server-rounds=1",
         "--algorithms", "fedavg", "fedrep", "--out", "compare"],
        cwd=tmp_path, env=_installed_env(), capture_output=True, text=True, timeout=600,
    )
    assert compare.returncode == 0, compare.stdout[-3000:] + compare.stderr[-3000:]
    assert (tmp_path / "compare" / "comparison.md").exists()
    assert (tmp_path / "compare" / "runs" / "fedrep-s0" / "model.pt").exists()

    result = subprocess.run(
        [python, "-m", "flwr_pfl.app.launch", "-c", "tiny", "-c", f"{data} output-dir='outputs' run-name='launched'",
         "--flwr-home", str(tmp_path / "flwr-home"), "--port", "39497"],
        cwd=tmp_path, env=_installed_env(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "run status: finished:completed" in result.stdout
    command = next(line for line in result.stdout.splitlines() if line.startswith("$ "))
    # the installed app (its pyproject.toml alone) is staged without the checkout's FAB patterns
    staged = tmp_path / "flwr-home" / "app" / "flower_app"
    assert command.startswith(f"$ {installed / 'bin' / 'flwr'} run {staged} ")
    assert "fab-include" not in (staged / "pyproject.toml").read_text()
    assert "[tool.flwr.app.components]" in (staged / "pyproject.toml").read_text()
    out = tmp_path / "outputs" / "launched"  # output-dir relative to where the launcher ran
    assert json.loads((out / "config.json").read_text())["num-clients"] == 3
    assert (out / "model.pt").exists() and (out / "summary.txt").exists()


def test_the_fab_carries_the_package_and_stays_under_flowers_size_limit(tmp_path):
    """``flwr run`` against a SuperLink ships the checkout as a FAB, which Flower refuses over
    10 MB: the committed result tables must stay out of it, the package and its presets in."""
    import zipfile

    from flwr.common.constant import FAB_MAX_SIZE

    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home"), "FLWR_TELEMETRY_ENABLED": "0"}
    flwr = Path(sys.executable).with_name("flwr")
    built = subprocess.run([str(flwr), "build", "--app", str(REPO_ROOT)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    (fab,) = tmp_path.glob("*.fab")
    assert fab.stat().st_size < FAB_MAX_SIZE / 4, f"{fab.stat().st_size} bytes"
    names = zipfile.ZipFile(fab).namelist()
    assert "flwr_pfl/app/server_app.py" in names and "flwr_pfl/presets/feddar_synthetic.toml" in names
    assert not [n for n in names if n.startswith(("docs/", "tests/", "simulations/"))]


def test_the_constraints_file_pins_every_dependency_within_its_range():
    """constraints.txt records the environment of the committed results: every distribution
    pyproject.toml asks for (required and extras) is pinned there, to a version its range allows."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    wanted = [r for r in wanted if canonicalize_name(r.name) != canonicalize_name(project["name"])]
    pinned = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pinned[canonicalize_name(name)] = version
    for requirement in wanted:
        version = pinned.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement.name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(version, prereleases=True), (requirement, version)


def test_compare_checks_its_command_line_without_the_training_stack():
    """``compare --help`` and a bad option answer without importing torch, Ray or the datasets'
    stack (3.4 s and 548 MB before; docs/benchmark/entry_points.md); a run imports them then."""
    probe = ("import sys\nfrom flwr_pfl.app import compare\n"
             "for argv in (['--help'], ['--engine', 'tpu']):\n"
             "    try:\n        compare.main(argv)\n    except SystemExit:\n        pass\n"
             "print(sorted(m for m in ('torch', 'ray', 'datasets', 'matplotlib', 'flwr_pfl.app.config') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert "invalid choice: 'tpu'" in done.stderr


def test_the_launcher_does_not_import_the_training_stack():
    """It only prepares and submits a run: no torch, Ray or dataset stack (2 s and 690 MB before;
    docs/benchmark/entry_points.md)."""
    probe = ("import sys, flwr_pfl.app.launch\n"
             "print(sorted(m for m in ('torch', 'ray', 'datasets', 'matplotlib', 'flwr_pfl.app.config') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ------------------------------------------------------------------------------ submitting to a deployment
def test_a_deployment_submission_refuses_an_unknown_key_by_name_before_any_flwr_command(monkeypatch):
    """A SuperLink answers an unknown run-config key only with ``[code: 15] Invalid run
    configuration.``; the launcher names it, with the nearest known key, and submits nothing."""
    monkeypatch.setattr(launch.subprocess, "run", lambda *a, **k: pytest.fail(f"a command ran: {a}"))
    with pytest.raises(SystemExit, match=r"unknown key\(s\) \['num-clinets'\].*'num-clinets': did you mean 'num-clients'\?"):
        launch.main(["--federation", "fleet", "-c", "num-clinets=3"])


def test_a_deployment_submission_refuses_a_bad_value_naming_the_key(monkeypatch):
    monkeypatch.setattr(launch.subprocess, "run", lambda *a, **k: pytest.fail(f"a command ran: {a}"))
    with pytest.raises(SystemExit, match=r"refused before submitting: .*\(run config learning-rate\) must be > 0"):
        launch.main(["--federation", "fleet", "-c", "learning-rate=-1"])


def test_a_deployment_submission_runs_flwr_on_the_named_federation_and_reads_its_status(monkeypatch, tmp_path):
    """A checked config goes to ``flwr run <app> <federation> --stream --run-config``, in the
    user's Flower home (where the federation is named), and the exit code follows the run's
    final status on that federation."""
    calls: list[tuple[list[str], dict]] = []

    def fake_run(command, env=None, **kwargs):
        calls.append((list(command), env))
        if command[1] == "list":
            return subprocess.CompletedProcess(command, 0, stdout='{"runs": [{"status": "finished:failed", "created-at": "1"}]}')
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(launch.subprocess, "run", fake_run)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    assert launch.main(["--federation", "fleet", "-c", "num-clients=3 round-timeout=120"]) == 1  # finished:failed
    (run, env), (listed, _) = calls
    assert run[1:2] == ["run"] and run[3:5] == ["fleet", "--stream"] and run[5] == "--run-config"
    assert "\"num-clients\" = 3" in Path(run[6]).read_text() and env["FLWR_HOME"] == str(tmp_path / "home")
    assert listed[1:3] == ["list", "fleet"]
