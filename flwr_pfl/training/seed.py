"""Seeding for reproducible runs.

Two rules keep reruns identical whatever order clients run in (threads of the legacy server
loop, Ray actors): the server draws every random choice from its own generators (see
:mod:`flwr_pfl.strategies.sampling`), and a client's randomness is scoped to the message it
handles (:func:`seeded`), so no client reads or leaves behind random state that the server or
another client uses.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) global generators.

    For a process's own start-up (a script, the ServerApp); clients use :func:`seeded`.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def seeded(seed: int, device: torch.device | str | None = None) -> Iterator[None]:
    """Run a block with torch's generators seeded to ``seed``, then restore their previous state.

    Covers what a client's training draws from: torch's CPU generator (model initialisation,
    DataLoader shuffling, dropout, transforms) and, when ``device`` is a CUDA device, that
    device's generator. Python's ``random`` and NumPy's global generator are left untouched: no
    client code draws from them, and the server's client sampling must not be disturbed.
    """
    device = torch.device(device) if device is not None else None
    cuda = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        for d in cuda:
            with torch.cuda.device(d):
                torch.cuda.manual_seed(seed)
        yield


def client_seed(seed: int, partition_id: int, server_round: int = 0) -> int:
    """A distinct, reproducible seed for one client in one round."""
    return seed * 1_000_003 + partition_id * 10_007 + server_round
