"""Data of the ViT and CLIP recipes: embedded digits, an image folder and an image-caption file (JSONL, CSV)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lightscale.recipes.clip import CLIPDataModule, CLIPModule
from lightscale.recipes.clip.data import TEMPLATES, tokenize
from lightscale.recipes.vit import ImageDataModule, ViTConfig, ViTModule
from lightscale.recipes.vit.data import DIGIT_NAMES, fit_size


def write_images(root: Path, classes: dict[str, int]) -> list[Path]:
    """Small PNG/JPEG files of different sizes and modes: the loader must bring each to one shape."""
    paths = []
    rng = np.random.default_rng(0)
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            size = 10 + i
            array = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            path = root / name / (f"{i}.png" if i % 2 else f"{i}.jpg")
            Image.fromarray(array).save(path)
            paths.append(path)
    (root / "cat" / "notes.txt").write_text("not an image")
    return paths


def test_digits_default_split_and_shapes() -> None:
    dm = ImageDataModule(batch_size=16, image_size=12)
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 1797
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (16, 1, 12, 12) and labels.dtype == torch.int64
    assert images.min() >= -1 and images.max() <= 1
    rgb = ImageDataModule(batch_size=4, channels=3)  # grey digits repeated for a 3-channel model
    rgb.setup("fit")
    assert next(iter(rgb.train_dataloader()))[0].shape == (4, 3, 8, 8)


def test_fit_size_pads_or_upsamples() -> None:
    image = torch.ones(1, 1, 8, 8)
    padded = fit_size(image, 12, "pad")
    assert padded.shape[-1] == 12 and padded[0, 0, 0, 0] == 0 and padded[0, 0, 2, 2] == 1
    assert fit_size(image, 16, "upsample").shape[-1] == 16


def test_image_folder_trains_the_vit(tmp_path: Path) -> None:
    write_images(tmp_path / "train", {"cat": 5, "dog": 4})
    dm = ImageDataModule(str(tmp_path / "train"), image_size=8, channels=3, batch_size=4, val_fraction=0.25)
    dm.setup("fit")
    assert dm.classes == ["cat", "dog"] and len(dm.train_set) + len(dm.val_set) == 9
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (4, 3, 8, 8) and set(labels.tolist()) <= {0, 1}
    module = ViTModule(ViTConfig.named("tiny", channels=3, num_classes=2))
    module.configure_model()
    assert torch.isfinite(module.loss((images, labels)))


def test_empty_image_folder_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    with pytest.raises(ValueError, match="no images"):
        ImageDataModule(str(tmp_path)).setup("fit")


def test_digit_captions_come_from_the_templates() -> None:
    dm = CLIPDataModule(batch_size=8, context_length=32)
    dm.setup("fit")
    images, tokens, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (8, 1, 8, 8) and tokens.shape == (8, 32) and labels.shape == (8,)
    text = bytes(tokens[0][tokens[0] > 0].tolist()).decode()
    label = int(labels[0])
    assert text in {t.format(name=DIGIT_NAMES[label], digit=label) for t in TEMPLATES}


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_caption_file_loads_pairs(tmp_path: Path, suffix: str) -> None:
    paths = write_images(tmp_path / "images", {"cat": 3, "dog": 3})
    rows = [{"image": str(p.relative_to(tmp_path)), "caption": f"a photo of a {p.parent.name}"} for p in paths]
    path = tmp_path / f"pairs{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(row) for row in rows))
    else:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["image", "caption"])
            writer.writeheader()
            writer.writerows(rows)
    dm = CLIPDataModule(str(path), image_size=8, channels=3, batch_size=2, val_fraction=0.3)
    dm.setup("fit")
    images, tokens, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (2, 3, 8, 8) and (labels == -1).all()
    assert bytes(tokens[0][tokens[0] > 0].tolist()).decode().startswith("a photo of a ")


def test_caption_file_needs_both_fields(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"image": "x.png"}))
    with pytest.raises(ValueError, match="lack an 'image' or 'caption'"):
        CLIPDataModule(str(path)).setup("fit")


def test_tokenize_pads_and_cuts() -> None:
    tokens = tokenize(["ab", "x" * 40], context_length=8)
    assert tokens[0].tolist() == [97, 98, 0, 0, 0, 0, 0, 0] and (tokens[1] == ord("x")).all()


def test_zero_shot_prompts_cover_every_class_and_template() -> None:
    module = CLIPModule()
    prompts = module.prompt_tokens(torch.device("cpu"))
    assert prompts.shape == (10 * len(TEMPLATES), module.config.text.context_length)
