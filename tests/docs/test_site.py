"""The documentation site builds with warnings as errors, covers every module, and its front page
is README.md.

``mkdocs build --strict`` fails on a link to a missing page or anchor, an unresolvable
cross-reference or a docstring mkdocstrings cannot read (``mkdocs.yml``'s ``validation``), and
on a link to a repository file that does not exist (``scripts/docs_hooks.py``).
"""

from __future__ import annotations

import importlib.util
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') builds the site")

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO_ROOT / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
                          timeout=300)


def test_the_site_builds_strictly_with_the_readme_as_front_page(tmp_path):
    done = build(REPO_ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    index = (tmp_path / "site" / "index.html").read_text()
    assert "The two commands" in index and "FedRepClient" in index
    assert 'href="drop-in/"' in index  # README's docs/drop-in.md, relative to the site
    strategies = (tmp_path / "site" / "api" / "strategies" / "index.html").read_text()
    assert 'id="flwr_pfl.strategies.base.PFLStrategy"' in strategies  # the reference is generated


def modules() -> set[str]:
    found = set()
    for path in (REPO_ROOT / "flwr_pfl").rglob("*.py"):
        name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        if name.endswith(".__init__"):
            name = name.removesuffix(".__init__")
            if not path.read_text().strip():
                continue
        found.add(name)
    return found


def test_every_module_is_in_the_api_reference():
    documented = set()
    for page in (REPO_ROOT / "docs" / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: ([\w.]+)", page.read_text(), re.M))
    assert modules() - documented == set(), "add these modules to a page of docs/api/"
    assert documented - modules() == set(), "docs/api/ names modules that do not exist"


def fake_page(src_uri: str, repo_url: str = ""):
    page = SimpleNamespace(file=SimpleNamespace(src_uri=src_uri))
    return page, {"docs_dir": str(REPO_ROOT / "docs"), "repo_url": repo_url}


def test_the_readme_links_are_made_relative_to_the_docs_folder():
    hooks = load_hooks()
    text = "[guide](docs/drop-in.md#x), [ex](examples/quickstart_pytorch), [web](https://flower.ai)\n```\n[no](docs/a.md)\n```"
    out = hooks.readme_as_index(text)
    assert "[guide](drop-in.md#x)" in out and "[ex](../examples/quickstart_pytorch)" in out
    assert "[web](https://flower.ai)" in out and "[no](docs/a.md)" in out  # code is not touched


def test_a_link_to_a_repository_file_is_checked_and_rewritten(caplog):
    hooks = load_hooks()
    page, config = fake_page("api/index.md")
    with caplog.at_level(logging.WARNING, logger="mkdocs.plugins.flwr_pfl"):
        out = hooks.on_page_markdown("[ex](../../examples/quickstart_pytorch) and [p](../index.md)", page, config, None)
        assert out == "ex (`examples/quickstart_pytorch`) and [p](../index.md)"
        assert not caplog.records
        hooks.on_page_markdown("[gone](../../examples/no_such_example) `[c](../../x)`", page, config, None)
    assert len(caplog.records) == 1 and "examples/no_such_example" in caplog.records[0].getMessage()
    page, config = fake_page("drop-in.md", repo_url="https://example.org/flwr_pfl/")
    out = hooks.on_page_markdown("[ex](../examples/quickstart_pytorch) [f](../pyproject.toml#L3)", page, config, None)
    assert out == ("[ex](https://example.org/flwr_pfl/tree/main/examples/quickstart_pytorch) "
                   "[f](https://example.org/flwr_pfl/blob/main/pyproject.toml#L3)")


def test_a_broken_link_fails_the_build(tmp_path):
    """The project's validation settings and hook on a two-page site: each broken kind fails it."""
    config = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())
    for key in ("nav", "exclude_docs", "not_in_nav"):  # the two pages below are the whole site
        config.pop(key)
    config["plugins"] = ["search"]
    config["hooks"] = [str(REPO_ROOT / "scripts" / "docs_hooks.py")]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "README.md").write_text("# Front\n\n[page](docs/page.md)\n")
    (tmp_path / "docs").mkdir()
    for link, ok in [("[home](index.md)", True), ("[gone](missing.md)", False), ("[a](index.md#no-such-anchor)", False),
                     ("[file](../mkdocs.yml)", True), ("[file](../no_such_file.py)", False)]:
        (tmp_path / "docs" / "page.md").write_text(f"# Page\n\n{link}\n")
        done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
        assert (done.returncode == 0) is ok, (link, done.stderr[-2000:])
