"""The task: torchvision's ResNet-18 (BatchNorm after every convolution) for Fashion-MNIST, and
Dirichlet partitions of Fashion-MNIST as dict batches.

The model is torchvision's own, built with ``num_classes=10``; only its first convolution
changes, to take one channel with a 3 x 3 kernel and stride 1 (ImageNet's 7 x 7 with stride 2
would leave 7 x 7 maps of a 28 x 28 image after the max-pooling). The max-pooling stays, so the
residual stages start at 14 x 14: dropping it too, as is usual for CIFAR's 32 x 32 images,
costs about three times as much compute, which matters on CPU-only nodes. The model has 20
BatchNorm layers; its head is ``fc``, a ``Linear(512, 10)``.

The images are read from the local files flwr_pfl provisions (``python -m
flwr_pfl.data.provision``), not downloaded, so that the example runs on offline nodes.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner
from torch import nn
from torch.utils.data import DataLoader
from torchvision.models import resnet18
from torchvision.transforms import Normalize

from flwr_pfl.clients import LocalData
from flwr_pfl.data.vision import load_vision_pool

FM_NORMALIZATION = ((0.1307,), (0.3081,))
NORMALIZE = Normalize(*FM_NORMALIZATION)
#: the pool holds Fashion-MNIST's 60,000 training images, then its 10,000 test images
TRAIN_IMAGES = 60_000
#: the name of the model's head module (its last ``Linear``)
HEAD = "fc"


def make_model() -> nn.Module:
    """torchvision's ResNet-18 for 1-channel 28 x 28 images and 10 classes, initialised from
    seed 0: the same initial weights on the server and on every client."""
    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    return model


def apply_transforms(batch: dict) -> dict:
    """The uint8 images as normalised float tensors (1 x 28 x 28)."""
    images = torch.as_tensor(batch["image"], dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    return {"image": NORMALIZE(images), "label": torch.as_tensor(batch["label"])}


@lru_cache(maxsize=4)
def partitioner(num_partitions: int, data_dir: str, max_samples: int) -> DirichletPartitioner:
    """Dirichlet partitions over the labels (alpha 1.0, seed 42, as Flower's advanced-pytorch
    example) of the first ``max_samples`` training images."""
    pool = load_vision_pool("fashion-mnist", os.path.expanduser(data_dir), download=False)
    n = min(max_samples, TRAIN_IMAGES)
    dirichlet = DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=1.0, seed=42)
    dirichlet.dataset = Dataset.from_dict({"image": pool.x[:n].numpy(), "label": pool.y[:n].numpy()})
    return dirichlet


def load_data(partition_id: int, num_partitions: int, data_dir: str, max_samples: int) -> LocalData:
    """This node's partition: 80% train, 20% test, as dict-batch loaders."""
    partition = partitioner(num_partitions, data_dir, max_samples).load_partition(partition_id)
    split = partition.train_test_split(test_size=0.2, seed=42)
    return LocalData(
        train=DataLoader(split["train"].with_transform(apply_transforms), batch_size=32, shuffle=True),
        test=DataLoader(split["test"].with_transform(apply_transforms), batch_size=64),
    )
