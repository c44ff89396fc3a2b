"""Image-caption data for the CLIP recipe: digits with template captions by default, or a JSONL/CSV file of yours.

Default: scikit-learn's 1,797 8x8 digits, each paired with one caption drawn (fixed per image, seeded) from
:data:`TEMPLATES` ("a photo of the digit seven", "handwritten 7", ...). Your data: a ``.jsonl`` file of
``{"image": "relative/or/absolute.png", "caption": "..."}`` lines, or a ``.csv`` with ``image`` and ``caption``
columns; image paths are relative to the file's folder. Batches are ``(images, tokens, labels)``: byte tokens
padded with 0 to ``context_length``, labels the class index for zero-shot evaluation (-1 when unknown).

Example:
    >>> dm = CLIPDataModule(batch_size=32)
    >>> dm.setup("fit")
    >>> images, tokens, labels = next(iter(dm.train_dataloader()))
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightscale.recipes.gpt.data import ByteTokenizer
from lightscale.recipes.vit.data import (
    DIGIT_NAMES,
    eval_loader,
    fit_size,
    load_digits_tensors,
    normalize,
    read_image,
    split_indices,
    train_loader,
)

TEMPLATES = (
    "a photo of the digit {name}",
    "handwritten {digit}",
    "the number {name}",
    "a drawing of a {name}",
    "digit {digit}",
)


def caption(label: int, template: str, names: tuple[str, ...] | list[str] = DIGIT_NAMES) -> str:
    return template.format(name=names[label], digit=label)


def tokenize(texts: list[str], context_length: int) -> torch.Tensor:
    """Byte tokens ``int64 [len(texts), context_length]``, 0-padded; too long captions are cut."""
    tokenizer = ByteTokenizer()
    out = torch.zeros(len(texts), context_length, dtype=torch.long)
    for row, text in enumerate(texts):
        tokens = tokenizer.encode(text)[:context_length]
        out[row, : len(tokens)] = torch.from_numpy(tokens.astype(np.int64))
    return out


class DigitCaptions(Dataset):
    """Digits paired with one template caption per image (fixed by ``seed``)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, context_length: int, seed: int) -> None:
        choice = torch.randint(len(TEMPLATES), (len(labels),), generator=torch.Generator().manual_seed(seed))
        texts = [caption(int(y), TEMPLATES[int(t)]) for y, t in zip(labels, choice, strict=True)]
        self.images, self.labels = images, labels
        self.tokens = tokenize(texts, context_length)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.images[index], self.tokens[index], self.labels[index]


def read_pairs(path: Path) -> list[tuple[Path, str]]:
    """``(image path, caption)`` rows of a JSONL or CSV file with ``image`` and ``caption`` fields."""
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    elif path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    else:
        raise ValueError(f"caption file {path} must end in .jsonl or .csv")
    missing = [i for i, row in enumerate(rows) if "image" not in row or "caption" not in row]
    if missing:
        raise ValueError(f"{path}: rows {missing[:5]} lack an 'image' or 'caption' field")
    return [(path.parent / row["image"], row["caption"]) for row in rows]


class CaptionFile(Dataset):
    """Image-caption pairs from a JSONL/CSV file; images read lazily with Pillow."""

    def __init__(self, path: str | Path, *, image_size: int, channels: int, context_length: int) -> None:
        self.pairs = read_pairs(Path(path))
        if not self.pairs:
            raise ValueError(f"caption file {path} has no rows")
        self.image_size, self.channels = image_size, channels
        self.tokens = tokenize([text for _, text in self.pairs], context_length)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        image = normalize(read_image(self.pairs[index][0], self.image_size, self.channels))
        return image, self.tokens[index], torch.tensor(-1)


class CLIPDataModule(pl.LightningDataModule):
    """Digits + template captions (default) or ``caption_file`` (+ optional ``val_caption_file``).

    ``batch_size`` is per data-parallel rank; training batches are equal on every rank (the contrastive loss
    gathers them). ``class_names`` (default: the digit names) are what zero-shot prompts are made of.
    """

    def __init__(
        self,
        caption_file: str | None = None,
        *,
        val_caption_file: str | None = None,
        image_size: int = 8,
        channels: int = 1,
        resize: Literal["pad", "upsample"] = "pad",
        context_length: int = 32,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_size <= 0 or context_length <= 0 or not 0.0 < val_fraction < 1.0:
            raise ValueError("need batch_size > 0, context_length > 0 and 0 < val_fraction < 1")
        self.save_hyperparameters()
        self.caption_file, self.val_caption_file = caption_file, val_caption_file
        self.image_size, self.channels, self.resize = image_size, channels, resize
        self.context_length, self.batch_size = context_length, batch_size
        self.val_fraction, self.seed = val_fraction, seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.caption_file is None:
            images, labels = load_digits_tensors()
            images = normalize(fit_size(images, self.image_size, self.resize)).repeat(1, self.channels, 1, 1)
            train, val = split_indices(len(labels), self.val_fraction, self.seed)
            self.train_set = DigitCaptions(
                images[train], labels[train], context_length=self.context_length, seed=self.seed
            )
            self.val_set = DigitCaptions(
                images[val], labels[val], context_length=self.context_length, seed=self.seed + 1
            )
            return
        pairs = self._read(self.caption_file)
        if self.val_caption_file is not None:
            self.train_set, self.val_set = pairs, self._read(self.val_caption_file)
            return
        train_idx, val_idx = split_indices(len(pairs), self.val_fraction, self.seed)
        self.train_set = torch.utils.data.Subset(pairs, train_idx.tolist())
        self.val_set = torch.utils.data.Subset(pairs, val_idx.tolist())

    def _read(self, path: str) -> CaptionFile:
        return CaptionFile(path, image_size=self.image_size, channels=self.channels, context_length=self.context_length)

    def _require(self, dataset: Dataset | None) -> Dataset:
        if dataset is None:
            raise RuntimeError("CLIPDataModule.setup() must run before asking for a dataloader")
        return dataset

    @override
    def train_dataloader(self) -> DataLoader:
        return train_loader(self._require(self.train_set), self, self.batch_size, self.seed)

    @override
    def val_dataloader(self) -> DataLoader:
        return eval_loader(self._require(self.val_set), self, self.batch_size)
