"""A CLIP-style contrastive recipe: ViT image tower, byte-level text tower, CLIP or SigLIP loss, zero-shot eval."""

from lightscale.recipes.clip.data import CaptionFile, CLIPDataModule
from lightscale.recipes.clip.model import CLIP, CLIPConfig, TextConfig
from lightscale.recipes.clip.module import CLIPModule

__all__ = ["CLIP", "CLIPConfig", "CLIPDataModule", "CLIPModule", "CaptionFile", "TextConfig"]
