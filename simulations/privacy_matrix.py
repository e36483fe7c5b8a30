"""Which privacy protection each algorithm accepts, read from the code (for ``docs/privacy.md``).

For every registered algorithm: record-level DP (DP-SGD; its client's ``record_dp_reason``),
client-level DP of the aggregate and secure aggregation (its strategy's refusal, the rule
:class:`~flwr_pfl.strategies.base.PFLStrategy` applies to both). ``yes`` where it applies, else
the reason the code gives. ``tests/app/test_privacy_doc.py`` checks that the table in
``docs/privacy.md`` is this one.

    python simulations/privacy_matrix.py            # print the table
    python simulations/privacy_matrix.py --write    # replace it in docs/privacy.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flwr_pfl.app.registry import ALGORITHMS

REPO_ROOT = Path(__file__).resolve().parents[1]
DOC = REPO_ROOT / "docs" / "privacy.md"
BEGIN, END = "<!-- privacy-matrix:begin -->", "<!-- privacy-matrix:end -->"


def cell(reason: str) -> str:
    return "yes" if not reason else "no: " + reason.replace("|", "/")


def matrix() -> str:
    lines = ["| algorithm | record-level DP (DP-SGD) | client-level DP | secure aggregation (SecAgg+) |",
             "|---|---|---|---|"]
    for name in sorted(ALGORITHMS):
        spec = ALGORITHMS[name]
        shared = spec.strategy.robust_refusal or spec.strategy._default_refusal()
        secagg = cell(shared) + (" (with `pfedme.weighting = examples`)" if name == "pfedme" else "")
        lines.append(f"| `{name}` | {cell(spec.client.record_dp_reason())} | {cell(spec.strategy.dp_refusal())} | {secagg} |")
    return "\n".join(lines)


def with_matrix(text: str) -> str:
    """``text`` with the part between the markers replaced by :func:`matrix`."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{matrix()}\n{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/privacy.md")
    args = parser.parse_args()
    if args.write:
        DOC.write_text(with_matrix(DOC.read_text()))
    else:
        print(matrix())


if __name__ == "__main__":
    main()
