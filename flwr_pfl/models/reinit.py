"""A fresh initialisation of part of a model, drawn under a given seed: what the model's own
constructor would have drawn, for methods that need several different starting models (IFCA's
k cluster models).

PyTorch's layers initialise themselves in ``reset_parameters()``, which their constructors call
in the order the modules are registered. :func:`redrawn_arrays` calls it on a CPU copy of the
model, in the same order, under its own seeded generator: for a model built of such layers
(``nn.Linear``, ``nn.Conv*``, the normalisation layers, ``nn.Embedding``, ...) the result is the
model as built after ``torch.manual_seed(seed)``, whatever device or random state the original is
in, and the original is left untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
from torch import nn

from flwr_pfl.errors import ConfigError
from flwr_pfl.training.params import arrays_of_keys
from flwr_pfl.training.seed import seeded

NDArrays = list[np.ndarray]


def redrawn_arrays(model: nn.Module, keys: Sequence[str], seed: int) -> NDArrays:
    """The ``state_dict`` entries ``keys`` of ``model`` re-initialised under ``seed``, as arrays in
    the order of ``keys``.

    Every module whose ``state_dict`` entries all lie in ``keys`` and that has a
    ``reset_parameters()`` is reset, in registration order (a module reset this way resets its
    submodules itself, so they are not reset again). Entries of no such module keep their
    current values.

    Raises:
        ConfigError: no module within ``keys`` can be re-initialised (none has ``reset_parameters``),
            so nothing new could be drawn.
    """
    wanted = set(keys)
    fresh = copy.deepcopy(model).cpu()
    reset: list[str] = []
    with seeded(seed):
        for name, module in fresh.named_modules():
            if any(name.startswith(f"{done}.") or not done for done in reset):
                continue  # inside a module already reset
            own = [f"{name}.{key}" if name else key for key in module.state_dict()]
            if own and set(own) <= wanted and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
                reset.append(name)
    if not reset:
        raise ConfigError(
            f"none of {type(model).__name__}'s modules among the {len(wanted)} tensors to re-initialise has "
            "reset_parameters(), so no new starting weights can be drawn for them; give the model's layers a "
            "reset_parameters() method (torch's layers have one), or pass the starting arrays yourself"
        )
    return arrays_of_keys(fresh, list(keys))
