"""A Vision Transformer recipe: single-device model, digits or image-folder data, classification LightningModule."""

from lightscale.recipes.vit.data import ImageDataModule, ImageFolder
from lightscale.recipes.vit.model import ViT, ViTConfig
from lightscale.recipes.vit.module import ViTModule

__all__ = ["ImageDataModule", "ImageFolder", "ViT", "ViTConfig", "ViTModule"]
