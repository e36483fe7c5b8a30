"""What each install of flwr_pfl brings: distributions and megabytes, from this environment.

Walks the dependency closure of ``flwr_pfl`` (its required dependencies only: the lean node
install), of each extra, and of ``flwr`` alone (Flower's own base install, for reference), over
the distributions installed in this environment (each one's size is the sum of the files its
RECORD lists), and writes ``<out>/install_footprint.json`` and ``.md``. torch's size depends on
its build (a CUDA build is several GB, a CPU build under 1 GB), so the table also gives every
figure without torch, torchvision and NVIDIA's CUDA libraries.

    python simulations/install_footprint.py
"""

from __future__ import annotations

import argparse
import json
import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("simulation", "datasets", "plots", "tracking", "privacy", "all")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def size_mb(dist: metadata.Distribution) -> float:
    total = 0
    for file in dist.files or ():
        path = Path(dist.locate_file(file))
        if path.is_file():
            total += path.stat().st_size
    return total / 2**20


def closure(root: str, extras: tuple[str, ...] = ()) -> set[str]:
    """Every distribution ``root[extras]`` needs, as installed here (markers evaluated)."""
    seen: set[str] = set()
    todo = [(canonical(root), set(extras))]
    while todo:
        name, wanted = todo.pop()
        key = f"{name}[{','.join(sorted(wanted))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (wanted or {""})):
                todo.append((canonical(req.name), set(req.extras)))
    return {k.split("[")[0] for k in seen if _installed(k.split("[")[0])}


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def figures(names: set[str]) -> dict[str, float]:
    sizes = {n: size_mb(metadata.distribution(n)) for n in names}
    heavy = {n for n in names if n in ("torch", "torchvision", "triton") or n.startswith(("nvidia-", "cuda-"))}
    return {"distributions": len(names), "mb": round(sum(sizes.values()), 1),
            "mb_without_torch_and_cuda": round(sum(v for n, v in sizes.items() if n not in heavy), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmark")
    args = parser.parse_args()
    rows = {"flwr (Flower alone)": figures(closure("flwr")), "flwr_pfl (node install)": figures(closure("flwr-pfl"))}
    before = set().union(*(closure("flwr-pfl", (e,)) for e in ("simulation", "datasets", "plots")))
    rows["flwr_pfl before the extras (Ray, Flower Datasets, matplotlib required)"] = figures(before)
    for extra in EXTRAS:
        rows[f"flwr_pfl[{extra}]"] = figures(closure("flwr-pfl", (extra,)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "install_footprint.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# Install footprint", "",
             "Distributions each install brings and their installed size, measured in one environment by "
             "`python simulations/install_footprint.py` (torch's own size depends on its build, so the last "
             "column leaves out torch, torchvision and the CUDA libraries).", "",
             "| install | distributions | MB | MB without torch and CUDA |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {v['distributions']} | {v['mb']:.0f} | {v['mb_without_torch_and_cuda']:.0f} |" for k, v in rows.items()]
    (args.out / "install_footprint.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
