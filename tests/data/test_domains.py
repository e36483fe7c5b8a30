"""Domain transforms: exact rotations, colour tints, corruptions; disjoint balanced domains."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flwr_pfl.data.domains import (
    ColorTint,
    Corruption,
    Rotation,
    assign_domains,
    make_domain_transform,
    to_domains,
)
from flwr_pfl.data.types import ArraySplit
from flwr_pfl.errors import ConfigError


@pytest.fixture()
def images() -> torch.Tensor:
    return torch.rand(12, 1, 10, 10, generator=torch.Generator().manual_seed(0))


def test_rotation_by_multiples_of_90_equals_rot90(images: torch.Tensor) -> None:
    rotation = Rotation([0, 90, 180, 270])
    domain = torch.arange(12) % 4
    out = rotation(images, domain)
    for i in range(12):
        k = int(domain[i])
        assert torch.equal(out[i], torch.rot90(images[i], k, dims=(-2, -1)))


def test_rotation_steps_and_factory() -> None:
    assert Rotation.evenly(4).angles == (0.0, 15.0, 30.0, 45.0)
    made = make_domain_transform("rotation", 36, rotation_step=10)
    assert isinstance(made, Rotation) and made.angles[-1] == 350.0
    assert make_domain_transform("none", 1) is None


def test_color_tint_gives_three_channels_of_grey_times_colour(images: torch.Tensor) -> None:
    tint = ColorTint.evenly(3)
    assert torch.allclose(tint.colors, torch.eye(3))  # red, green, blue
    domain = torch.arange(12) % 3
    out = tint(images, domain)
    assert out.shape == (12, 3, 10, 10)
    for i in range(12):
        expected = images[i] * tint.colors[domain[i]].view(3, 1, 1)
        assert torch.allclose(out[i], expected)
    rgb = tint(torch.rand(2, 3, 10, 10), torch.tensor([0, 1]))
    assert rgb.shape == (2, 3, 10, 10)


def test_corruptions_in_order_with_optional_clean_domain(images: torch.Tensor) -> None:
    assert Corruption.first(2).kinds == ("gaussian-noise", "blur")
    clean = Corruption.first(5, clean=True)
    assert clean.kinds == ("identity", "gaussian-noise", "blur", "contrast", "invert")
    domain = torch.arange(12) % 5
    out = clean(images, domain, torch.Generator().manual_seed(1))
    same = clean(images, domain, torch.Generator().manual_seed(1))
    other = clean(images, domain, torch.Generator().manual_seed(2))
    assert torch.equal(out, same) and not torch.equal(out[domain == 1], other[domain == 1])
    assert torch.equal(out[domain == 0], images[domain == 0])
    assert torch.allclose(out[domain == 4], 1 - images[domain == 4])
    assert 0 <= out.min() and out.max() <= 1
    blurred, original = out[domain == 2], images[domain == 2]
    assert blurred.std() < original.std()
    low_contrast = out[domain == 3]
    assert low_contrast.std() < images[domain == 3].std()


def test_noise_std_and_clipping_take_effect() -> None:
    x = torch.full((200, 1, 10, 10), 0.5)
    noisy = torch.ones(200, dtype=torch.int64)
    default = Corruption.first(2, clean=True)
    assert (default.noise_std, default.noise_clip) == (0.3, True)
    out = default(x, noisy, torch.Generator().manual_seed(7))
    # the default is what it always was: x + 0.3 * N(0, 1), clipped to [0, 1]
    expected = (x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(7))).clamp(0, 1)
    assert torch.equal(out, expected)
    loud = make_domain_transform("corruption", 2, clean_domain=True, noise_std=0.8, noise_clip=False)
    out = loud(x, noisy, torch.Generator().manual_seed(7))
    assert out.min() < -1.0 and out.max() > 2.0  # unclipped: far outside [0, 1]
    assert abs((out - x).std().item() - 0.8) < 0.02 and abs((out - x).mean().item()) < 0.02
    clipped = make_domain_transform("corruption", 2, clean_domain=True, noise_std=0.8)
    out = clipped(x, noisy, torch.Generator().manual_seed(7))
    assert out.min() == 0.0 and out.max() == 1.0
    silent = Corruption.first(1, noise_std=0.0, noise_clip=False)
    assert torch.equal(silent(x, torch.zeros(200, dtype=torch.int64)), x)


def test_corruption_domain_count_is_limited() -> None:
    with pytest.raises(ConfigError, match="'num-domains' must be <= 4"):
        Corruption.first(5)


def test_transforms_need_image_batches() -> None:
    with pytest.raises(ConfigError, match=r"\(N, C, H, W\)"):
        Rotation([0, 90])(torch.rand(4, 7), torch.zeros(4, dtype=torch.int64))


def test_domains_are_disjoint_balanced_and_seeded() -> None:
    labels = np.repeat(np.arange(10), 61)
    domain = assign_domains(labels, 6, seed=3)
    assert domain.shape == labels.shape  # one domain per base sample: no image in two domains
    counts = np.bincount(domain, minlength=6)
    assert counts.max() - counts.min() <= 1
    for c in range(10):
        per_label = np.bincount(domain[labels == c], minlength=6)
        assert per_label.max() - per_label.min() <= 1
    assert (assign_domains(labels, 6, seed=3) == domain).all()
    assert (assign_domains(labels, 6, seed=4) != domain).any()


def test_domains_in_shares() -> None:
    labels = np.repeat(np.arange(10), 200)
    domain = assign_domains(labels, 2, seed=3, shares=(9, 1))
    assert np.bincount(domain).tolist() == [1800, 200]
    for c in range(10):
        assert np.bincount(domain[labels == c]).tolist() == [180, 20]
    assert (assign_domains(labels, 2, seed=3, shares=(1, 1)) == assign_domains(labels, 2, seed=3)).all()


def test_to_domains_keeps_labels_and_tags_domains(images: torch.Tensor) -> None:
    split = ArraySplit(images, torch.arange(12) % 2, torch.zeros(12, dtype=torch.int64))
    out = to_domains(split, Rotation([0, 90, 180]), seed=0)
    assert torch.equal(out.y, split.y) and out.domain_counts(3).tolist() == [4, 4, 4]
    for i in range(12):
        k = int(out.domain[i]) * 1
        assert torch.equal(out.x[i], torch.rot90(images[i], k, dims=(-2, -1)))
