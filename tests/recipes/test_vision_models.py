"""The ViT and CLIP models on one process: named sizes, shapes, the temperature clamp, parallel validation."""

from __future__ import annotations

import math

import pytest
import torch

from lightscale.errors import ConfigurationError
from lightscale.recipes.clip import CLIP, CLIPConfig, CLIPModule
from lightscale.recipes.vit import ViT, ViTConfig, ViTModule


@pytest.mark.parametrize("pool", ["cls", "mean"])
@pytest.mark.parametrize("pos_emb", ["learned", "sincos"])
def test_vit_shapes(pool: str, pos_emb: str) -> None:
    model = ViT(ViTConfig.named("tiny", pool=pool, pos_emb=pos_emb))
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    features = ViT(ViTConfig.named("tiny", pool=pool, pos_emb=pos_emb, num_classes=0))
    assert features(torch.randn(3, 1, 8, 8)).shape == (3, 32)


def test_vit_b16_is_vit_b16() -> None:
    with torch.device("meta"):
        model = ViT(ViTConfig.named("B-16"))
    assert round(model.num_params() / 1e6, 1) == 86.6  # ViT-B/16 (without the key bias: 86.57M)


def test_bad_vit_config_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        ViTConfig(image_size=8, patch_size=3)
    with pytest.raises(ValueError, match="unknown ViT size"):
        ViTConfig.named("huge")


def test_sequence_parallel_needs_a_divisible_sequence() -> None:
    module = ViTModule(ViTConfig.named("tiny", pool="cls"))  # 16 patches + class token = 17
    with pytest.raises(ConfigurationError, match="pool='mean'"):
        module.validate_parallelism(tp=2, num_stages=1, sequence_parallel=True, loss_parallel=False)
    module.validate_parallelism(tp=2, num_stages=1, sequence_parallel=False, loss_parallel=False)
    assert module.pipeline_stages(2) == [["embed", "layers.0"], ["layers.1", "norm", "head"]]


def test_clip_temperature_is_clamped_at_100() -> None:
    model = CLIP(CLIPConfig())
    assert torch.allclose(model.scale(), torch.tensor([1 / 0.07]))
    with torch.no_grad():
        model.logit_scale.fill_(10.0)
    assert torch.allclose(model.scale(), torch.tensor([100.0]))
    assert model.logit_bias is None  # CLIP loss: no SigLIP bias, so no parameter goes without a gradient


def test_siglip_module_adds_the_bias() -> None:
    module = CLIPModule(loss="siglip")
    module.configure_model()
    assert module.model.logit_bias is not None and module.model.logit_bias.item() == -10.0
    out = module(torch.randn(2, 1, 8, 8), torch.ones(2, 32, dtype=torch.long))
    assert out.image.shape == out.text.shape == (2, 32)
    assert math.isclose(float(out.image.norm(dim=-1)[0]), 1.0, rel_tol=1e-5)


def test_clip_has_no_pipeline_split() -> None:
    with pytest.raises(ConfigurationError, match="no pipeline split"):
        CLIPModule().validate_parallelism(tp=1, num_stages=2, sequence_parallel=False, loss_parallel=False)
