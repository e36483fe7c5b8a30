"""The task of Flower's advanced-pytorch example: its ``Net``, its ``train`` / ``test`` and its
Dirichlet partitions of Fashion-MNIST with its transforms.

What changed: the images are read from the local files flwr_pfl provisions
(``python -m flwr_pfl.data.provision``) instead of downloaded from the Hugging Face hub, so that
the example runs on offline nodes; ``max-samples`` caps the training images shared out and the
server's test set is a slice of the test images. ``train`` is kept for reference (the flwr_pfl
clients train with their own loop); the server-side evaluation uses ``test``. Run directories
are created under a configurable ``outputs-dir``.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner
from torch import nn
from torch.utils.data import DataLoader
from torchvision.transforms import Compose, Normalize, RandomCrop, RandomHorizontalFlip

from flwr_pfl.clients import LocalData
from flwr_pfl.data.vision import load_vision_pool

FM_NORMALIZATION = ((0.1307,), (0.3081,))
EVAL_TRANSFORMS = Normalize(*FM_NORMALIZATION)
TRAIN_TRANSFORMS = Compose([RandomCrop(28, padding=4), RandomHorizontalFlip(), Normalize(*FM_NORMALIZATION)])
#: the pool holds Fashion-MNIST's 60,000 training images, then its 10,000 test images
TRAIN_IMAGES = 60_000


class Net(nn.Module):
    """Model (simple CNN adapted for Fashion-MNIST), as in Flower's example."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 32 * 4 * 4)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def train(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float, device: str) -> float:
    """Train the model on the training set (Flower's)."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["image"]
            labels = batch["label"]
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / len(trainloader)


def test(net: nn.Module, testloader: DataLoader, device: str) -> tuple[float, float]:
    """Validate the model on the test set (Flower's)."""
    net.to(device)
    net.eval()
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["image"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy


def _images(batch: dict) -> torch.Tensor:
    """The batch's uint8 images as float tensors in [0, 1] (what Flower's ``ToTensor`` gives)."""
    return torch.as_tensor(batch["image"], dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0


def apply_train_transforms(batch: dict) -> dict:
    """Flower's training augmentation: random crop and flip, then normalisation."""
    images = torch.stack([TRAIN_TRANSFORMS(img) for img in _images(batch)])
    return {"image": images, "label": torch.as_tensor(batch["label"])}


def apply_eval_transforms(batch: dict) -> dict:
    """Flower's evaluation transform: normalisation only."""
    return {"image": EVAL_TRANSFORMS(_images(batch)), "label": torch.as_tensor(batch["label"])}


@lru_cache(maxsize=4)
def partitioner(num_partitions: int, data_dir: str, max_samples: int) -> DirichletPartitioner:
    """Flower's partitioner (Dirichlet over the labels, alpha 1.0, seed 42) over the first
    ``max_samples`` training images."""
    pool = load_vision_pool("fashion-mnist", os.path.expanduser(data_dir), download=False)
    n = min(max_samples, TRAIN_IMAGES)
    dirichlet = DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=1.0, seed=42)
    dirichlet.dataset = Dataset.from_dict({"image": pool.x[:n].numpy(), "label": pool.y[:n].numpy()})
    return dirichlet


def load_data(partition_id: int, num_partitions: int, data_dir: str, max_samples: int) -> LocalData:
    """This node's partition: 80% train, 20% test, as Flower's example splits it."""
    partition = partitioner(num_partitions, data_dir, max_samples).load_partition(partition_id)
    split = partition.train_test_split(test_size=0.2, seed=42)
    return LocalData(
        train=DataLoader(split["train"].with_transform(apply_train_transforms), batch_size=32, shuffle=True),
        test=DataLoader(split["test"].with_transform(apply_eval_transforms), batch_size=32),
    )


def load_centralized_testset(data_dir: str, samples: int) -> DataLoader:
    """The first ``samples`` Fashion-MNIST test images, for the server-side evaluation (Flower's
    example uses the whole test split, downloaded)."""
    pool = load_vision_pool("fashion-mnist", os.path.expanduser(data_dir), download=False)
    end = TRAIN_IMAGES + min(samples, len(pool.y) - TRAIN_IMAGES)
    testset = Dataset.from_dict({"image": pool.x[TRAIN_IMAGES:end].numpy(), "label": pool.y[TRAIN_IMAGES:end].numpy()})
    return DataLoader(testset.with_transform(apply_eval_transforms), batch_size=32)


def create_run_dir(config: dict, outputs_dir: str = "outputs") -> tuple[Path, str]:
    """Create a directory where to save results from this run (Flower's, under ``outputs_dir``;
    microseconds in the name so that two runs in one second do not collide)."""
    run_dir = datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")
    save_path = Path(outputs_dir).expanduser().resolve() / run_dir
    save_path.mkdir(parents=True, exist_ok=False)
    with open(save_path / "run_config.json", "w", encoding="utf-8") as fp:
        json.dump(dict(config), fp)
    return save_path, run_dir
