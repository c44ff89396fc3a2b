"""A nanoGPT-sized decoder-only transformer recipe: single-device model, text or token-file data, LightningModule."""

from lightscale.recipes.gpt.data import ByteTokenizer, GPTDataModule
from lightscale.recipes.gpt.model import GPT, GPTConfig
from lightscale.recipes.gpt.module import GPTModule

__all__ = ["GPT", "ByteTokenizer", "GPTConfig", "GPTDataModule", "GPTModule"]
