"""Seeding for reproducible runs."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def client_seed(seed: int, partition_id: int, server_round: int = 0) -> int:
    """A distinct, reproducible seed for one client in one round."""
    return seed * 1_000_003 + partition_id * 10_007 + server_round
