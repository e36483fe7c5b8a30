"""Device selection and CPU thread settings."""

from __future__ import annotations

import torch

from flwr_pfl.errors import ConfigError


def resolve_device(spec: str = "auto") -> torch.device:
    """Turn a ``device`` setting into a torch device.

    ``auto`` picks CUDA when a GPU is visible (in simulation, Ray makes the GPU fraction given to
    the client visible), else the CPU. ``cpu``, ``cuda`` and ``cuda:<index>`` are taken as
    asked; asking for CUDA where there is none is a configuration error, not a silent fallback.
    """
    spec = spec.strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or (spec.startswith("cuda:") and spec[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={spec!r} but CUDA is not available here; use device='auto' or 'cpu'"
            )
        index = int(spec[5:]) if ":" in spec else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"device={spec!r} but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return torch.device(spec)
    raise ConfigError(f"device={spec!r} is not allowed; use 'auto', 'cpu', 'cuda' or 'cuda:<index>'")


def set_num_threads(num_threads: int) -> None:
    """Limit torch's intra-op CPU threads (0 keeps torch's default)."""
    if num_threads < 0:
        raise ConfigError(f"num-threads must be >= 0 (0 = torch default), got {num_threads}")
    if num_threads:
        torch.set_num_threads(num_threads)
