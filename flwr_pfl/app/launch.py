"""Run the app through the real ``flwr run .``, safely, and report whether it succeeded.

``python -m flwr_pfl.app.launch [-c OVERRIDES]...`` does what a careful user would type by hand:

* sets the environment ``flwr run`` needs offline (no per-run dependency install, which would
  fetch torch again; no telemetry; no update check);
* sizes the simulated federation from the run config (``num-supernodes = num-clients``) and
  gives each client ``--cpus`` CPUs and ``--gpus`` of a GPU;
* hands ``flwr run`` a clean copy of the app (``pyproject.toml`` and the app's packages, under
  ``<flwr-home>/app``), so the bundle it builds skips virtual environments, outputs and tests;
* uses a private Flower home and port, so no SuperLink left over from another project (with
  another environment) is reused, and stops the SuperLink it started when the run ends;
* checks the run's final status, as ``flwr list`` shows it (``flwr run`` exits 0 even when the app
  failed) and exits non-zero unless the run finished successfully.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from flwr.common.config import get_fused_config_from_dir

from flwr_pfl.app.overrides import parse_overrides, to_toml
from flwr_pfl.app.staging import stage_app

REPO_ROOT = Path(__file__).resolve().parents[2]
SAFE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


def flwr_env(flwr_home: Path, port: int) -> dict[str, str]:
    """The environment for ``flwr`` commands: safe defaults, a private home and ports."""
    return {
        **os.environ,
        **SAFE_ENV,
        "FLWR_HOME": str(flwr_home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(port + 1),
    }


def stop_superlink(flwr_home: Path) -> None:
    """Stop the SuperLink (and its SuperExec) that ``flwr run`` started under ``flwr_home``."""
    result = subprocess.run(["pgrep", "-f", f"flower-superlink.*{flwr_home}"], capture_output=True, text=True)
    for pid in result.stdout.split():
        try:
            os.kill(int(pid), signal.SIGTERM)
        except ProcessLookupError:
            pass


def status_from_control_api(env: dict[str, str]) -> str | None:
    """The newest run's status, asked of the SuperLink's Control API from this process.

    The same query as ``flwr list``, without starting Flower's command line a second time (a
    second or two of every launch). None when it cannot be answered this way, e.g. where
    Flower's Python API differs from 1.41's; the caller then runs ``flwr list``.
    """
    saved = dict(os.environ)
    os.environ.update(env)  # Flower reads its home and ports from the environment
    try:
        from flwr.cli.flower_config import read_superlink_connection
        from flwr.cli.utils import init_http_client_from_connection
        from flwr.common.serde import run_from_proto
        from flwr.proto.control_pb2 import ListRunsRequest

        quiet = io.StringIO()  # as `flwr list`'s output is captured: its notices stay out of the log
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            client = init_http_client_from_connection(read_superlink_connection())
            try:
                runs = [run_from_proto(proto) for proto in client.ListRuns(ListRunsRequest()).run_dict.values()]
            finally:
                client.close()
    except Exception:  # noqa: BLE001  (any failure: fall back to the command line)
        return None
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if not runs:
        return None
    status = max(runs, key=lambda run: run.pending_at).status
    return f"{status.status}:{status.sub_status}" if status.sub_status else status.status


def last_run_status(env: dict[str, str], app_dir: Path) -> str:
    """Status of the newest run on the local SuperLink, e.g. ``finished:completed``."""
    status = status_from_control_api(env)
    if status is not None:
        return status
    out = subprocess.run(["flwr", "list", "--format", "json"], env=env, cwd=app_dir, capture_output=True, text=True)
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
    parser.add_argument("-c", "--run-config", action="append", default=[], help="as for flwr run: 'k=v k2=v2' or a TOML file; repeatable")
    parser.add_argument("--app", type=Path, default=REPO_ROOT, help="the Flower App directory (default: this repository)")
    parser.add_argument("--cpus", type=int, default=1, help="CPUs per simulated client (default 1)")
    parser.add_argument("--gpus", type=float, default=0.0, help="fraction of a GPU per simulated client (e.g. 0.25)")
    parser.add_argument("--flwr-home", type=Path, default=None, help="Flower home (default: <app>/.flwr)")
    parser.add_argument("--port", type=int, default=39291, help="private SuperLink HTTP port (default 39291)")
    parser.add_argument("--keep-superlink", action="store_true", help="leave the SuperLink running afterwards")
    parser.add_argument("--no-stage", action="store_true", help="run the app directory itself, not a clean copy of it")
    args = parser.parse_args(argv)

    app_dir = args.app.resolve()
    flwr_home = (args.flwr_home or app_dir / ".flwr").resolve()
    flwr_home.mkdir(parents=True, exist_ok=True)
    env = flwr_env(flwr_home, args.port)
    overrides = parse_overrides(args.run_config)
    config = get_fused_config_from_dir(app_dir, overrides)
    num_clients = int(config["num-clients"])
    federation = f"num-supernodes={num_clients} client-resources-num-cpus={args.cpus} client-resources-num-gpus={args.gpus}"
    run_dir = app_dir if args.no_stage else stage_app(app_dir, flwr_home / "app")
    command = ["flwr", "run", str(run_dir), "--stream", "--federation-config", federation]
    if overrides:
        fused = flwr_home / "run-config.toml"
        fused.write_text(to_toml(overrides))
        command += ["--run-config", str(fused)]
    print(f"$ {' '.join(command)}", flush=True)
    try:
        code = subprocess.run(command, env=env, cwd=app_dir).returncode
        status = last_run_status(env, app_dir) if code == 0 else f"flwr run exited with {code}"
    finally:
        if not args.keep_superlink:
            stop_superlink(flwr_home)
    print(f"run status: {status}", flush=True)
    return 0 if status == "finished:completed" else 1


if __name__ == "__main__":
    sys.exit(main())
