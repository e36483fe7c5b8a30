"""Test-wide settings: one torch thread (2-core machines), deterministic seeds."""

import os

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("FLWR_PFL_DATA_DIR", str(Path.home() / ".cache" / "flwr_pfl" / "data")))


def fashion_mnist_available() -> bool:
    return (DATA_DIR / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").exists()


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The offline datasets (scripts/setup.sh provides them); tests needing them skip otherwise."""
    if not fashion_mnist_available():
        pytest.skip(f"Fashion-MNIST is not provisioned under {DATA_DIR} (run scripts/setup.sh)")
    return DATA_DIR


@pytest.fixture(scope="session")
def blobs_dataset() -> str:
    """Register 'test-blobs': 4 Gaussian classes in 20 dimensions, 1200 samples (no files)."""
    from flwr_pfl.data.registry import DatasetPool, register_dataset

    def build(config) -> DatasetPool:
        g = torch.Generator().manual_seed(1234)
        centers = 2.0 * torch.randn(4, 20, generator=g)
        y = torch.arange(1200) % 4
        x = centers[y] + torch.randn(1200, 20, generator=g)
        return DatasetPool(x=x, y=y, domain=torch.zeros(1200, dtype=torch.long), num_classes=4)

    register_dataset("test-blobs", build, replace=True)
    return "test-blobs"
