"""The real Fashion-MNIST, as provisioned into the data folder (skipped when it is not there).

The folder is ``$FLWR_PFL_DATA_DIR``, by default ``~/.cache/flwr_pfl/data`` (what
``scripts/setup.sh`` fills, with ``python -m flwr_pfl.data.provision --data-dir <folder>``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from flwr_pfl.data import DataConfig, describe_partition, load_client_data
from flwr_pfl.data.vision import expected_files, load_vision_pool

DATA_DIR = Path(
    os.environ.get("FLWR_PFL_DATA_DIR", Path.home() / ".cache" / "flwr_pfl" / "data")
).absolute()

pytestmark = pytest.mark.skipif(
    not all(p.is_file() for p in expected_files("fashion-mnist", DATA_DIR)),
    reason=f"Fashion-MNIST is not provisioned in {DATA_DIR} (set FLWR_PFL_DATA_DIR, or run "
    f"python -m flwr_pfl.data.provision --data-dir {DATA_DIR} --datasets fashion-mnist)",
)


def test_full_pool_has_the_canonical_size_and_labels() -> None:
    pool = load_vision_pool("fashion-mnist", str(DATA_DIR), False)
    assert pool.x.shape == (70_000, 1, 28, 28) and pool.x.dtype == torch.uint8
    assert torch.bincount(pool.y).tolist() == [7000] * 10
    mean = pool.x[:60_000].float().div(255).mean().item()
    assert abs(mean - 0.2860) < 1e-3  # the documented standardisation statistic


def test_label_skewed_clients_from_a_subsample() -> None:
    config = DataConfig(
        dataset="fashion-mnist", data_dir=str(DATA_DIR), partitioner="dirichlet",
        dirichlet_alpha=0.1, max_samples=5000, val_fraction=0.1, test_fraction=0.25, seed=3,
    )
    summaries = describe_partition(config, 20)
    assert sum(s.num_samples for s in summaries) == 5000
    data = load_client_data(config, 7, 20)
    assert data.input_shape == (1, 28, 28) and len(data.train) == summaries[7].num_train
    assert abs(data.train.x.mean().item()) < 1.0  # standardised, not raw [0, 1] pixels
