"""The shape-dependent optimizer rule (lightscale/optim/rule.py) under every strategy name with its defaults: each
optimizer either runs with the same math as one process or is refused before the first step, with an error naming
the optimizer, the strategy and the names where it runs exactly. The expected table is typed here, not derived.
"""

from __future__ import annotations

import os
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightscale.errors import ConfigurationError
from lightscale.strategies.registry import strategy_table


def _strategy(name: str):
    entry = StrategyRegistry[name]
    return entry["strategy"](**entry["init_params"])


# Every registered name by how its optimizer sees parameters (derived: a new family is tested without editing this).
VIEWS = {name: _strategy(name).parameter_view for name, _ in strategy_table()}
WHOLE, DTENSOR, FLAT = ([name for name, view in VIEWS.items() if view == kind] for kind in ("whole", "dtensor", "flat"))
UNMAPPED = ["zero_infinity", "fit_memory"]  # NVMe-swapped partitions; fit_memory may become any ZeRO name
ZERO_MAPPED = [name for name in FLAT if name not in UNMAPPED]  # flat partitions lightscale maps: FlatMuon


class Shampoo(torch.optim.SGD):
    """A user's own optimizer that says its step reads the parameter's shape."""

    shape_dependent = True


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params),
    "adafactor": lambda params: torch.optim.Adafactor(params),
    "muon": lambda params: torch.optim.Muon(params),
    "users": lambda params: Shampoo(params, lr=0.1),
}
# Where each optimizer runs exactly (every other name refuses it).
EXACT = {
    "sgd": WHOLE + DTENSOR + FLAT,
    "adamw": WHOLE + DTENSOR + FLAT,
    "adafactor": WHOLE + DTENSOR,
    "muon": WHOLE + DTENSOR + ZERO_MAPPED,
    "users": WHOLE,
}
CLASS_NAMES = {"adafactor": "torch.optim.Adafactor", "muon": "torch.optim.Muon", "users": "Shampoo"}


def test_every_name_has_a_view_this_test_knows() -> None:
    assert sorted(WHOLE + DTENSOR + FLAT) == sorted(VIEWS) and set(UNMAPPED) <= set(FLAT)


@pytest.mark.parametrize("name", WHOLE + DTENSOR + FLAT)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_exact_or_refused_by_name(name: str, optimizer: str) -> None:
    strategy = _strategy(name)
    built = OPTIMIZERS[optimizer]([nn.Parameter(torch.ones(4, 4))])
    if name in EXACT[optimizer]:
        strategy.check_optimizers([built])
        return
    with pytest.raises(ConfigurationError) as refused:
        strategy.check_optimizers([built])
    message = str(refused.value)
    assert CLASS_NAMES[optimizer] in message and type(strategy).__name__ in message
    assert sorted(message.split("runs exactly under: ")[1].split(". ")[0].split(", ")) == sorted(EXACT[optimizer])
    assert "`shape_dependent = True`" in message  # the mechanism a user's own optimizer opts in with


def test_a_subclass_of_adafactor_is_shape_dependent_too() -> None:
    class MyAdafactor(torch.optim.Adafactor):
        pass

    with pytest.raises(ConfigurationError, match="MyAdafactor cannot run under FSDP2Strategy"):
        _strategy("fsdp2").check_optimizers([MyAdafactor([nn.Parameter(torch.ones(2, 2))])])


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4, bias=False)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return Shampoo(self.parameters(), lr=0.1)


@mock.patch.dict(os.environ)  # Lightning sets WORLD_SIZE, LOCAL_RANK...: the next test's Trainer must not see them
def test_refused_by_fit_before_the_first_step() -> None:
    """Through Lightning's setup (one CPU rank of fsdp2): no step runs, the weight is untouched."""
    import lightscale

    module = Tiny()
    before = module.layer.weight.detach().clone()
    trainer = lightscale.Trainer(
        strategy="fsdp2",
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ConfigurationError, match="Shampoo cannot run under FSDP2Strategy"):
        trainer.fit(module, torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
    assert trainer.global_step == 0 and torch.equal(module.layer.weight.full_tensor().detach(), before)
    torch.distributed.destroy_process_group()  # the next test's Trainer starts from no process group


def test_adafactor_installed_as_sharded_with_its_scheduler() -> None:
    """On DTensor strategies torch's Adafactor is replaced by ShardedAdafactor (same groups, hyper-parameters and
    state keys); a scheduler built on the user's optimizer follows the replacement without torch's warning."""
    from lightscale.optim.adafactor import ShardedAdafactor
    from lightscale.optim.install import install_exact_optimizers

    params = [nn.Parameter(torch.ones(4, 4)), nn.Parameter(torch.ones(4))]
    users = torch.optim.Adafactor([{"params": params[:1], "lr": 0.1}, {"params": params[1:]}], weight_decay=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(users, step_size=1, gamma=0.5)
    assert install_exact_optimizers([users], [scheduler], "whole") == [users]
    (installed,) = install_exact_optimizers([users], [scheduler], "dtensor")
    assert type(installed) is ShardedAdafactor and scheduler.optimizer is installed
    assert [g["lr"] for g in installed.param_groups] == [0.1, 0.01] and installed.defaults == users.defaults
    for p in params:
        p.grad = torch.ones_like(p)
    installed.step()
    scheduler.step()
    assert [g["lr"] for g in installed.param_groups] == [0.05, 0.005]
    assert set(installed.state_dict()["state"][0]) == {"step", "row_var", "col_var"}


@pytest.mark.parametrize("name", WHOLE + DTENSOR + FLAT)
def test_combined_elementwise_parts_refused_only_under_nvme_swapping(name: str) -> None:
    """A combination runs under every name where its parts run, ZeRO's mapped names included (each part steps its
    own groups' flat partitions: tests/distributed/test_zero_combined.py); zero_infinity and fit_memory (which may
    become it) refuse it: the NVMe swapper moves the state around each step, unverified for a combination."""
    from lightscale.optim import CombinedOptimizer

    matrix, vector = nn.Parameter(torch.ones(4, 4)), nn.Parameter(torch.ones(4))
    combined = CombinedOptimizer([torch.optim.AdamW([matrix]), torch.optim.SGD([vector], lr=0.1)])
    if name not in ["zero_infinity", "fit_memory"]:
        _strategy(name).check_optimizers([combined])
        return
    with pytest.raises(ConfigurationError, match="CombinedOptimizer of AdamW, SGD cannot run under") as refused:
        _strategy(name).check_optimizers([combined])
    assert sorted(str(refused.value).split("runs exactly: ")[1].rstrip(".").split(", ")) == sorted(
        WHOLE + DTENSOR + ZERO_MAPPED
    )


@pytest.mark.parametrize(("inner", "view"), [("bucketed_ddp", "whole"), ("fsdp2", "dtensor")])
def test_diloco_asks_its_inner_strategy(inner: str, view: str) -> None:
    """DiLoCo's workers step with the inner strategy's optimizer: a name or a strategy object, the same view."""
    from lightscale.strategies import BucketedDDPStrategy, DiLoCoStrategy, FSDP2Strategy

    objects = {"bucketed_ddp": BucketedDDPStrategy(bucket_cap_mb=1.0), "fsdp2": FSDP2Strategy()}
    assert DiLoCoStrategy(inner=inner).optimizer_parameter_view() == view
    assert DiLoCoStrategy(inner=objects[inner]).optimizer_parameter_view() == view
    assert DiLoCoStrategy.parameter_view_for({"inner": inner}) == view
