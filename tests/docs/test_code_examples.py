"""Every Python block of README.md and the documentation pages is checked by a test.

A block is one of (the marker is an HTML comment on the line before its fence):

* unmarked: run here as written, in a fresh namespace (it must be self-contained);
* ``<!-- readme-example -->``, ``<!-- export-example -->``, ...: run by the test that names the
  marker (here: some test file must name it);
* ``<!-- excerpt: path -->``: an abridged copy of the library's code; it must parse, and every
  function and class it defines must still be defined at the top level of ``path``;
* ``<!-- fragment -->``: a piece of a larger program (``...`` for what the reader has).

In every block, each ``from flwr_pfl... import ...`` must import: a renamed or moved name fails
here rather than in a reader's project.
"""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```python[^\n]*\n(?P<code>.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*(?P<kind>[a-z-]+)(?::\s*(?P<arg>[^ ]+))?\s*-->")
RUN_BY_TEST = re.compile(r"[a-z]+-example")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    kind: str  # "run", "fragment", "excerpt" or an example marker run by its test
    arg: str = ""

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    docs = REPO_ROOT / "docs"
    return [REPO_ROOT / "README.md", *sorted(docs.glob("*.md")), *sorted(docs.glob("*/*.md"))]


def blocks() -> list[Block]:
    found = []
    for page in pages():
        text = page.read_text()
        for match in BLOCK.finditer(text):
            before = text[:match.start()].rstrip().splitlines()
            marker = MARKER.fullmatch(before[-1].strip()) if before else None
            kind = marker["kind"] if marker else "run"
            found.append(Block(str(page.relative_to(REPO_ROOT)), text.count("\n", 0, match.start()) + 1,
                               match["code"], kind, (marker["arg"] or "") if marker else ""))
    return found


BLOCKS = blocks()


def test_the_pages_have_python_blocks_and_known_markers():
    assert len(BLOCKS) >= 10
    for block in BLOCKS:
        assert block.kind in {"run", "fragment", "excerpt"} or RUN_BY_TEST.fullmatch(block.kind), (
            f"{block}: unknown marker {block.kind!r}")


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_flwr_pfl_import_of_a_block_imports(block):
    for line in block.code.splitlines():
        match = re.match(r"\s*from (flwr_pfl[\w.]*) import ([\w, ]+)$", line)
        if match:
            module = importlib.import_module(match[1])
            for name in (n.strip() for n in match[2].split(",")):
                assert hasattr(module, name), f"{block}: {match[1]} has no {name}"
        match = re.match(r"\s*import (flwr_pfl[\w.]*)$", line)
        if match:
            importlib.import_module(match[1])


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "excerpt"], ids=str)
def test_an_excerpt_names_what_its_source_defines(block):
    source = REPO_ROOT / block.arg
    assert source.is_file(), f"{block}: excerpt of {block.arg}, which does not exist"
    defined = {node.name for node in ast.parse(source.read_text()).body
               if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef)}
    excerpt = ast.parse(block.code)
    names = [node.name for node in excerpt.body if isinstance(node, ast.FunctionDef | ast.ClassDef)]
    for name in names:
        assert name in defined, f"{block}: {name} is no longer defined in {block.arg}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if RUN_BY_TEST.fullmatch(b.kind)], ids=str)
def test_an_example_block_is_run_by_its_test(block):
    marker = f"<!-- {block.kind} -->"
    users = [p for p in (REPO_ROOT / "tests").rglob("test_*.py")
             if p.name != Path(__file__).name and marker in p.read_text()]
    assert users, f"{block}: no test runs the block marked {marker}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "run"], ids=str)
def test_an_unmarked_block_runs_as_written(block):
    exec(compile(block.code, block.page, "exec"), {"__name__": "docs_example"})


def test_the_markers_are_read():
    kinds = {b.kind for b in BLOCKS}
    assert {"readme-example", "export-example", "excerpt", "fragment"} <= kinds
    assert any(b.kind == "excerpt" and b.arg == "flwr_pfl/core/proximal.py" for b in BLOCKS)
