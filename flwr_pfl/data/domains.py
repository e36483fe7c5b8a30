"""Domain transforms: one image dataset becomes M domains, each sample keeping its domain label.

* :class:`Rotation` (Rotated MNIST): domain m is rotated counter-clockwise by its angle,
  ``m * step`` degrees by default (15 degrees as in DomainBed's RotatedMNIST) or any list.
* :class:`ColorTint` (Colored MNIST): grey images multiplied by a per-domain RGB colour
  (evenly spaced hues by default); always outputs 3 channels.
* :class:`Corruption` (corruption shift, CIFAR-10-S style): domain m gets corruption m of
  gaussian noise, gaussian blur, reduced contrast and inversion, optionally after an unchanged
  ("identity") domain 0.

Base samples are split among the domains disjointly by :func:`assign_domains` (a seeded
assignment, balanced overall and within every label, or in given integer shares), so no image
appears in two domains and the domains share one label distribution: they differ in appearance
only. Transforms act on float
batches in [0, 1] of shape (N, C, H, W), one vectorised call per domain, with
``torchvision.transforms.v2.functional``; the only random one (noise) draws from a
``torch.Generator`` the caller seeds.
"""

from __future__ import annotations

import colorsys
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flwr_pfl.data.sampling import balanced_assignment, stage_rng
from flwr_pfl.data.types import ArraySplit
from flwr_pfl.errors import ConfigError

if TYPE_CHECKING:
    from torchvision.transforms import InterpolationMode


def _functional() -> Any:
    """torchvision's tensor transforms, imported on first use: a client that applies no domain
    transform never pays the second or so that importing torchvision takes."""
    import torchvision.transforms.v2.functional as TF

    return TF


class DomainTransform(ABC):
    """How an image looks in each of ``num_domains`` domains."""

    @property
    @abstractmethod
    def num_domains(self) -> int:
        """Number of domains M; domain labels are 0..M-1."""

    def output_channels(self, channels: int) -> int:
        """Channels of the transformed images, given the input's."""
        return channels

    @abstractmethod
    def transform(self, x: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
        """Images ``x`` (float, [0, 1], (n, C, H, W)) as they appear in domain ``m``."""

    def __call__(
        self, x: torch.Tensor, domain: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Transform every image by its own domain: one batched call per domain present."""
        if x.dim() != 4:
            raise ConfigError(
                f"domain transform {type(self).__name__} needs images of shape (N, C, H, W); "
                f"got inputs of shape {tuple(x.shape)}"
            )
        if domain.numel() and (domain.min() < 0 or domain.max() >= self.num_domains):
            raise ValueError(f"domain labels must be in [0, {self.num_domains})")
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        n, c, h, w = x.shape
        out = x.new_empty((n, self.output_channels(c), h, w))
        for m in torch.unique(domain).tolist():
            mask = domain == m
            out[mask] = self.transform(x[mask], int(m), generator)
        return out


class Rotation(DomainTransform):
    """Domain m is rotated counter-clockwise by ``angles[m]`` degrees (no expand, fill 0).

    Nearest-neighbour interpolation by default, as torchvision's tensor rotation and FEDORA's
    Rotated-MNIST loader use.
    """

    def __init__(
        self,
        angles: Sequence[float],
        interpolation: InterpolationMode | str = "nearest",
    ) -> None:
        if len(angles) < 1:
            raise ConfigError("rotation needs at least one angle")
        self.angles = tuple(float(a) for a in angles)
        self.interpolation = interpolation

    @classmethod
    def evenly(cls, num_domains: int, step: float = 15.0) -> Rotation:
        """Angles 0, step, 2*step, ... for ``num_domains`` domains."""
        return cls([m * step for m in range(num_domains)])

    @property
    def num_domains(self) -> int:
        return len(self.angles)

    def transform(self, x: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
        from torchvision.transforms import InterpolationMode

        return _functional().rotate(x, self.angles[m], interpolation=InterpolationMode(self.interpolation))


class ColorTint(DomainTransform):
    """Domain m is the grey image times RGB colour ``colors[m]`` (3 output channels).

    Colour inputs are first converted to grey, so the tint is the only colour information.
    """

    def __init__(self, colors: Sequence[Sequence[float]]) -> None:
        table = torch.tensor([list(c) for c in colors], dtype=torch.float32)
        if table.dim() != 2 or table.shape[1] != 3 or len(table) < 1:
            raise ConfigError(f"colours must be a list of RGB triples; got {list(colors)}")
        if (table < 0).any() or (table > 1).any():
            raise ConfigError("colour components must be in [0, 1]")
        self.colors = table

    @classmethod
    def evenly(cls, num_domains: int) -> ColorTint:
        """Fully saturated colours with hues evenly spaced around the colour wheel (red first)."""
        return cls([colorsys.hsv_to_rgb(m / num_domains, 1.0, 1.0) for m in range(num_domains)])

    @property
    def num_domains(self) -> int:
        return len(self.colors)

    def output_channels(self, channels: int) -> int:
        return 3

    def transform(self, x: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
        grey = x if x.shape[1] == 1 else _functional().rgb_to_grayscale(x)
        return grey * self.colors[m].to(x).view(1, 3, 1, 1)


CORRUPTIONS = ("gaussian-noise", "blur", "contrast", "invert")
NOISE_STD = 0.3  # default std of the gaussian-noise corruption, in [0, 1] pixel units


class Corruption(DomainTransform):
    """Domain m gets corruption ``kinds[m]``; "identity" leaves images unchanged.

    Default strengths are chosen to be clearly visible on 28x28 digits: additive gaussian noise
    of std ``noise_std`` (clipped to [0, 1] if ``noise_clip``; unclipped, as in FedGP's noisy
    features, pixels leave [0, 1]), gaussian blur of std ``blur_sigma`` pixels (kernel
    2 * ceil(3 * sigma) + 1), contrast scaled by ``contrast`` towards each image's mean grey
    level, and inversion (1 - x).
    """

    def __init__(
        self,
        kinds: Sequence[str],
        noise_std: float = NOISE_STD,
        blur_sigma: float = 1.0,
        contrast: float = 0.3,
        noise_clip: bool = True,
    ) -> None:
        allowed = ("identity", *CORRUPTIONS)
        unknown = [k for k in kinds if k not in allowed]
        if unknown or not kinds:
            raise ConfigError(f"corruption kinds must be among {allowed}; got {list(kinds)}")
        self.kinds = tuple(kinds)
        self.noise_std = noise_std
        self.noise_clip = noise_clip
        self.blur_sigma = blur_sigma
        self.contrast = contrast

    @classmethod
    def first(
        cls,
        num_domains: int,
        clean: bool = False,
        noise_std: float = NOISE_STD,
        noise_clip: bool = True,
    ) -> Corruption:
        """The first ``num_domains`` of (identity if ``clean``), gaussian-noise, blur, contrast,
        invert; the noise as ``noise_std`` and ``noise_clip`` say."""
        kinds = (("identity",) if clean else ()) + CORRUPTIONS
        if num_domains > len(kinds):
            raise ConfigError(
                f"data config key 'num-domains' must be <= {len(kinds)} with domain-transform "
                f"'corruption' and clean-domain={clean} (corruptions: {', '.join(kinds)}); "
                f"got {num_domains}"
            )
        return cls(kinds[:num_domains], noise_std=noise_std, noise_clip=noise_clip)

    @property
    def num_domains(self) -> int:
        return len(self.kinds)

    def transform(self, x: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
        kind = self.kinds[m]
        if kind == "gaussian-noise":
            noise = torch.randn(x.shape, generator=generator, dtype=x.dtype)
            noisy = x + self.noise_std * noise
            return noisy.clamp_(0.0, 1.0) if self.noise_clip else noisy
        if kind == "blur":
            size = 2 * math.ceil(3 * self.blur_sigma) + 1
            return _functional().gaussian_blur(x, [size, size], [self.blur_sigma, self.blur_sigma])
        if kind == "contrast":
            return _functional().adjust_contrast(x, self.contrast)
        if kind == "invert":
            return _functional().invert(x)
        return x.clone()


def make_domain_transform(
    kind: str,
    num_domains: int,
    *,
    rotation_step: float = 15.0,
    clean_domain: bool = False,
    noise_std: float = NOISE_STD,
    noise_clip: bool = True,
) -> DomainTransform | None:
    """The transform named by the config's ``domain-transform`` (None for "none")."""
    if kind == "none":
        return None
    if kind == "rotation":
        return Rotation.evenly(num_domains, rotation_step)
    if kind == "color":
        return ColorTint.evenly(num_domains)
    if kind == "corruption":
        return Corruption.first(num_domains, clean_domain, noise_std, noise_clip)
    raise ConfigError(
        f"data config key 'domain-transform' must be one of 'none', 'rotation', 'color', "
        f"'corruption'; got {kind!r}"
    )


def assign_domains(
    labels: np.ndarray, num_domains: int, seed: int, shares: Sequence[int] | None = None
) -> np.ndarray:
    """One domain per sample, seeded: balanced overall and within each label, so domains hold
    disjoint samples with the same label distribution.

    With integer ``shares`` (one per domain) domain m gets ``shares[m] / sum(shares)`` of the
    samples, overall and within each label (the config's ``domain-clients``: a domain's share
    follows its number of clients, so that every client gets about as much data).
    """
    return balanced_assignment(labels, num_domains, stage_rng(seed, "domains"), shares)


def to_domains(data: ArraySplit, transform: DomainTransform, seed: int = 0) -> ArraySplit:
    """A whole split turned into ``transform.num_domains`` domains (for data outside the
    pipeline; ``data.y`` should hold class labels, ``data.x`` float images in [0, 1])."""
    classification = not data.y.is_floating_point()
    labels = data.y.numpy() if classification else np.zeros(len(data), dtype=np.int64)
    domain = torch.from_numpy(assign_domains(labels, transform.num_domains, seed))
    generator = torch.Generator().manual_seed(seed)
    return ArraySplit(transform(data.x, domain, generator), data.y, domain)
