#!/usr/bin/env python3
"""Systematic mutation testing with mutmut, one module at a time, resumable.

The curated check (``scripts/mutation_check.py``) applies the bugs its authors imagined. This
script lets a tool imagine them: mutmut rewrites every operator, constant, string, argument and
call of a module into mutants, runs the tests that cover each mutated function (mutmut learns
which tests reach which function by running the module's test selection once), and reports the
mutants no test notices. Every surviving mutant must then be killed by a better test, or listed
in ``docs/mutation/equivalent.toml`` with a one-line reason it cannot change behaviour::

    [[equivalent]]
    mutant = "flwr_pfl.core.robust.x_update_norm__mutmut_6"
    diff = "np.square(a, dtype=np.float64) -> np.square(a, dtype=None)"   # what mutmut changed
    why = "every floating array reaching update_norm is float32 or float64 ..."

Each module in ``SCOPE`` has its own workspace ``.mutation/<module>/`` (a copy of the package and
its tests, with a ``[tool.mutmut]`` section naming the module and its tests), which mutmut keeps
between runs: a killed or interrupted run resumes where it stopped, and a rerun after an edit
re-tests only the functions that changed. Results go to ``docs/mutation/tool/<module>.json`` and
the summary ``docs/mutation/tool.md`` (score per module, the command, the time it took).

Usage::

    .venv/bin/python scripts/mutation_tool.py --module flwr_pfl/core/robust.py
    .venv/bin/python scripts/mutation_tool.py --changed           # modules changed since HEAD (uncommitted)
    .venv/bin/python scripts/mutation_tool.py --changed main~3    # ... since a commit
    .venv/bin/python scripts/mutation_tool.py --all               # every module in SCOPE (hours)
    .venv/bin/python scripts/mutation_tool.py --report            # regenerate docs/mutation/tool.md only
    .venv/bin/python scripts/mutation_tool.py --list              # the scope and each module's tests

Exits 1 when a mutant survives that ``equivalent.toml`` does not list (or lists with a diff that no
longer matches, i.e. the entry is stale). It is too long for CI; run it before committing a change
to a module in scope (``--changed``), and the curated check for the quick look.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKDIR = REPO / ".mutation"
RESULTS = REPO / "docs" / "mutation" / "tool"
SUMMARY = REPO / "docs" / "mutation" / "tool.md"
EQUIVALENT = REPO / "docs" / "mutation" / "equivalent.toml"
#: what a workspace copies from the checkout (tests read examples, README and simulations)
COPIED = ("flwr_pfl", "tests", "simulations", "examples", "scripts", "pyproject.toml", "README.md")

_FLOWER_LAYER = (
    "tests/strategies",
    "tests/clients",
    "tests/serverapp",
    "tests/training",
    "tests/models",
    "tests/test_messages.py",
)
_AGGREGATION = (
    "tests/strategies/test_baselines_flower_layer.py",
    "tests/strategies/test_reply_bounds.py",
    "tests/strategies/test_validation.py",
    "tests/properties/test_aggregation_properties.py",
)
_STATE = ("tests/app/test_resume.py", "tests/app/test_resume_safety.py", "tests/app/test_resume_state.py")

#: module -> the test paths whose (non-slow) tests may kill its mutants. mutmut narrows each
#: mutant to the tests of this selection that actually call the mutated function.
SCOPE: dict[str, tuple[str, ...]] = {
    "flwr_pfl/core/aggregation.py": ("tests/core/test_aggregation.py", *_AGGREGATION),
    "flwr_pfl/core/robust.py": ("tests/core/test_robust.py", *_AGGREGATION),
    "flwr_pfl/core/dp.py": ("tests/core/test_dp.py", "tests/strategies/test_client_dp.py"),
    "flwr_pfl/models/split.py": ("tests/models", "tests/clients", "tests/strategies"),
    "flwr_pfl/clientapp.py": ("tests/clients", "tests/serverapp", "tests/test_messages.py"),
    "flwr_pfl/app/checkpoint.py": (*_STATE, "tests/properties"),
    "flwr_pfl/app/signing.py": ("tests/app/test_node_state.py", "tests/app/test_resume_safety.py"),
    "flwr_pfl/app/node_state.py": ("tests/app/test_node_state.py", "tests/app/test_node_restart.py", *_STATE, "tests/properties"),
    "flwr_pfl/app/node_settings.py": ("tests/app/test_node_data.py", "tests/app/test_node_state.py", "tests/properties"),
    "flwr_pfl/app/client_cache.py": ("tests/app/test_client_cache.py", "tests/properties"),
    # the run config's checks are tested where their features are: DP keys with client-level and
    # record-level DP, run names and checkpoint keys with resuming
    "flwr_pfl/app/config.py": ("tests/app/test_config.py", "tests/app/test_config_checks.py", "tests/app/test_presets.py",
                               "tests/strategies/test_client_dp.py",
                               "tests/clients/test_record_dp.py", "tests/app/test_resume_safety.py"),
    "flwr_pfl/app/results.py": ("tests/app/test_inprocess.py", "tests/app/test_compare.py", "tests/app/test_failed_runs.py"),
    "flwr_pfl/app/secagg.py": ("tests/app/test_secagg.py",),
}
for _package in ("strategies", "clients", "training", "serverapp"):
    for _path in sorted((REPO / "flwr_pfl" / _package).glob("*.py")):
        if _path.name != "__init__.py":
            SCOPE[str(_path.relative_to(REPO))] = (*_FLOWER_LAYER, "tests/properties")
#: Flower-layer modules with a focused test selection of their own (a workspace of their own, minutes
#: instead of the shared workspace's half-hour first pass)
OWN_SELECTION: dict[str, tuple[str, ...]] = {
    "flwr_pfl/training/dpsgd.py": ("tests/training/test_dpsgd.py", "tests/clients/test_record_dp.py"),
    "flwr_pfl/strategies/privacy.py": ("tests/strategies/test_client_dp.py", "tests/core/test_dp.py"),
    "flwr_pfl/strategies/wrappers.py": ("tests/strategies/test_flower_dp_wrappers.py",),
    "flwr_pfl/serverapp/layout.py": ("tests/serverapp/test_layout.py", "tests/serverapp/test_user_model.py",
                                     "tests/serverapp/test_translation.py", "tests/properties/test_wire_properties.py"),
    "flwr_pfl/serverapp/strategy.py": ("tests/serverapp/test_translation.py", "tests/serverapp/test_message_strategy_steps.py",
                                       "tests/serverapp/test_user_model.py",
                                       "tests/serverapp/test_names_by_name.py", "tests/strategies/test_no_training.py",
                                       "tests/strategies/test_flower_dp_wrappers.py"),
    # every client trains through these: in the shared workspace each of their mutants would run
    # hundreds of Flower-layer tests (minutes a mutant); their own tests pin them down
    "flwr_pfl/training/optim.py": ("tests/training/test_optim.py", "tests/training/test_loops.py"),
    "flwr_pfl/training/norms.py": ("tests/training/test_frozen_norm.py", "tests/training/test_loops.py"),
    "flwr_pfl/models/split.py": ("tests/models", "tests/strategies/test_every_mode_models.py"),
    "flwr_pfl/strategies/sampling.py": ("tests/properties/test_sampling_properties.py", "tests/strategies/test_participation.py",
                                        "tests/strategies/test_flower_habits.py"),
    "flwr_pfl/strategies/decode.py": ("tests/strategies/test_decode.py", "tests/strategies/test_bad_client.py"),
    "flwr_pfl/strategies/validation.py": ("tests/strategies/test_validation.py", "tests/strategies/test_bad_client.py",
                                          "tests/strategies/test_reply_bounds.py"),
    "flwr_pfl/serverapp/nodes.py": ("tests/serverapp/test_message_node.py", "tests/serverapp/test_translation.py",
                                    "tests/serverapp/test_message_strategy_steps.py"),
    "flwr_pfl/training/params.py": ("tests/training/test_params.py", "tests/training/test_loops.py"),
    "flwr_pfl/training/batches.py": ("tests/training/test_batches.py", "tests/training/test_loops.py"),
    "flwr_pfl/training/seed.py": ("tests/training/test_device_seed_state.py",),
    "flwr_pfl/training/state.py": ("tests/training/test_device_seed_state.py",),
    "flwr_pfl/training/device.py": ("tests/training/test_device_seed_state.py",),
}
SCOPE.update(OWN_SELECTION)

#: the tests that run every registered algorithm (reruns, both flavours, export, node state,
#: resume, models with BatchNorm and dropout, bad replies); an algorithm's workspace keeps only
#: their cases that name it (pytest ``-k``)
_EVERY_ALGORITHM = (
    "tests/strategies/test_every_mode_models.py", "tests/strategies/test_bad_client.py",
    "tests/serverapp/test_flavours_equal.py", "tests/app/test_reruns.py", "tests/app/test_export.py",
    "tests/app/test_node_state.py", "tests/app/test_resume_state.py", "tests/app/test_resume.py",
    "tests/properties/test_wire_properties.py", "tests/clients/test_dropin.py", "tests/clients/test_empty_client.py",
    "tests/strategies/test_client_dp.py", "tests/clients/test_record_dp.py",
)
#: baselines whose client and strategy are mutated together against the tests that name them:
#: minutes a module, where the shared workspace's first pass alone takes half an hour
ALGORITHM_WORKSPACES: dict[str, tuple[str, ...]] = {}
#: workspace -> the pytest ``-k`` expression of its cases
ALGORITHM_KEYWORDS: dict[str, str] = {}


def _algorithm_workspace(name: str, modules: tuple[str, ...], algorithms: tuple[str, ...]) -> None:
    """``algorithms``: the module names and registry names (``per-fedavg``) whose cases test it."""
    own = tuple(str(p.relative_to(REPO)) for a in (name, *algorithms)
                for p in sorted((REPO / "tests").rglob(f"test_{a.replace('-', '')}*.py")))
    ALGORITHM_WORKSPACES[f"algorithm.{name}"] = modules
    ALGORITHM_KEYWORDS[f"algorithm.{name}"] = " or ".join(dict.fromkeys((name, *algorithms)))
    for module in modules:
        OWN_SELECTION[module] = SCOPE[module] = tuple(dict.fromkeys((*own, *_EVERY_ALGORITHM)))


#: module name -> the names its algorithms have in the registry, where they differ
_REGISTRY_NAMES = {"knnper": ("knn-per",), "perfedavg": ("per-fedavg",)}
for _name in ("apfl", "ditto", "fedamp", "fedbn", "fedfomo", "fedpac", "fedrod", "ifca", "knnper",
              "perfedavg", "pfedhn", "pfedme"):
    _algorithm_workspace(_name, tuple(f"flwr_pfl/{package}/{_name}.py" for package in ("clients", "strategies")
                                      if (REPO / "flwr_pfl" / package / f"{_name}.py").exists()),
                         _REGISTRY_NAMES.get(_name, ()))
# the personal copy that Ditto, APFL and pFedMe share
_algorithm_workspace("personal", ("flwr_pfl/clients/personal.py",), ("ditto", "apfl", "pfedme"))

#: modules mutated together in one workspace, so that mutmut's first pass over the tests (which
#: records the tests that reach each function, about half an hour for the Flower layer's 1,200
#: tests) runs once for all of them; a module's run then tests only its own mutants. The tests
#: of a shared workspace are the union of its modules' selections (more tests only kill more).
SHARED_WORKSPACES: dict[str, tuple[str, ...]] = {
    "flower-layer": tuple(
        m for m in SCOPE
        if m not in OWN_SELECTION and (m.split("/")[1] in ("strategies", "clients", "training", "serverapp")
                                       or m in ("flwr_pfl/clientapp.py", "flwr_pfl/models/split.py"))
    ),
    **ALGORITHM_WORKSPACES,
}


def pytest_selection(workspace: str, tests: tuple[str, ...]) -> list[str]:
    """The pytest arguments of a workspace's selection: its test paths that exist, narrowed by
    ``-k`` to the cases naming the algorithm in an algorithm's workspace."""
    selection = [t for t in tests if (REPO / t).exists()]
    keyword = ALGORITHM_KEYWORDS.get(workspace)
    return selection + ["-k", keyword] if keyword else selection


@dataclass(frozen=True)
class Equivalent:
    mutant: str
    diff: str
    why: str


def slug(module: str) -> str:
    """``flwr_pfl/core/robust.py`` -> ``core.robust``: a workspace's and a result file's name."""
    return module.removeprefix("flwr_pfl/").removesuffix(".py").replace("/", ".")


def dotted(module: str) -> str:
    """The module's import name, the prefix of its mutants' names."""
    return module.removesuffix(".py").replace("/", ".")


def load_equivalents(path: Path = EQUIVALENT) -> dict[str, Equivalent]:
    """The reviewed equivalent mutants, by name; each entry needs ``mutant``, ``diff`` and ``why``."""
    if not path.exists():
        return {}
    entries = tomllib.loads(path.read_text()).get("equivalent", [])
    out: dict[str, Equivalent] = {}
    for entry in entries:
        missing = {"mutant", "diff", "why"} - set(entry)
        if missing or not str(entry.get("why", "")).strip():
            raise SystemExit(f"{path}: entry {entry.get('mutant', entry)} lacks {sorted(missing) or ['a reason']}")
        out[entry["mutant"]] = Equivalent(entry["mutant"], entry["diff"], entry["why"])
    return out


def workspace_of(module: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """The workspace's name, the modules it mutates and its test selection, for ``module``."""
    for name, modules in SHARED_WORKSPACES.items():
        if module in modules:
            tests = tuple(dict.fromkeys(t for m in modules for t in SCOPE[m]))
            return name, modules, tests
    return slug(module), (module,), SCOPE[module]


def prepare_workspace(module: str) -> Path:
    """Create or refresh ``module``'s workspace from the checkout (mutmut's cache is kept)."""
    name, modules, tests = workspace_of(module)
    work = WORKDIR / name
    work.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        source, target = REPO / name, work / name
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "runs", ".pytest_cache"))
        elif source.exists():
            shutil.copy2(source, target)
    config = [
        "",
        "[tool.mutmut]",
        'source_paths = ["flwr_pfl"]',
        f"only_mutate = {json.dumps(list(modules))}",
        f"pytest_add_cli_args_test_selection = {json.dumps([*pytest_selection(work.name, tests), '-m', 'not slow'])}",
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q"]',
        # torch is not fork-safe after it has run: fork each mutant's run from a clean server
        'process_isolation = "forkserver"',
        # mutmut limits a mutant to (t + constant) x multiplier x 2 CPU seconds and half that in
        # wall time (t: its tests' time on the unmutated code); the fork server has torch imported
        # already, so 3 minutes' wall time and more mean a real hang (a mutant asleep in a wait
        # loop uses no CPU: only the wall limit ends it, and 20 minutes a hang was too long)
        "timeout_multiplier = 6.0",
        "timeout_constant = 30.0",
        "use_git_change_detection = false",
    ]
    pyproject = (work / "pyproject.toml").read_text()
    (work / "pyproject.toml").write_text(pyproject.split("\n[tool.mutmut]")[0] + "\n".join(config) + "\n")
    return work


def mutmut_bin() -> str:
    candidate = Path(sys.executable).with_name("mutmut")
    return str(candidate) if candidate.exists() else "mutmut"


def run_module(module: str, max_children: int) -> dict:
    """Run mutmut on one module (resuming its workspace) and return its result record."""
    work = prepare_workspace(module)
    tests = workspace_of(module)[2]
    recheck_survivors(work, module)
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONHASHSEED": "0"}
    start = time.perf_counter()
    log = work / "mutmut-run.log"
    with log.open("w") as out:
        proc = subprocess.run([mutmut_bin(), "run", "--max-children", str(max_children), f"{dotted(module)}.*"],
                              cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if "failed to collect stats" in log.read_text():
        selection = shlex.join(pytest_selection(work.name, tests))
        raise SystemExit(
            f"{module}: its tests fail on the unmutated code, so no mutant can be judged; see them with\n"
            f"  cd {work / 'mutants'} && python -m pytest {selection} -m 'not slow' -x"
        )
    if "nothing matches" in log.read_text():  # a module without a function mutmut can change
        return collect(module, work, seconds=seconds, max_children=max_children, allow_empty=True)
    if proc.returncode not in (0, 1):
        tail = log.read_text()[-2000:]
        raise SystemExit(f"mutmut failed on {module} (exit {proc.returncode}); the end of {log}:\n{tail}")
    return collect(module, work, seconds=seconds, max_children=max_children)


def recheck_survivors(work: Path, module: str) -> None:
    """Forget the verdicts of the mutants that were not caught, so that this run tests them again.

    mutmut keeps every verdict and re-tests only the functions whose code changed; a survivor
    whose new test was just written would otherwise stay a survivor. Killed mutants keep theirs.
    """
    meta_path = work / "mutants" / (module + ".meta")
    if not meta_path.exists():
        return
    meta = json.loads(meta_path.read_text())
    for name, code in meta["exit_code_by_key"].items():
        if STATUS_BY_EXIT_CODE.get(code, "suspicious") in ("survived", "no tests", "suspicious"):
            meta["exit_code_by_key"][name] = None
    meta_path.write_text(json.dumps(meta, indent=4))


STATUS_BY_EXIT_CODE = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
                       36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", None: "not checked"}


def mutant_diff(work: Path, name: str) -> str:
    """mutmut's change of ``name`` as ``old -> new`` (the changed lines, stripped)."""
    shown = subprocess.run([mutmut_bin(), "show", name], cwd=work, capture_output=True, text=True).stdout
    old = [line[1:].strip() for line in shown.splitlines() if line.startswith("-") and not line.startswith("---")]
    new = [line[1:].strip() for line in shown.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return f"{' / '.join(old)} -> {' / '.join(new)}"


def collect(module: str, work: Path, *, seconds: float | None = None, max_children: int = 0,
            allow_empty: bool = False) -> dict:
    """Read the workspace's mutmut results for ``module`` into a result record and write it."""
    meta_path = work / "mutants" / (module + ".meta")
    if meta_path.exists():
        exit_codes = json.loads(meta_path.read_text())["exit_code_by_key"]
    elif allow_empty:
        exit_codes = {}
    else:
        raise SystemExit(f"{module}: no mutmut results in {meta_path}; run it first")
    equivalents = load_equivalents()
    statuses: dict[str, str] = {}
    survivors, equivalent, stale = [], [], []
    for name, code in sorted(exit_codes.items(), key=lambda kv: _natural(kv[0])):
        status = STATUS_BY_EXIT_CODE.get(code, "suspicious")
        if status in ("survived", "no tests", "suspicious", "timeout"):
            diff = mutant_diff(work, name)
            listed = equivalents.get(name)
            if status != "timeout" and listed and listed.diff == diff:
                status = "equivalent"
                equivalent.append({"mutant": name, "diff": diff, "why": listed.why})
            elif status != "timeout":
                survivors.append({"mutant": name, "status": status, "diff": diff})
                if listed:
                    stale.append(name)
        statuses[name] = status
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    judged = len(statuses) - counts.get("not checked", 0) - counts.get("skipped", 0)
    caught = counts.get("killed", 0) + counts.get("timeout", 0) + counts.get("equivalent", 0)
    previous = _read_json(RESULTS / f"{slug(module)}.json")
    record = {
        "module": module,
        "tests": list(workspace_of(module)[2]),
        "mutants": len(statuses),
        "counts": counts,
        "score": round(caught / judged, 4) if judged else None,
        "survivors": survivors,
        "equivalent": equivalent,
        "stale_equivalents": stale,
        "wall_seconds": round(seconds, 1) if seconds is not None else previous.get("wall_seconds"),
        "workers": max_children or previous.get("workers"),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": f".venv/bin/python scripts/mutation_tool.py --module {module}",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{slug(module)}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def write_summary() -> str:
    """docs/mutation/tool.md: one row per module with results, and the modules not yet run."""
    rows, pending = [], []
    for module in SCOPE:
        record = _read_json(RESULTS / f"{slug(module)}.json")
        if not record:
            pending.append(module)
            continue
        c = record["counts"]
        score = "n/a" if record["score"] is None else f"{100 * record['score']:.1f} %"
        rows.append(
            f"| `{module}` | {record['mutants']} | {c.get('killed', 0)} | {c.get('timeout', 0)} | "
            f"{c.get('equivalent', 0)} | {len(record['survivors'])} | {score} | "
            f"{record['wall_seconds']} | {record['date']} |"
        )
    lines = [
        "# Mutation testing with mutmut",
        "",
        "Each module in scope is mutated by [mutmut](https://github.com/boxed/mutmut) (every operator,",
        "constant, string, argument and call) and each mutant is run against the tests of the module's",
        "selection that reach the mutated function (`scripts/mutation_tool.py --list` shows the selections).",
        "A mutant is *killed* when a test fails, *time-out* when it hangs (counted as caught), *equivalent*",
        "when it cannot change behaviour (each one listed with its reason in",
        "[equivalent.toml](equivalent.toml)), and *survived* otherwise: a survivor is a missing test.",
        "A baseline's client and strategy are mutated together against its own test files and the cases",
        "of the every-algorithm tests (reruns, both flavours, export, node state, resume, drop-in models,",
        "DP) that name it; a time-out is a mutant still running after 3 minutes' wall time.",
        "",
        "Regenerate a row with `.venv/bin/python scripts/mutation_tool.py --module <path>` (resumable; a",
        "rerun re-tests only changed functions), the modules a change touched with `--changed`, and",
        "everything with `--all` (hours on 2 cores: it stays out of CI). Per-module details, with every",
        "survivor's diff, are in `docs/mutation/tool/`.",
        "",
        "| module | mutants | killed | time-out | equivalent | survived | score | s | run |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    if pending:
        lines += ["Not yet run: " + ", ".join(f"`{m}`" for m in pending) + ".", ""]
    text = "\n".join(lines)
    SUMMARY.write_text(text)
    return text


def changed_modules(since: str) -> list[str]:
    """Modules in scope that differ from ``since`` (working tree included)."""
    out = subprocess.run(["git", "diff", "--name-only", since, "--", "flwr_pfl"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "flwr_pfl"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.split()
    return [m for m in SCOPE if m in set(out) | set(untracked)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--module", action="append", help="a path in scope (repeatable)")
    what.add_argument("--changed", nargs="?", const="HEAD", metavar="REF", help="modules changed since REF")
    what.add_argument("--all", action="store_true")
    what.add_argument("--report", action="store_true", help="re-read the workspaces, rewrite the docs")
    what.add_argument("--list", action="store_true")
    parser.add_argument("--max-children", type=int, default=2, help="mutants run at once")
    args = parser.parse_args(argv)

    if args.list:
        for module, tests in SCOPE.items():
            print(f"{module}: {shlex.join(pytest_selection(workspace_of(module)[0], tests))}")
        return 0
    if args.report:
        for module in SCOPE:
            work = WORKDIR / workspace_of(module)[0]
            if (work / "mutants" / (module + ".meta")).exists():
                collect(module, work)
        print(write_summary())
        return 0
    modules = list(SCOPE) if args.all else changed_modules(args.changed) if args.changed else args.module
    unknown = [m for m in modules if m not in SCOPE]
    if unknown:
        raise SystemExit(f"not in the mutation scope: {unknown}; allowed: {', '.join(SCOPE)}")
    if not modules:
        print("no module in scope changed")
        return 0
    failed = False
    for module in modules:
        record = run_module(module, args.max_children)
        print(f"{module}: {record['mutants']} mutants, {record['counts']}, {len(record['survivors'])} survivors, "
              f"{record['wall_seconds']} s")
        for s in record["survivors"]:
            print(f"  {s['status']}: {s['mutant']}: {s['diff']}")
        failed |= bool(record["survivors"]) or bool(record["stale_equivalents"])
    write_summary()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
