"""MkDocs hooks of the documentation site (``mkdocs.yml``'s ``hooks``).

Two jobs, both so that one text serves GitHub and the site without a copy:

* **README.md is the front page.** ``on_files`` adds it as the site's ``index.md``; its links are
  relative to the repository root, so ``docs/X`` becomes ``X`` and any other path
  (``examples/...``) becomes ``../...``, relative to ``docs/`` like every other page's.
* **Links to the repository's own files are checked.** A page may link a file outside ``docs/``
  (``../examples/quickstart_pytorch``), which GitHub shows but a built site cannot serve.
  ``on_page_markdown`` resolves every such link: a path that does not exist in the repository is
  a warning (so ``mkdocs build --strict`` fails on it, as MkDocs fails on a broken link between
  pages), and one that exists becomes a link to the repository's host when ``repo_url`` is set,
  else the path as code. Links inside code blocks and spans are left alone.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.flwr_pfl")

#: ``[text](target)`` with a relative target (no scheme, no leading ``/`` or ``#``)
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>(?![a-z][a-z0-9+.-]*:|/|#)[^)\s]+)\)")
#: fenced code blocks and inline code spans: their brackets are not links
CODE = re.compile(r"^(```|~~~).*?^\1[ \t]*$|`[^`\n]+`", re.S | re.M)


def repo_root(config: Any) -> Path:
    return Path(config["docs_dir"]).resolve().parent


def readme_as_index(text: str) -> str:
    """README.md's text with its repository-relative links made relative to ``docs/``."""

    def relink(match: re.Match[str]) -> str:
        target = match["target"]
        target = target[len("docs/"):] if target.startswith("docs/") else "../" + target
        return f"[{match['text']}]({target})"

    return outside_code(text, lambda part: LINK.sub(relink, part))


def outside_code(text: str, change: Any) -> str:
    """``change`` applied to the parts of ``text`` outside code blocks and code spans."""
    out, last = [], 0
    for match in CODE.finditer(text):
        out += [change(text[last:match.start()]), match.group(0)]
        last = match.end()
    return "".join(out + [change(text[last:])])


def on_files(files: Files, config: Any) -> Files:
    readme = repo_root(config) / "README.md"
    files.append(File.generated(config, "index.md", content=readme_as_index(readme.read_text())))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    root = repo_root(config)
    page_dir = posixpath.dirname(page.file.src_uri)
    repo_url = (config.get("repo_url") or "").rstrip("/")

    def resolve(match: re.Match[str]) -> str:
        target = match["target"]
        path, _, anchor = target.partition("#")
        joined = posixpath.normpath(posixpath.join("docs", page_dir, path))
        if joined.startswith("docs/") or joined == "docs":
            return match.group(0)  # a page or file of the site: MkDocs checks it
        if joined.startswith("../") or not (root / joined).exists():
            log.warning("Doc file '%s' links '%s', which is not a file of the repository (%s)",
                        page.file.src_uri, target, joined)
            return match.group(0)
        if repo_url:
            kind = "tree" if (root / joined).is_dir() else "blob"
            return f"[{match['text']}]({repo_url}/{kind}/main/{joined}{'#' + anchor if anchor else ''})"
        text = match["text"].strip("`")
        return f"`{joined}`" if text.rstrip("/") == joined.rstrip("/") else f"{match['text']} (`{joined}`)"

    return outside_code(markdown, lambda part: LINK.sub(resolve, part))
