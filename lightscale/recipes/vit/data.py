"""Image data for the ViT recipe: scikit-learn's embedded digits by default, an image folder for your own images.

``load_digits`` ships 1,797 real 8x8 handwritten digits inside scikit-learn (no download), so the recipe runs on
any fresh machine. Your images: one sub-folder per class (``root/cat/1.png``, ``root/dog/7.jpg``), read with Pillow.

Example:
    >>> dm = ImageDataModule(batch_size=32)
    >>> dm.setup("fit")
    >>> images, labels = next(iter(dm.train_dataloader()))  # float32 [32, 1, 8, 8] in [-1, 1], int64 [32]
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset
from typing_extensions import override

from lightscale.data.data_shard import DataShard, data_shard
from lightscale.recipes.gpt.data import StreamSampler

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1,797 digits as ``float32 [N, 1, 8, 8]`` in [0, 1] and ``int64 [N]`` labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise RuntimeError("the default digits data needs scikit-learn: pip install scikit-learn") from err
    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0)[:, None]
    return images, torch.from_numpy(digits.target.astype(np.int64))


def fit_size(images: torch.Tensor, size: int, mode: Literal["pad", "upsample"]) -> torch.Tensor:
    """Bring ``[N, C, h, w]`` images to ``size x size`` by centred zero padding or bilinear upsampling."""
    h = images.shape[-1]
    if size == h:
        return images
    if mode == "upsample" or size < h:
        return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    before = (size - h) // 2
    return F.pad(images, (before, size - h - before, before, size - h - before))


def read_image(path: Path, size: int, channels: int) -> torch.Tensor:
    """One image file as ``float32 [channels, size, size]`` in [0, 1] (Pillow: any format it reads)."""
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("L" if channels == 1 else "RGB").resize((size, size), Image.Resampling.BILINEAR)
        array = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(array.reshape(size, size, channels)).permute(2, 0, 1).contiguous()


class ImageFolder(Dataset):
    """``root/<class>/<image>`` files; classes sorted by name, images read lazily with Pillow."""

    def __init__(self, root: str | Path, *, image_size: int, channels: int, classes: list[str] | None = None) -> None:
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"image folder {root} does not exist")
        self.classes = classes or sorted(p.name for p in root.iterdir() if p.is_dir())
        self.samples = [
            (path, label)
            for label, name in enumerate(self.classes)
            for path in sorted((root / name).iterdir())
            if path.suffix.lower() in IMAGE_SUFFIXES
        ]
        if not self.samples:
            raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in class sub-folders of {root}")
        self.image_size, self.channels = image_size, channels

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return normalize(read_image(path, self.image_size, self.channels)), label


def normalize(images: torch.Tensor) -> torch.Tensor:
    return images * 2.0 - 1.0  # [0, 1] -> [-1, 1]


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random train/validation split of ``range(n)``."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(n * val_fraction))
    return order[n_val:], order[:n_val]


def digits_split(
    image_size: int, channels: int, resize: Literal["pad", "upsample"], val_fraction: float, seed: int
) -> tuple[TensorDataset, TensorDataset]:
    images, labels = load_digits_tensors()
    images = normalize(fit_size(images, image_size, resize)).repeat(1, channels, 1, 1)  # grey to `channels`
    train, val = split_indices(len(labels), val_fraction, seed)
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])


def replicas_of(module: pl.LightningDataModule) -> tuple[int, int]:
    """``(num_replicas, rank)`` of data parallelism, from the attached trainer's strategy when there is one."""
    trainer = getattr(module, "trainer", None)
    index, count = data_shard(trainer) if trainer is not None else DataShard(0, 1)
    return count, index


def train_loader(dataset: Dataset, module: pl.LightningDataModule, batch_size: int, seed: int) -> DataLoader:
    """Equal batches on every rank, nothing dropped over a run (the GPT recipe's StreamSampler)."""
    num_replicas, rank = replicas_of(module)
    sampler = StreamSampler(dataset, batch_size=batch_size, num_replicas=num_replicas, rank=rank, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def eval_loader(dataset: Dataset, module: pl.LightningDataModule, batch_size: int) -> DataLoader:
    """Every held-out sample once (the last few repeated to even out the ranks, as DistributedSampler does)."""
    num_replicas, rank = replicas_of(module)
    sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


class ImageDataModule(pl.LightningDataModule):
    """Digits (default) or ``image_folder`` (+ optional ``val_folder``, else a ``val_fraction`` split).

    ``batch_size`` is per data-parallel rank. ``image_size`` pads (``resize="pad"``) or upsamples the 8x8 digits,
    and is the size folder images are resized to.
    """

    def __init__(
        self,
        image_folder: str | None = None,
        *,
        val_folder: str | None = None,
        image_size: int = 8,
        channels: int = 1,
        resize: Literal["pad", "upsample"] = "pad",
        batch_size: int = 64,
        val_fraction: float = 0.2,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_size <= 0 or image_size <= 0 or not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f"need batch_size, image_size > 0 and 0 < val_fraction < 1; got {batch_size}, "
                f"{image_size}, {val_fraction}"
            )
        self.save_hyperparameters()
        self.image_folder, self.val_folder = image_folder, val_folder
        self.image_size, self.channels, self.resize = image_size, channels, resize
        self.batch_size, self.val_fraction, self.seed = batch_size, val_fraction, seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.classes: list[str] = list(DIGIT_NAMES)

    @override
    def setup(self, stage: str) -> None:
        if self.image_folder is None:
            self.train_set, self.val_set = digits_split(
                self.image_size, self.channels, self.resize, self.val_fraction, self.seed
            )
            return
        train = ImageFolder(self.image_folder, image_size=self.image_size, channels=self.channels)
        self.classes = train.classes
        if self.val_folder is not None:
            val = ImageFolder(self.val_folder, image_size=self.image_size, channels=self.channels, classes=self.classes)
            self.train_set, self.val_set = train, val
            return
        train_idx, val_idx = split_indices(len(train), self.val_fraction, self.seed)
        self.train_set = torch.utils.data.Subset(train, train_idx.tolist())
        self.val_set = torch.utils.data.Subset(train, val_idx.tolist())

    def _require(self, dataset: Dataset | None) -> Dataset:
        if dataset is None:
            raise RuntimeError("ImageDataModule.setup() must run before asking for a dataloader")
        return dataset

    @override
    def train_dataloader(self) -> DataLoader:
        return train_loader(self._require(self.train_set), self, self.batch_size, self.seed)

    @override
    def val_dataloader(self) -> DataLoader:
        return eval_loader(self._require(self.val_set), self, self.batch_size)

    @override
    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
