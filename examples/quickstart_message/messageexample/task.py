"""The task of Flower's quickstart-pytorch: its ``Net`` and a flwr-datasets pipeline of dict
batches, reading Fashion-MNIST from the local files flwr_pfl provisions
(``python -m flwr_pfl.data.provision``) instead of downloading CIFAR-10, so that it runs
offline; hence one input channel and 28 x 28 images in ``Net``."""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import torch.nn.functional as F
from datasets import Dataset
from flwr_datasets.partitioner import IidPartitioner
from torch import nn
from torch.utils.data import DataLoader

from flwr_pfl.clients import LocalData
from flwr_pfl.data.vision import load_vision_pool


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz'), as in Flower's example."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 4 * 4)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


@lru_cache(maxsize=4)
def partitioner(num_partitions: int, data_dir: str, max_samples: int) -> IidPartitioner:
    """The flwr-datasets partitioner over the first ``max_samples`` Fashion-MNIST images."""
    pool = load_vision_pool("fashion-mnist", os.path.expanduser(data_dir), download=False)
    n = min(max_samples, len(pool.y))
    iid = IidPartitioner(num_partitions=num_partitions)
    iid.dataset = Dataset.from_dict({"image": pool.x[:n].numpy(), "label": pool.y[:n].numpy()})
    return iid


def apply_transforms(batch: dict) -> dict:
    """Scale the images to [-1, 1] as Flower's example does (``Normalize((0.5,), (0.5,))``)."""
    images = torch.as_tensor(batch["image"], dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    return {"image": (images - 0.5) / 0.5, "label": torch.as_tensor(batch["label"])}


def load_data(partition_id: int, num_partitions: int, data_dir: str, max_samples: int = 3000) -> LocalData:
    """This client's partition: 80% train, 20% test, as dict-batch loaders (Flower's split)."""
    partition = partitioner(num_partitions, data_dir, max_samples).load_partition(partition_id)
    split = partition.train_test_split(test_size=0.2, seed=42)
    return LocalData(
        train=DataLoader(split["train"].with_transform(apply_transforms), batch_size=32, shuffle=True),
        test=DataLoader(split["test"].with_transform(apply_transforms), batch_size=64),
    )
