"""The zoo: LightningModules shaped like the ones users bring, each with the one quirk that has broken a strategy.

Nothing here imports lightscale: the consolidated checkpoints are loaded by these classes in a Python that cannot
import it. Every model trains with SGD + momentum (a wrong gradient scale or a lost momentum buffer changes the
weights), on one fixed global batch of ``GLOBAL_BATCH`` samples (``batch(model)``): every step sees the same samples,
so the data position cannot matter after a resume and any difference is the strategy's.

Example:
    >>> model = ZOO["tied_lm"]()
    >>> loss = model.compute_loss(batch(model))
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F

GLOBAL_BATCH = 8
LR, MOMENTUM = 0.1, 0.9
SEQ = 8  # tokens per sample of the language models
VOCAB = 37  # odd, not divisible by any world size


class ZooModule(pl.LightningModule):
    """Common to the zoo: the loss in ``compute_loss``, validation logging ``val_loss``, SGD + momentum over the
    parameters that train."""

    def compute_loss(self, batch: Any) -> Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.compute_loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.compute_loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(trainable, lr=LR, momentum=MOMENTUM)

    @staticmethod
    def data(generator: torch.Generator) -> tuple[Tensor, ...]:
        x = torch.randn(GLOBAL_BATCH, 8, generator=generator)
        return x, torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator)


class Temperature(ZooModule):
    """A learnable temperature: a 0-dimensional ``nn.Parameter(torch.tensor(1.0))`` scaling the logits (OpenCLIP's
    ``logit_scale``), on the LightningModule itself."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.logit_scale = nn.Parameter(torch.tensor(1.0))

    def compute_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.body(x) * self.logit_scale, y)


class Regressor(ZooModule):
    """A 1-output head: ``nn.Linear(k, 1)``, whose bias is a 1-element parameter (smaller than any world size)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 12), nn.Tanh())
        self.head = nn.Linear(12, 1)

    def compute_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.body(x)).squeeze(-1), y)

    @staticmethod
    def data(generator: torch.Generator) -> tuple[Tensor, ...]:
        return torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randn(GLOBAL_BATCH, generator=generator)


class Quirks(ZooModule):
    """Widths not divisible by the world size (7 in, 13 wide, 5 classes), a frozen layer, parameters on the
    LightningModule itself, and an int and a bool buffer updated in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(7, 13)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(13, 13)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 13))  # on the LightningModule, not in a child
        self.offset = nn.Parameter(torch.zeros(5))
        self.head = nn.Linear(13, 5)
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("odd_step", torch.zeros(3, dtype=torch.bool))

    def compute_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        h = torch.tanh(self.hidden(torch.tanh(self.frozen(x))) * self.gain)
        return F.cross_entropy(self.head(h) + self.offset, y)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.steps_seen += 1
        self.odd_step.fill_(bool(self.steps_seen.item() % 2))
        return self.compute_loss(batch)

    @staticmethod
    def data(generator: torch.Generator) -> tuple[Tensor, ...]:
        x = torch.randn(GLOBAL_BATCH, 7, generator=generator)
        return x, torch.randint(0, 5, (GLOBAL_BATCH,), generator=generator)


class TiedLM(ZooModule):
    """A token model built in ``configure_model`` (Lightning's hook for large models): an odd vocabulary (37), a width
    of 15, and the head's weight tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Embedding | None = None

    def configure_model(self) -> None:
        if self.embed is not None:  # Lightning may call it again (load_from_checkpoint does)
            return
        self.embed = nn.Embedding(VOCAB, 15)
        self.mix = nn.Linear(15, 15)
        self.head = nn.Linear(15, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def compute_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        tokens, targets = batch
        logits = self.head(torch.tanh(self.mix(self.embed(tokens))))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @staticmethod
    def data(generator: torch.Generator) -> tuple[Tensor, ...]:
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class HFCausalLM(ZooModule):
    """A Hugging Face causal LM from a tiny config (nothing downloaded), held as ``self.model``."""

    def build(self) -> nn.Module:
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self.model = self.build()

    def compute_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        tokens, targets = batch
        logits = self.model(input_ids=tokens).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    data = staticmethod(TiedLM.data)


class HFGPT2(HFCausalLM):
    """GPT-2 (its head tied to the token embedding), 2 layers, width 16, vocabulary 37, no dropout."""

    def build(self) -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=16,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return GPT2LMHeadModel(config)


class HFLlama(HFCausalLM):
    """Llama (grouped-query attention, RMSNorm, SwiGLU, rotary positions), 2 layers, width 16, vocabulary 37."""

    def build(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
        )
        return LlamaForCausalLM(config)


ZOO: dict[str, type[ZooModule]] = {
    "temperature": Temperature,
    "regressor": Regressor,
    "quirks": Quirks,
    "tied_lm": TiedLM,
    "hf_gpt2": HFGPT2,
    "hf_llama": HFLlama,
}


def batch(model: type[ZooModule] | ZooModule) -> tuple[Tensor, ...]:
    """The model's one global batch (the same in every process)."""
    return model.data(torch.Generator().manual_seed(0))


def build(name: str, seed: int = 0) -> ZooModule:
    """The model ``name`` with the weights every process starts from (``configure_model`` run by the caller)."""
    torch.manual_seed(seed)
    return ZOO[name]()
