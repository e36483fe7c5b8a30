"""Test-wide settings: one torch thread (2-core machines), deterministic seeds."""

import os

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
