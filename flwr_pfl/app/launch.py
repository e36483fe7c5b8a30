"""Run the app through the real ``flwr run .``, safely, and report whether it succeeded.

``python -m flwr_pfl.app.launch [-c OVERRIDES]...`` does what a careful user would type by hand:

* runs the ``flwr`` of its own Python environment (beside its interpreter, before ``PATH``, whose
  directory it also puts first on the ``PATH`` of the processes ``flwr`` starts), so that
  ``.venv/bin/python -m flwr_pfl.app.launch`` works without activating the environment;
* runs the suite's Flower App from a source checkout or, installed from a wheel, from the copy
  of the app that the package carries (:mod:`flwr_pfl.app.appdir`), from any directory;
* sets the environment ``flwr run`` needs offline (no per-run dependency install, which would
  fetch torch again; no telemetry; no update check);
* sizes the simulated federation from the run config (``num-supernodes = num-clients``, or
  ``--num-supernodes`` when ``num-clients`` is 0, the federation's size) and gives each client
  ``--cpus`` CPUs and ``--gpus`` of a GPU;
* hands ``flwr run`` a clean copy of the app (``pyproject.toml`` and the app's packages, under
  ``<flwr-home>/app``), so the bundle it builds skips virtual environments, outputs and tests;
* uses a private Flower home and port, so no SuperLink left over from another project (with
  another environment) is reused, and stops the SuperLink it started when the run ends;
* checks the run's final status with ``flwr list`` (``flwr run`` exits 0 even when the app
  failed) and exits non-zero unless the run finished successfully.

``--federation NAME`` submits to a deployment instead: the SuperLink that ``NAME`` names in the
Flower home's ``config.toml`` (``$FLWR_HOME``, default ``~/.flwr``), with its SuperNodes. The
run config is checked here first, keys and values, and a bad one is refused naming the key and
what is allowed: a SuperLink answers an unknown key only with ``[code: 15] Invalid run
configuration.``, the key itself in its own log. The run is then followed (``--stream``) and its
final status read back as in simulation; nothing is started or stopped locally. A run that trained nothing
  (every client failed in a round, or a diverged run left at chance) is a failed run too: the
  ServerApp raises once its results are written (:func:`flwr_pfl.app.results.judge_run`; the
  run key ``fail-on-no-training = false`` keeps such a run completed).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from flwr_pfl.app.appdir import BUNDLED_APP, SIMULATED_CLIENTS, app_dir, default_run_config
from flwr_pfl.app.overrides import parse_overrides, to_toml
from flwr_pfl.app.staging import stage_app, stage_bundled_app

SAFE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


def flwr_executable() -> Path:
    """The ``flwr`` command of this Python environment (beside ``sys.executable``), else the
    first on ``PATH``.

    Raises:
        FileNotFoundError: there is none, with what to install.
    """
    beside = Path(sys.executable).parent / "flwr"  # not resolved: a venv's python is a symlink
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("flwr")
    if found is None:
        raise FileNotFoundError(
            f"no 'flwr' command beside {sys.executable} nor on PATH; install Flower in this "
            "environment: pip install \"flwr[simulation]>=1.41,<1.43\""
        )
    return Path(found)


def flwr_env(flwr_home: Path, port: int, flwr: Path | None = None) -> dict[str, str]:
    """The environment for ``flwr`` commands: safe defaults, a private home and ports, and
    ``flwr``'s directory first on ``PATH`` (``flwr`` starts ``flower-superlink``, which starts
    further Flower commands, by name)."""
    bin_dir = str((flwr or flwr_executable()).parent)
    path = os.environ.get("PATH", "")
    return {
        **os.environ,
        **SAFE_ENV,
        "PATH": bin_dir + (os.pathsep + path if path else ""),
        "FLWR_HOME": str(flwr_home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(port + 1),
    }


def default_flwr_home(app: Path) -> Path:
    """``<app>/.flwr``, except for the app that the installed package carries (inside
    site-packages, no place for run state): ``~/.cache/flwr_pfl/flwr-home``."""
    if app.resolve() == BUNDLED_APP.resolve():
        return Path.home() / ".cache" / "flwr_pfl" / "flwr-home"
    return app / ".flwr"


def federation_size(num_clients: int, num_supernodes: int | None) -> int:
    """SuperNodes to simulate: ``num-clients``, or ``--num-supernodes`` (default
    :data:`~flwr_pfl.app.config.SIMULATED_CLIENTS`) when ``num-clients`` is 0.

    Raises:
        SystemExit: both are given and differ.
    """
    if num_clients > 0:
        if num_supernodes is not None and num_supernodes != num_clients:
            raise SystemExit(
                f"--num-supernodes={num_supernodes} disagrees with num-clients={num_clients}; "
                "drop one, or set num-clients=0 (the federation's size)"
            )
        return num_clients
    return num_supernodes if num_supernodes is not None else SIMULATED_CLIENTS


def stop_superlink(flwr_home: Path, timeout: float = 15.0) -> None:
    """Stop the SuperLink (and its SuperExec) that ``flwr run`` started under ``flwr_home``, and
    wait up to ``timeout`` seconds for it to exit: until then it holds its port, and the next
    ``flwr`` command on that port would use it instead of starting its own."""
    result = subprocess.run(["pgrep", "-f", f"flower-superlink.*{flwr_home}"], capture_output=True, text=True)
    pids = [int(pid) for pid in result.stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        if pids:
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True


def last_run_status(env: dict[str, str], flwr: Path | str = "flwr", federation: str | None = None) -> str:
    """Status of the newest run on the local SuperLink (or ``federation``'s), e.g.
    ``finished:completed``."""
    where = [federation] if federation else []
    out = subprocess.run([str(flwr), "list", *where, "--format", "json"], env=env, capture_output=True, text=True)
    try:
        runs = json.loads(out.stdout).get("runs", [])
    except json.JSONDecodeError:
        return f"unknown ({out.stdout.strip() or out.stderr.strip()})"
    if not runs:
        return "unknown (no runs listed)"
    newest = max(runs, key=lambda r: str(r.get("created-at", "")))
    return str(newest.get("status", "unknown"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--run-config", action="append", default=[], help="'k=v k2=v2', a TOML file, or a shipped preset's name (e.g. tiny); repeatable, later wins")
    parser.add_argument("--app", type=Path, default=None,
                        help="the Flower App directory (default: this checkout, or the app the installed package carries)")
    parser.add_argument("--num-supernodes", type=int, default=None,
                        help=f"simulated clients when num-clients is 0 (default {SIMULATED_CLIENTS}); otherwise num-clients")
    parser.add_argument("--cpus", type=int, default=1, help="CPUs per simulated client (default 1)")
    parser.add_argument("--gpus", type=float, default=0.0, help="fraction of a GPU per simulated client (e.g. 0.25)")
    parser.add_argument("--flwr-home", type=Path, default=None,
                        help="Flower home (default: <app>/.flwr in a checkout, else ~/.cache/flwr_pfl/flwr-home)")
    parser.add_argument("--port", type=int, default=39291, help="private SuperLink HTTP port (default 39291)")
    parser.add_argument("--keep-superlink", action="store_true", help="leave the SuperLink running afterwards")
    parser.add_argument("--no-stage", action="store_true", help="run the app directory itself, not a clean copy of it")
    parser.add_argument("--federation", default=None,
                        help="submit to this deployment (a SuperLink named in $FLWR_HOME/config.toml) instead of simulating")
    args = parser.parse_args(argv)
    if args.federation is not None:
        return submit(args)

    app = (args.app or app_dir()).resolve()
    flwr_home = (args.flwr_home or default_flwr_home(app)).resolve()
    flwr_home.mkdir(parents=True, exist_ok=True)
    flwr = flwr_executable()
    env = flwr_env(flwr_home, args.port, flwr)
    overrides = parse_overrides(args.run_config)
    config = default_run_config(overrides, app)
    supernodes = federation_size(int(config["num-clients"]), args.num_supernodes)
    federation = f"num-supernodes={supernodes} client-resources-num-cpus={args.cpus} client-resources-num-gpus={args.gpus}"
    command = flwr_run_command(flwr, app, overrides, flwr_home / "app", flwr_home / "run-config.toml", args.no_stage,
                               "--stream", "--federation-config", federation)
    print(f"$ {' '.join(command)}", flush=True)
    try:
        # From the caller's directory: the SuperLink (and so the ServerApp) resolves relative
        # paths such as output-dir against its working directory.
        code = subprocess.run(command, env=env).returncode
        status = last_run_status(env, flwr) if code == 0 else f"flwr run exited with {code}"
    finally:
        if not args.keep_superlink:
            stop_superlink(flwr_home)
    print(f"run status: {status}", flush=True)
    return 0 if status == "finished:completed" else 1


def flwr_run_command(flwr: Path, app: Path, overrides: dict, stage_dir: Path, config_file: Path, no_stage: bool,
                     *options: str) -> list[str]:
    """``flwr run <app> <options> [--run-config <config_file>]``: ``app`` staged into
    ``stage_dir`` (unless ``no_stage``) and ``overrides`` written to ``config_file``. The app the
    installed package carries is its pyproject.toml alone (the code is the installed package):
    staged without the checkout's FAB patterns; a checkout is staged whole."""
    if no_stage:
        run_dir = app
    else:
        stage = stage_bundled_app if app.resolve() == BUNDLED_APP.resolve() else stage_app
        run_dir = stage(app, stage_dir)
    command = [str(flwr), "run", str(run_dir), *options]
    if overrides:
        config_file.write_text(to_toml(overrides))
        command += ["--run-config", str(config_file)]
    return command


def checked_run_config(overrides: dict, app: Path) -> dict:
    """The run config ``overrides`` make of ``app``'s, checked as the ServerApp will check it
    (every key known, every value in range: :func:`~flwr_pfl.app.config.parse_experiment`).

    Raises:
        SystemExit: naming the key and what is allowed.
    """
    try:
        config = default_run_config(overrides, app)
    except ValueError as err:  # Flower's fusing: a key the app's pyproject.toml does not have
        known = sorted(default_run_config({}, app))
        unknown = [key for key in overrides if key not in known]
        hints = "".join(f"; {key!r}: did you mean {close[0]!r}?" for key in unknown
                        if (close := difflib.get_close_matches(key, known, n=1)))
        raise SystemExit(f"run config refused before submitting: unknown key(s) {unknown} ({err}){hints}; the app's keys "
                         f"are those of its pyproject.toml [tool.flwr.app.config]") from None
    from flwr_pfl.app.config import parse_experiment  # the training stack: only once the keys are known
    from flwr_pfl.errors import ConfigError

    try:
        parse_experiment(config)
    except ConfigError as err:
        raise SystemExit(f"run config refused before submitting: {err}") from None
    return config


def submit(args: argparse.Namespace) -> int:
    """``--federation``: check the run config here, submit it to the deployment's SuperLink,
    follow it and report its final status (exit 0 only for ``finished:completed``)."""
    app = (args.app or app_dir()).resolve()
    flwr = flwr_executable()
    overrides = parse_overrides(args.run_config)
    checked_run_config(overrides, app)
    env = {**os.environ, **SAFE_ENV}
    if args.flwr_home is not None:
        env["FLWR_HOME"] = str(args.flwr_home.resolve())
    home = Path(env.get("FLWR_HOME", Path.home() / ".flwr"))
    home.mkdir(parents=True, exist_ok=True)
    command = flwr_run_command(flwr, app, overrides, home / "flwr-pfl-app", home / "flwr-pfl-run-config.toml",
                               args.no_stage, args.federation, "--stream")
    print(f"$ {' '.join(command)}", flush=True)
    code = subprocess.run(command, env=env).returncode
    status = last_run_status(env, flwr, args.federation) if code == 0 else f"flwr run exited with {code}"
    print(f"run status: {status}", flush=True)
    return 0 if status == "finished:completed" else 1


if __name__ == "__main__":
    sys.exit(main())
