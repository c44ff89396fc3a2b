"""``parallel_3d``'s pipelined step: a torch schedule (forward *and* backward of every microbatch in one call) inside
Lightning's loop (``training_step`` -> ``zero_grad`` -> ``backward`` -> ``optimizer_step``).

This module is the one place where Lightning's call order forces tricks on the user's module (docs/architecture.md,
"Where Lightning's call order forces a trick"); :class:`PipelinedModule` does all of them:

* the module's ``training_step`` calls ``self.loss(batch)``, and only the schedule can compute it (it needs the
  targets on the last stage). For the duration of one step call, :meth:`PipelinedModule.serving` shadows ``loss``
  with the pipeline's (an instance attribute, deleted after the call), so ``self.log`` and the user's step run
  unchanged; under ``predict_step`` the module's network call ``self.model(x)`` runs the forward-only schedule;
* the schedule ran backward already, and Lightning calls ``zero_grad`` between ``training_step`` and ``backward``:
  the step's gradients are set aside after the schedule and put back in ``backward`` (:meth:`restore_gradients`);
* while the strategy holds the module, ``module.model`` is this rank's stages under the whole model's names, so
  ``configure_optimizers``, Lightning's summaries and the memory callbacks see the parameters this rank trains;
  :meth:`detach` puts the user's whole network back (with every stage's trained weights) at teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightscale.parallel.pipeline import prune_to
from lightscale.parallel.pipeline_runtime import Pipeline, PipelinedNetwork
from lightscale.patches.process import delete_user_attribute, set_user_attribute

LossScale = Callable[[Tensor], Tensor]


class PipelinedModule:
    """``module`` with its network ``module.model`` split into pipeline stages, ``stage_names[i]`` for stage ``i``,
    of which this rank runs ``pipeline`` (its stages ``own``)."""

    def __init__(self, module: LightningModule, pipeline: Pipeline, stage_names: list[list[str]], own: list[int]):
        self.module = module
        self.pipeline = pipeline
        self.stage_names = stage_names
        self.network: nn.Module = module.model  # the user's whole network
        all_names = [name for names in stage_names for name in names]
        keep = [name for index in own for name in stage_names[index]]
        self.stages = prune_to(self.network, keep, all_names)  # this rank's modules under whole-model names
        # The module as a checkpoint holds it (this rank's stages), whatever module.model is at the time.
        prefixed = [f"model.{name}" for name in all_names]
        self.checkpoint_view = prune_to(module, [f"model.{name}" for name in keep], prefixed)
        self._stashed_grads: list[tuple[Tensor, Tensor]] = []

    # ---- which network module.model is ----------------------------------------------------------------------
    def attach(self) -> None:
        """``module.model`` becomes this rank's stages (for fit, and for evaluation after fit)."""
        set_user_attribute(self.module, "model", self.stages)

    def detach(self) -> None:
        """``module.model`` is the user's whole network again."""
        set_user_attribute(self.module, "model", self.network)

    # ---- one step --------------------------------------------------------------------------------------------
    @contextmanager
    def serving(self, step: str, *, loss_scale: LossScale | None = None) -> Iterator[None]:
        """For one step call: ``module.loss`` runs the schedule (training: forward and backward, ``loss_scale`` on
        each microbatch loss; else forward-only), and under ``predict_step`` ``module.model`` runs it forward-only."""
        module = self.module
        if step == "training_step":
            set_user_attribute(module, "loss", lambda batch: self._train_loss(batch, loss_scale))
        else:
            set_user_attribute(module, "loss", lambda batch: self.pipeline.evaluate(*batch))
        if step == "predict_step":
            set_user_attribute(module, "model", PipelinedNetwork(self.pipeline))
        try:
            yield
        finally:
            delete_user_attribute(module, "loss")  # the method again
            if step == "predict_step":
                set_user_attribute(module, "model", self.stages)

    def _train_loss(self, batch: tuple[Tensor, Tensor], loss_scale: LossScale | None) -> Tensor:
        inputs, targets = batch
        params = list(self.module.parameters())
        held = [p.grad for p in params]  # earlier micro-steps' gradients (or stale ones zero_grad will clear)
        for param in params:
            param.grad = None
        loss = self.pipeline.step(inputs, targets, loss_scale=loss_scale)
        # Lightning calls zero_grad between training_step and backward: keep this step's gradients aside.
        self._stashed_grads = [(p, p.grad) for p in params if p.grad is not None]
        for param, grad in zip(params, held, strict=True):
            param.grad = grad
        return loss

    def restore_gradients(self, scale: float) -> None:
        """Add the gradients the schedule computed in ``training_step``, times ``scale`` (1 / accumulation)."""
        for param, grad in self._stashed_grads:
            if scale != 1.0:
                grad = grad * scale
            param.grad = grad if param.grad is None else param.grad + grad
        self._stashed_grads = []


class SplittableBatches:
    """Iterates ``loader``, dropping (with a warning) batches of another size than the pipeline trains on: the size
    it already trained on, else the loader's ``batch_size``, else the first batch's."""

    def __init__(self, loader: Any, pipeline: Callable[[], Pipeline | None], microbatches: int) -> None:
        self.loader = loader
        self.pipeline = pipeline
        self.microbatches = microbatches

    def __getattr__(self, name: str) -> Any:  # Lightning reads the loader's sampler, batch_size, dataset, ...
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        pipeline = self.pipeline()
        expected = pipeline.train_batch_size if pipeline is not None else None
        expected = expected or getattr(self.loader, "batch_size", None)
        for batch in self.loader:
            size = _batch_size(batch)
            if expected is None:
                expected = size
            if size is None or size == expected:
                yield batch
                continue
            rank_zero_warn(
                f"parallel_3d drops a training batch of {size} samples: the pipeline runs batches of {expected} "
                f"(microbatches={self.microbatches}; torch's pipeline stages run one shape), typically an "
                "epoch's last, partial batch. Use drop_last=True, or a dataset size that divides into full batches, "
                "to train on every sample."
            )


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, Tensor):
        return batch.shape[0]
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], Tensor):
        return batch[0].shape[0]
    return None
