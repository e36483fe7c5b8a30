"""A node's own data, read from its own disk: an image folder or a file of arrays.

A deployed node can train on data that never leaves it instead of a slice of a public dataset.
:class:`NodeDataSpec` says where the data is and how to split it (the node config's ``data-*``
keys, parsed by :mod:`flwr_pfl.app.node_settings`); :func:`load_node_data` turns it into the
same :class:`~flwr_pfl.data.types.ClientData` a public-dataset slice gives.

Formats (chosen by the path):

* a directory: ``torchvision.datasets.ImageFolder``'s layout ``<root>/<class>/<image>``; the
  classes are the sub-folder names in sorted order (every node must have the same folders; an
  empty one keeps a class the node holds no image of). Images are converted to ``L`` (1 channel)
  or ``RGB`` (3), optionally resized, and scaled to [0, 1].
* ``.npz``: arrays ``x`` (inputs, (N, ...)), ``y`` (integer class labels, (N,)) and optionally
  ``domain`` (integer domain labels, (N,)); read with ``allow_pickle=False``, so a file that
  carries pickled objects is refused rather than executed.
* ``.pt`` / ``.pth``: a dict of tensors with the same keys, read with
  ``torch.load(weights_only=True)`` (no arbitrary objects).

The test split is a second path of the same kind, or a seeded random fraction of the data; the
validation split is a fraction of the training part (the run's ``val-fraction``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flwr_pfl.data.sampling import stage_rng
from flwr_pfl.data.splits import split_indices
from flwr_pfl.data.types import ArraySplit, ClientData, no_training_samples
from flwr_pfl.errors import ConfigError

ARRAY_SUFFIXES = (".npz", ".pt", ".pth")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
FORMATS = ("image-folder", "npz", "torch")


@dataclass(frozen=True)
class NodeDataSpec:
    """Where a node's own data is and how it is split and shaped.

    Attributes:
        path: absolute path of the data: an image folder, a ``.npz`` or a ``.pt`` file.
        test_path: absolute path of the test data, of the same kind ("" = split ``path``).
        test_fraction: share of ``path`` held out for testing when there is no ``test_path``,
            in [0, 1); None = the run's ``test-fraction``.
        split_seed: seed of that split; None = the run's ``seed``.
        num_classes: the federation's number of classes (0 = as many as the data shows: the
            class folders, or the largest label + 1).
        num_domains: the federation's number of domains (0 = the largest domain label + 1).
        image_size: (height, width) images are resized to; None keeps their size (then every
            image must have the same size).
        image_channels: 1 (grey) or 3 (RGB) channels of images.
    """

    path: str
    test_path: str = ""
    test_fraction: float | None = None
    split_seed: int | None = None
    num_classes: int = 0
    num_domains: int = 0
    image_size: tuple[int, int] | None = None
    image_channels: int = 3

    @property
    def format(self) -> str:
        return data_format(self.path)


def data_format(path: str) -> str:
    """``image-folder``, ``npz`` or ``torch`` for ``path`` (which must exist).

    Raises:
        ConfigError: the path does not exist or its kind is not one of :data:`FORMATS`.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{path} does not exist")
    if p.is_dir():
        return "image-folder"
    suffix = p.suffix.lower()
    if suffix == ".npz":
        return "npz"
    if suffix in (".pt", ".pth"):
        return "torch"
    raise ConfigError(
        f"{path} is neither a directory (an image folder <root>/<class>/<image>) nor a "
        f"{', '.join(ARRAY_SUFFIXES)} file"
    )


@dataclass(frozen=True, eq=False)
class _Samples:
    """Samples read from one path, before the split."""

    x: torch.Tensor  # float32 (N, *input_shape)
    y: torch.Tensor  # int64 (N,)
    domain: torch.Tensor  # int64 (N,)
    classes: tuple[str, ...]  # class names of an image folder; () for arrays


def read_arrays(path: str) -> _Samples:
    """``x``, ``y`` and optional ``domain`` of a ``.npz`` or ``.pt`` file, never unpickling.

    Raises:
        ConfigError: the file holds pickled objects, lacks ``x`` or ``y``, or its arrays have
            the wrong types or lengths.
    """
    if data_format(path) == "npz":
        try:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {key: npz[key] for key in npz.files}
        except ValueError as err:  # object arrays need pickle
            raise ConfigError(f"{path}: cannot be read without unpickling objects ({err}); save plain "
                              "numeric arrays (numpy.savez with x, y[, domain])") from None
        tensors = {key: torch.from_numpy(np.ascontiguousarray(a)) for key, a in arrays.items()}
    else:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - torch names what it refused
            raise ConfigError(f"{path}: not a file of tensors that torch.load(weights_only=True) accepts: {err}") from None
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise ConfigError(f"{path}: must hold a dict of tensors {{'x': ..., 'y': ...[, 'domain': ...]}}")
        tensors = dict(loaded)
    missing = [key for key in ("x", "y") if key not in tensors]
    if missing:
        raise ConfigError(f"{path}: lacks array(s) {', '.join(missing)}; it holds {', '.join(sorted(tensors)) or 'none'} "
                          "(needed: x, y; optional: domain)")
    x, y = tensors["x"], tensors["y"]
    domain = tensors.get("domain", torch.zeros(len(y), dtype=torch.int64))
    for key, labels in (("y", y), ("domain", domain)):
        if labels.dim() != 1 or labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise ConfigError(f"{path}: {key} must be a 1-d array of integer labels, got dtype {labels.dtype} "
                              f"shape {tuple(labels.shape)}")
    if not (x.dtype.is_floating_point or x.dtype == torch.uint8):
        raise ConfigError(f"{path}: x must be floating point or uint8 pixels, got dtype {x.dtype}")
    if x.dim() < 2 or not len(x) == len(y) == len(domain):
        raise ConfigError(f"{path}: x (shape {tuple(x.shape)}), y ({len(y)}) and domain ({len(domain)}) must hold "
                          "one entry per sample, x with at least one feature dimension")
    x = x.to(torch.float32).div_(255.0) if x.dtype == torch.uint8 else x.to(torch.float32)
    return _Samples(x, y.to(torch.int64), domain.to(torch.int64), ())


def read_image_folder(root: str, image_size: tuple[int, int] | None, channels: int) -> _Samples:
    """The images under ``root/<class>/`` as float tensors in [0, 1], (N, channels, H, W).

    Raises:
        ConfigError: no class folder or no image, or images of different sizes and no
            ``image_size`` to resize them to.
    """
    from PIL import Image
    from torchvision.datasets import ImageFolder

    try:
        folder = ImageFolder(root, allow_empty=True, is_valid_file=lambda p: p.lower().endswith(IMAGE_SUFFIXES))
    except FileNotFoundError as err:
        raise ConfigError(f"{root}: not an image folder <root>/<class>/<image>: {err}") from None
    if not folder.samples:
        raise ConfigError(f"{root}: no image ({', '.join(IMAGE_SUFFIXES)}) in its class folders {folder.classes}")
    mode = {1: "L", 3: "RGB"}[channels]
    pixels = []
    for file, _ in folder.samples:
        with Image.open(file) as image:
            image = image.convert(mode)
            if image_size is not None:
                image = image.resize((image_size[1], image_size[0]), Image.Resampling.BILINEAR)
            array = np.asarray(image, dtype=np.uint8).reshape(image.height, image.width, channels)
        if pixels and array.shape != pixels[0].shape:
            raise ConfigError(
                f"{root}: {file} is {array.shape[1]}x{array.shape[0]} but {folder.samples[0][0]} is "
                f"{pixels[0].shape[1]}x{pixels[0].shape[0]}; give the node config image-size=<height>x<width>"
            )
        pixels.append(array)
    x = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).contiguous().to(torch.float32).div_(255.0)
    y = torch.tensor(folder.targets, dtype=torch.int64)
    return _Samples(x, y, torch.zeros(len(y), dtype=torch.int64), tuple(folder.classes))


def read_samples(path: str, spec: NodeDataSpec) -> _Samples:
    """The samples at ``path`` in its format."""
    if data_format(path) == "image-folder":
        return read_image_folder(path, spec.image_size, spec.image_channels)
    return read_arrays(path)


def _count(what: str, labels: torch.Tensor, declared: int, key: str, path: str) -> int:
    """``declared`` (or largest label + 1 when 0), checked against ``labels``."""
    if len(labels) and int(labels.min()) < 0:
        raise ConfigError(f"{path}: {what} labels must be >= 0, found {int(labels.min())}")
    seen = int(labels.max()) + 1 if len(labels) else 1
    if declared and seen > declared:
        raise ConfigError(f"{path}: {what} label {seen - 1} but the node config says {key}={declared} "
                          f"(labels must lie in 0..{declared - 1})")
    return declared or seen


def load_node_data(spec: NodeDataSpec, *, val_fraction: float, test_fraction: float, seed: int,
                   who: str) -> ClientData:
    """The node's train / val / test splits from its own files.

    Without ``spec.test_path`` the samples are split with a generator seeded by
    ``spec.split_seed`` (or ``seed``): ``spec.test_fraction`` (or ``test_fraction``) for test,
    ``val_fraction`` for validation; with it, ``val_fraction`` of ``spec.path`` is validation.

    Raises:
        ConfigError: unreadable or inconsistent data (naming the file), train and test data of
            different shapes or classes, or no training sample left.
    """
    main = read_samples(spec.path, spec)
    split_seed = seed if spec.split_seed is None else spec.split_seed
    rng = stage_rng(split_seed, "node-data-split")
    everything = np.arange(len(main.y))
    if spec.test_path:
        test = read_samples(spec.test_path, spec)
        if test.x.shape[1:] != main.x.shape[1:] or test.classes != main.classes:
            raise ConfigError(
                f"{who}: the test data {spec.test_path} (inputs {tuple(test.x.shape[1:])}, classes "
                f"{list(test.classes) or 'labels'}) does not match {spec.path} (inputs {tuple(main.x.shape[1:])}, "
                f"classes {list(main.classes) or 'labels'})"
            )
        parts = split_indices(everything, val_fraction, 0.0, rng)
        idx = [torch.from_numpy(p) for p in (parts.train, parts.val)]
        train, val = (ArraySplit(main.x[i], main.y[i], main.domain[i]) for i in idx)
        test_split = ArraySplit(test.x, test.y, test.domain)
    else:
        fraction = test_fraction if spec.test_fraction is None else spec.test_fraction
        parts = split_indices(everything, val_fraction, fraction, rng)
        train, val, test_split = (
            ArraySplit(main.x[i], main.y[i], main.domain[i])
            for i in (torch.from_numpy(p) for p in (parts.train, parts.val, parts.test))
        )
    if len(train) == 0:
        raise no_training_samples(who, f" ({len(main.y)} samples in {spec.path}, none left for training)")
    all_y = torch.cat([train.y, val.y, test_split.y])
    all_domain = torch.cat([train.domain, val.domain, test_split.domain])
    num_classes = len(main.classes) if main.classes else 0
    if main.classes and spec.num_classes and spec.num_classes != num_classes:
        raise ConfigError(f"{who}: {spec.path} has {num_classes} class folders {list(main.classes)} but the node "
                          f"config says num-classes={spec.num_classes}")
    num_classes = _count("class", all_y, spec.num_classes or num_classes, "num-classes", spec.path)
    num_domains = _count("domain", all_domain, spec.num_domains, "num-domains", spec.path)
    return ClientData(train=train, val=val, test=test_split, num_classes=num_classes, num_domains=num_domains,
                      input_shape=tuple(main.x.shape[1:]))


def class_names(spec: NodeDataSpec) -> tuple[str, ...]:
    """The class folder names of an image-folder source (() for arrays)."""
    from torchvision.datasets.folder import find_classes

    if spec.format != "image-folder":
        return ()
    return tuple(find_classes(spec.path)[0])
