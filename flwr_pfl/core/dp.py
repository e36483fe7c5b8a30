"""Client-level differential privacy of a mean of client updates (DP-FedAvg), as plain functions.

The unit of privacy is one client: its whole dataset, present or absent (add-or-remove-one
neighbouring federations). A round releases

    mean = (sum_i clip(u_i, C) + N(0, (z C)^2 I)) / m                     (McMahan et al. 2018, Alg. 1)

where ``u_i`` is client i's update (its reply minus the global arrays it was sent), ``clip``
scales it to L2 norm at most ``C``, ``z`` is the noise multiplier and ``m`` the number of clients
*sampled* for the round (fixed before anyone answers, so that a client that drops out or is
rejected does not raise any other client's weight). The sum has L2 sensitivity ``C``, so each
release is a Gaussian mechanism with noise multiplier ``z``; the weights are uniform, because an
example-weighted mean lets one client's count buy it any weight and so bounds nothing.

Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive
Clipping", Alg. 1 and Thm. 1) moves ``C`` towards the ``gamma`` quantile of the update norms:

    b_i = 1[||u_i|| <= C]                                  (the update was not clipped)
    b~  = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2   (sensitivity 1/2: the centred bits)
    C  <- C * exp(-eta (b~ - gamma))                        (geometric update)

and, to spend the same privacy as a fixed-clipping round with multiplier ``z``, noises the
updates with ``z_u = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Thm. 1). The new ``C`` is used from the
next round on: the round's own noise is scaled by the ``C`` its updates were clipped to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from flwr_pfl.core.robust import update_norm

NDArrays = list[np.ndarray]

#: Andrew et al.'s default share of the clipped-count noise: sigma_b = m / 20
COUNT_STDDEV_PER_CLIENT = 1 / 20


def clip_to_norm(update: Sequence[np.ndarray], max_norm: float) -> tuple[NDArrays, bool]:
    """``update * min(1, max_norm / ||update||)`` (float64; floating-point arrays) and whether it was within the bound
    (``b_i`` of adaptive clipping: True when not scaled down).

    Raises:
        ValueError: ``max_norm`` is not > 0.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    norm = update_norm(update)
    within = norm <= max_norm
    scale = 1.0 if within else max_norm / norm
    return [np.asarray(a, dtype=np.float64) * scale for a in update], within


def noise_std(noise_multiplier: float, clip_norm: float, num_sampled: int) -> float:
    """The standard deviation of the noise on each coordinate of the mean: ``z C / m``."""
    if num_sampled < 1:
        raise ValueError(f"num_sampled must be >= 1, got {num_sampled}")
    return noise_multiplier * clip_norm / num_sampled


def private_mean(
    updates: Sequence[Sequence[np.ndarray]],
    clip_norm: float,
    noise_multiplier: float,
    num_sampled: int,
    rng: np.random.Generator,
) -> tuple[NDArrays, list[bool]]:
    """The noised mean of the clipped updates, ``(sum_i clip(u_i, C) + N(0, (z C)^2)) / m``, and
    each update's ``b_i`` (True: within ``C``).

    ``num_sampled`` (``m``) is the round's planned number of clients, not the number of updates
    received: fewer updates (dropouts, rejected replies) mean a smaller sum, never a larger
    weight for the others. An empty ``updates`` is refused: there is no layout to noise.

    Raises:
        ValueError: no updates, more updates than ``num_sampled``, layouts that differ, or a
            negative noise multiplier.
    """
    if not updates:
        raise ValueError("private_mean needs at least one update")
    if len(updates) > num_sampled:
        raise ValueError(f"{len(updates)} updates for {num_sampled} sampled clients: m must count every sampled client")
    if noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    shapes = [np.shape(a) for a in updates[0]]
    if any([np.shape(a) for a in u] != shapes for u in updates):
        raise ValueError("the updates do not share one layout")
    total = [np.zeros(s, dtype=np.float64) for s in shapes]
    bits = []
    for update in updates:
        clipped, within = clip_to_norm(update, clip_norm)
        bits.append(within)
        for acc, part in zip(total, clipped):
            acc += part
    sigma = noise_multiplier * clip_norm
    return [(acc + rng.normal(0.0, sigma, size=acc.shape)) / num_sampled for acc in total], bits


def update_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """``z_u = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al., Thm. 1): the updates' noise
    multiplier that, with the clipped count noised by ``sigma_b``, spends what one Gaussian
    release with multiplier ``z`` spends.

    Raises:
        ValueError: ``z`` is not > 0, or ``sigma_b <= z / 2`` (the count alone would spend more
            than the whole budget).
    """
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
    if not count_stddev > noise_multiplier / 2:
        raise ValueError(f"the clipped count's noise ({count_stddev}) must exceed noise_multiplier / 2 "
                         f"({noise_multiplier / 2}) for the updates to keep any privacy budget")
    return (noise_multiplier ** -2 - (2 * count_stddev) ** -2) ** -0.5


def noisy_unclipped_fraction(bits: Sequence[bool], count_stddev: float, num_sampled: int, rng: np.random.Generator) -> float:
    """``b~ = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2``: the share of the round's
    clients whose update was within the clipping norm, noised (Andrew et al., Alg. 1). Centring
    the bits halves the sum's sensitivity (one client moves it by 1/2), which Thm. 1 assumes."""
    if num_sampled < 1:
        raise ValueError(f"num_sampled must be >= 1, got {num_sampled}")
    centred = sum(float(b) - 0.5 for b in bits)
    return (centred + float(rng.normal(0.0, count_stddev))) / num_sampled + 0.5


def adapt_clip_norm(clip_norm: float, unclipped_fraction: float, target_quantile: float, learning_rate: float) -> float:
    """``C exp(-eta (b~ - gamma))``: smaller when more than ``gamma`` of the updates fit."""
    return clip_norm * math.exp(-learning_rate * (unclipped_fraction - target_quantile))
