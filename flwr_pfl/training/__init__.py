"""Shared torch training utilities: devices, seeding, optimizers, parameter groups, batches, loops, state."""

from flwr_pfl.training.batches import BatchKeys, dataset_targets, loader_like, num_samples, read_batch
from flwr_pfl.training.device import resolve_device, set_num_threads
from flwr_pfl.training.loops import (
    EvalResult,
    TrainStats,
    collect_features,
    evaluate,
    per_sample_loss,
    supervised_loss,
    train,
)
from flwr_pfl.training.norms import FROZEN_NORMS, FrozenNorm, frozen_norm_modules, frozen_norms
from flwr_pfl.training.optim import OptimizerConfig, make_optimizer
from flwr_pfl.training.params import (
    NDArrays,
    get_arrays,
    group_keys,
    group_parameters,
    group_shapes,
    only_trainable,
    set_arrays,
)
from flwr_pfl.training.seed import client_seed, seed_everything, seeded
from flwr_pfl.training.state import load_arrays, load_scalars, save_arrays, save_scalars

__all__ = [
    "BatchKeys", "dataset_targets", "loader_like", "num_samples", "read_batch",
    "FROZEN_NORMS", "FrozenNorm", "frozen_norm_modules", "frozen_norms",
    "EvalResult", "NDArrays", "OptimizerConfig", "TrainStats", "client_seed", "collect_features", "evaluate",
    "get_arrays", "group_keys", "group_parameters", "group_shapes", "load_arrays", "load_scalars",
    "make_optimizer", "only_trainable", "per_sample_loss", "resolve_device", "save_arrays",
    "save_scalars", "seed_everything", "seeded", "set_arrays", "set_num_threads", "supervised_loss", "train",
]
