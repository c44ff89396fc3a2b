"""What ``fault_tolerant=...`` adds to ``BucketedDDPStrategy`` and the FSDP2 family (``hsdp``; its sharded replica is
fault_tolerance/sharded_replica.py): this launch is one replica that meets the others through torchft each optimizer
step (lightscale/fault_tolerance/step.py) and heals from a live peer when behind.

A healing replica receives the Lightning state a peer holds at the start of the step: parameters and buffers,
optimizer and LR-scheduler states, the step counters, the random states and the position in the epoch (its
sampler, lightscale's, reads on from there in its own part of the data). Rank 0 of each replica logs one line per
step and ``ft/replicas`` to the loggers. The settings are checked here, before any process starts. A family with
``fault_tolerant=`` holds its replica (bucketed_ddp, and the FSDP2 family its sharded one) and answers it as
``per_step_replica``: lightscale's strategy base (strategies/base.py) calls it at its hooks where one is set.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightscale.data.data_shard import DataShard
from lightscale.data.sampler import position_in_epoch
from lightscale.errors import ConfigurationError
from lightscale.fault_tolerance.settings import FaultTolerance, fault_tolerance_of
from lightscale.fault_tolerance.step import FaultTolerantStep

FEATURE_NAME = "per-step fault tolerance (bucketed_ddp, hsdp)"


def replica_fault_tolerance(
    fault_tolerant: FaultTolerance | bool | None, *, compression: str, find_unused_parameters: bool = False
) -> FaultTolerance | None:
    """The settings of a per-step family's ``fault_tolerant=`` (``None`` when off): :func:`fault_tolerance_of`'s
    refusals, then, before any process starts, where the replica has no name or lighthouse, the compression keeps
    per-replica state, or unused parameters would be skipped on one replica and stepped on another."""
    ft = fault_tolerance_of(fault_tolerant, FEATURE_NAME)
    if ft is None:
        return None
    ft.resolved_replica_id()
    ft.resolved_lighthouse()
    if compression == "powersgd":
        raise ConfigurationError(
            "compression='powersgd' cannot run with fault_tolerant: its error-feedback residuals live on each replica "
            "and a healed one would not have them; use compression='none' or 'bf16'."
        )
    if find_unused_parameters:
        raise ConfigurationError(
            "find_unused_parameters=True cannot run with fault_tolerant: a parameter no rank of one replica used gets "
            "no gradient there (the optimizer skips it) while another replica steps it, and the replicas drift apart; "
            "use find_unused_parameters=False (every parameter in every step's graph)."
        )
    return ft


def move_sampler(loader: object, epoch: int, batches: int) -> bool:
    """After a heal, before the loader iterates: move its sampler (one with ``resume_from(epoch, batches)``, as
    lightscale's) to the peers' position; False where the sampler cannot move (the caller warns, in its own terms).
    Both modes use it: a per-step replica (a peer's batch count) and a DiLoCo worker (its step x accumulation)."""
    resume_from = getattr(getattr(loader, "sampler", None), "resume_from", None)
    if callable(resume_from):
        resume_from(epoch, batches)
    return callable(resume_from)


def replica_data_shard(ft: FaultTolerance, shard: DataShard) -> DataShard:
    """With ``data_shards``, a replica (a DiLoCo worker too) reads its own part of the dataset, split over its ranks
    (``shard``); without, every replica reads the whole dataset."""
    if ft.data_shards is None:
        return shard
    return DataShard(ft.data_part() * shard.count + shard.index, ft.data_shards * shard.count)


def refuse_several_optimizers(count: int) -> None:
    """Before the first quorum: each optimizer step commits on its batch's one quorum, so one optimizer only."""
    if count > 1:
        raise ConfigurationError(
            f"fault_tolerant= runs one optimizer, stepped at most once per training batch, and configure_optimizers "
            f"returned {count}: the replicas meet once per batch (one quorum, one commit), so a second optimizer's "
            f"step would run without a quorum of its own and a fault between the two would leave the batch half "
            f"applied. Use one optimizer (parameter groups for different settings), or leave fault_tolerant unset."
        )


def refuse_ft_inside_diloco(ft: object | None, strategy: str) -> None:
    """DiLoCo drives its inner strategy's hooks itself: a fault-tolerant inner replica's quorum would never run."""
    if ft is not None:
        raise ConfigurationError(
            f"{strategy}(fault_tolerant=...) as DiLoCo's inner strategy would not be fault tolerant: DiLoCo drives "
            "the inner strategy itself. Pass fault_tolerant= to DiLoCoStrategy instead."
        )


def refuse_weight_averaging(callbacks: list[Any]) -> None:
    """Before the first quorum: a heal moves the model, optimizers and position, not a callback's running average,
    so a healed replica's EMA/SWA would differ from its peers' (and each replica's averaged checkpoint)."""
    averaging = [type(c).__name__ for c in callbacks if isinstance(c, (WeightAveraging, StochasticWeightAveraging))]
    if averaging:
        raise ConfigurationError(
            f"fault_tolerant= does not carry weight averages when a replica heals, and the trainer has {averaging}: "
            f"a healed replica's average would differ from its peers'. Remove the averaging callback, or leave "
            f"fault_tolerant unset."
        )


def refuse_step_without_quorum(step: FaultTolerantStep | None) -> None:
    """A second ``optimizer.step()`` in one batch (manual optimization) finds the batch's quorum already committed."""
    if step is None or not step.open:
        raise ConfigurationError(
            "fault_tolerant= takes one optimizer.step() per training batch, and this batch stepped again after its "
            "step was committed: the replicas meet once per batch (one quorum, one commit), so this step would have "
            "no quorum of its own. Under manual optimization (automatic_optimization=False) call optimizer.step() "
            "once per training_step (accumulate over batches rather than stepping twice in one), or use automatic "
            "optimization."
        )


class FaultTolerantReplica:
    """The Lightning side of one replica: its torchft step, the state a peer heals from, the per-step log."""

    def __init__(self, settings: FaultTolerance, *, manager: Any = None) -> None:
        self.settings = settings
        self.manager = manager  # None: torchft's, built at the first quorum (a fake in tests/unit)
        self.step: FaultTolerantStep | None = None
        self.trainer: Trainer | None = None
        self.loader: object = None
        self.position = (0, 0)  # (epoch, batches trained in it) at the start of the current step
        self.offset = (0, 0)  # (epoch, batches read in it but not counted by Lightning's batch_idx: a heal's jump)
        self.healed_to: tuple[int, int] | None = None  # where a heal moved the sampler, until the next batch starts
        self.reading = False  # the loader iterates: a heal can no longer move its position
        self.heals = 0
        self.most_replicas = 0
        self.steps_with_fewer = 0  # committed with fewer replicas than the most seen: a missing part's batch skipped
        self.dropped = 0
        self.resumed_steps: int | None = None  # torchft's step count in the checkpoint this run resumed from

    def join(self, trainer: Trainer, loader: object) -> None:
        """The first quorum, before the data is read: a replica behind its peers heals here and reads on from them."""
        self.trainer, self.loader = trainer, loader
        if self.step is None:
            refuse_several_optimizers(len(trainer.optimizers))
            refuse_weight_averaging(trainer.callbacks)
            group = dist.group.WORLD if trainer.world_size > 1 else None
            self.step = FaultTolerantStep(
                self.settings,
                state_dict=self.state_dict,
                load_state_dict=self.load_state_dict,
                group=group,
                device=trainer.strategy.root_device,
                manager=self.manager,
            )
            if self.resumed_steps:  # resumed from a save: torchft's step count goes on from there
                self.step.manager.load_state_dict({"step": self.resumed_steps, "batches_committed": 0})
        epoch, batches = position_in_epoch(trainer)
        if not self.reading and epoch >= 0:  # resumed: a heal served now sends where it is
            self.position = (epoch, batches + self._jump_in(epoch))
            if self.position[1] != batches:  # its save was made after a heal: the sampler is past Lightning's count
                self._reposition(*self.position)
        self.step.begin()

    def _jump_in(self, epoch: int) -> int:
        """Batches of ``epoch`` read but not counted by Lightning's batch index (a heal's jump; 0 in another epoch)."""
        return self.offset[1] if self.offset[0] == epoch else 0

    def checkpoint_state(self) -> dict[str, Any]:
        """In the portable layout's trainer state: the steps committed, so that after a whole job was lost and every
        replica resumed from its own save, the first quorum makes the replica with the newest save the source."""
        return {
            "replica": self.settings.resolved_replica_id(),
            "committed_steps": self._committed_steps(),
            "offset": list(self.offset),  # a healed replica's sampler is ahead of Lightning's saved batch count
        }

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        """A resumed fit's: torchft's count and the heal's jump as saved (a checkpoint without them leaves
        ``resumed_steps=None``, ``offset=(0, 0)``)."""
        self.resumed_steps = int(state["committed_steps"])
        epoch, batches = state.get("offset", (0, 0))  # saves before stop 47 have none
        self.offset = (int(epoch), int(batches))

    def _committed_steps(self) -> int:
        if self.step is not None:
            return self.step.committed_steps
        return self.resumed_steps or 0

    def begin(self, trainer: Trainer, batch_idx: int) -> None:
        if self.healed_to is not None:  # Lightning's batch_idx goes on from its own count (0, or where it resumed)
            epoch, batches = self.healed_to
            self.offset, self.healed_to = (epoch, batches - batch_idx), None
        self.position = (trainer.current_epoch, batch_idx + self._jump_in(trainer.current_epoch))
        self.reading = True
        if self.step is not None:
            self.step.begin()

    def launch(self, tensor: Tensor) -> Any:
        """Start averaging ``tensor`` over the step's replicas (the bucketed reducer, as each bucket is in)."""
        refuse_step_without_quorum(self.step)
        assert self.step is not None
        return self.step.launch(tensor)

    def gradients_after_backward(self) -> list[Tensor]:
        """What is left to average across replicas once backward ran: nothing here, the bucketed reducer averaged
        each bucket as it was in (``after_reduce`` = :meth:`launch`); a sharded replica's local shards."""
        return []

    def optimizer_step(self, apply: Any, closure: Any) -> Any:
        """Forward and backward, the average over the step's replicas, then ``apply`` only if every one succeeded."""
        refuse_step_without_quorum(self.step)
        result = closure()
        assert self.step is not None and self.trainer is not None
        self.step.average(self.gradients_after_backward())
        participants = self.step.participants
        committed = self.step.commit()
        number = self.trainer.global_step + 1
        if committed:
            self.most_replicas = max(self.most_replicas, participants)
            self.steps_with_fewer += participants < self.most_replicas
            rank_zero_info(f"lightscale-ft: step {number} committed, {participants} replica(s)")
        else:
            self.dropped += 1
            rank_zero_info(f"lightscale-ft: step {number} dropped (a replica of it failed), applied by none")
        for logger in self.trainer.loggers:
            logger.log_metrics({"ft/replicas": float(participants if committed else 0)}, step=self.trainer.global_step)
        return apply(lambda: result) if committed else result

    def state_dict(self) -> dict[str, Any]:
        """Read by torchft's transport while this rank waits in the quorum: nothing changes under it, and the
        transport stops serving (``should_commit``) before the optimizer steps, so no copies are made."""
        trainer = self.trainer
        assert trainer is not None
        loop = trainer.fit_loop.epoch_loop
        return {
            "replica": self.settings.resolved_replica_id(),
            "model": trainer.lightning_module.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in trainer.optimizers],
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "optim_progress": loop.automatic_optimization.optim_progress.state_dict(),
            "manual_progress": loop.manual_optimization.optim_step_progress.state_dict(),
            "batches_that_stepped": loop._batches_that_stepped,
            "epoch_progress": trainer.fit_loop.epoch_progress.state_dict(),
            "rng": _collect_rng_states(),
            "precision": trainer.precision_plugin.state_dict(),  # 16-mixed: the loss scale every replica must share
            "position": list(self.position),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        assert trainer is not None
        trainer.lightning_module.load_state_dict(state["model"])
        for optimizer, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        loop = trainer.fit_loop.epoch_loop
        loop.automatic_optimization.optim_progress.load_state_dict(state["optim_progress"])
        loop.manual_optimization.optim_step_progress.load_state_dict(state["manual_progress"])
        loop._batches_that_stepped = state["batches_that_stepped"]
        _set_rng_states(state["rng"])
        trainer.precision_plugin.load_state_dict(state["precision"])
        if not self.reading:  # before the first epoch starts: it starts at the peers' epoch (the sampler's too)
            trainer.fit_loop.epoch_progress.load_state_dict(state["epoch_progress"])
        self.heals += 1
        self._read_on_from(*state["position"])
        rank_zero_info(f"lightscale-ft: healed from {state['replica']} at step {trainer.global_step}")

    def _read_on_from(self, epoch: int, batches: int) -> None:
        trainer = self.trainer
        assert trainer is not None
        if self.reading or epoch != trainer.current_epoch or not self._reposition(epoch, batches):
            rank_zero_warn(
                f"lightscale-ft: this replica healed to epoch {epoch}, batch {batches} but reads on from where its "
                f"loader is (epoch {trainer.current_epoch}; sampler {type(self._sampler()).__name__})."
            )
            return
        self.healed_to = (epoch, batches)  # batches, not steps: the peer's batch_idx at its step's first batch

    def _sampler(self) -> object:
        return getattr(self.loader, "sampler", None)

    def _reposition(self, epoch: int, batches: int) -> bool:
        return move_sampler(self.loader, epoch, batches)

    def summary(self) -> str:
        return (
            f"{self.steps_with_fewer} step(s) committed with fewer than {self.most_replicas} replicas (the missing "
            f"replicas' batches of those steps were not trained), {self.dropped} dropped (trained by none), "
            f"{self.heals} heal(s)"
        )

    def finish(self) -> None:
        if self.step is None:
            return
        if self.steps_with_fewer or self.dropped:
            rank_zero_info(f"lightscale-ft: {self.summary()}.")
        self.step.shutdown()
        self.step = None


class SavedReplicaState:
    """The replica's part of a checkpoint, as the checkpointer takes state (a ``Stateful``): its name, torchft's count
    and a heal's jump. (The replica's own ``state_dict`` is what torchft's transport sends a healing peer.)"""

    def __init__(self, replica: FaultTolerantReplica) -> None:
        self.replica = replica

    def state_dict(self) -> dict[str, Any]:
        return self.replica.checkpoint_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.replica.restore_checkpoint_state(state)
