"""Pipeline parallelism: split a model into stages by module names, run a torch schedule chosen by name.

A stage is the model with every module of other stages removed (``None``, or deleted from a ``ModuleDict``): a
shallow copy that shares the kept submodules, so no weights are copied and parameter names stay those of the
whole model (``layers.3.attention.wq.weight`` on every stage that holds layer 3). The model's forward must
tolerate the missing modules (the GPT recipe's does).

Schedules are torch's (``torch.distributed.pipelining``), by lightscale name:

===================  ============================  =======================
name                 torch class                   stages per rank
===================  ============================  =======================
``gpipe``            ScheduleGPipe                 1
``1f1b``             Schedule1F1B                  1
``interleaved_1f1b`` ScheduleInterleaved1F1B       >= 2 (looped placement)
``looped_bfs``       ScheduleLoopedBFS             >= 2 (looped placement)
``interleaved_zb``   ScheduleInterleavedZeroBubble >= 2 (looped placement)
``zbv``              ScheduleZBVZeroBubble         2 (V placement)
===================  ============================  =======================

Example:
    >>> stages = even_stage_split([f"layers.{i}" for i in range(4)], 2, first=["tok_embeddings"], last=["output"])
    >>> stages
    [['tok_embeddings', 'layers.0', 'layers.1'], ['layers.2', 'layers.3', 'output']]
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Sequence

from torch import nn
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _Action,
    _ComputationType,
    _PipelineSchedule,
    get_schedule_class,
)

from lightscale.errors import ConfigurationError

SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
}


_COMPUTE = (
    _ComputationType.FORWARD,
    _ComputationType.FULL_BACKWARD,
    _ComputationType.BACKWARD_INPUT,
    _ComputationType.BACKWARD_WEIGHT,
)


def schedule_class(name: str) -> type[_PipelineSchedule]:
    """The torch schedule class of a lightscale schedule name; unknown names list the valid ones."""
    if name not in SCHEDULES:
        close = difflib.get_close_matches(name, SCHEDULES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(f"Unknown pipeline schedule {name!r}.{hint} Valid schedules: {list(SCHEDULES)}.")
    return get_schedule_class(SCHEDULES[name])


def is_single_stage(name: str) -> bool:
    """True for schedules with one stage per rank (gpipe, 1f1b)."""
    return issubclass(schedule_class(name), PipelineScheduleSingle)


def default_stages_per_rank(name: str) -> int:
    return 1 if is_single_stage(name) else 2


def validate_schedule(name: str, *, pp: int, microbatches: int, stages_per_rank: int) -> None:
    """Raise ConfigurationError unless torch can build schedule ``name`` for this shape (checked without processes)."""
    single = is_single_stage(name)
    if single and stages_per_rank != 1:
        raise ConfigurationError(f"Schedule {name!r} runs one stage per rank; got stages_per_rank={stages_per_rank}.")
    if not single and (stages_per_rank < 2 or (name == "zbv" and stages_per_rank != 2)):
        need = "exactly 2" if name == "zbv" else ">= 2"
        raise ConfigurationError(
            f"Schedule {name!r} needs {need} stages per rank; got stages_per_rank={stages_per_rank}. "
            f"One stage per rank: {[n for n in SCHEDULES if is_single_stage(n)]}."
        )
    if microbatches < 1:
        raise ConfigurationError(f"microbatches must be >= 1, got {microbatches}.")
    if name == "1f1b" and microbatches < pp:
        raise ConfigurationError(
            f"Schedule '1f1b' needs at least as many microbatches as stages: microbatches={microbatches} < pp={pp}. "
            f"Use microbatches >= {pp}, or 'gpipe'."
        )
    if pp > 1 and not single:
        try:
            pipeline_order(name, pp=pp, microbatches=microbatches, stages_per_rank=stages_per_rank)
        except (ValueError, AssertionError, RuntimeError) as err:
            raise ConfigurationError(
                f"Schedule {name!r} cannot run pp={pp}, microbatches={microbatches}, "
                f"stages_per_rank={stages_per_rank}: {err}"
            ) from None


def pipeline_order(name: str, *, pp: int, microbatches: int, stages_per_rank: int) -> list[list[_Action]]:
    """Each rank's compute actions in execution order, without processes.

    Multi-stage schedules: torch's own action lists (``pipeline_order``, which their runtime executes). GPipe and
    1F1B compute their order inline in torch; it is reproduced here (1F1B: ``stages - rank`` warm-up forwards,
    then one backward / one forward, as ``Schedule1F1B`` does).
    """
    if not is_single_stage(name):
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

        ops = get_schedule_ops(SCHEDULES[name], pp, microbatches, stages_per_rank)
        return [[a for a in rank if a is not None and a.computation_type in _COMPUTE] for rank in ops]
    return [_single_stage_order(name, rank, pp, microbatches) for rank in range(pp)]


def _single_stage_order(name: str, rank: int, pp: int, microbatches: int) -> list[_Action]:
    forwards = [_Action(rank, _ComputationType.FORWARD, mb) for mb in range(microbatches)]
    backwards = [_Action(rank, _ComputationType.FULL_BACKWARD, mb) for mb in range(microbatches)]
    if name == "gpipe":
        return forwards + backwards
    warmup = min(microbatches, pp - rank)
    order = forwards[:warmup]
    for mb in range(microbatches - warmup):
        order += [backwards[mb], forwards[warmup + mb]]
    return order + backwards[microbatches - warmup :]


def check_microbatch_split(batch_size: int, microbatches: int) -> None:
    if batch_size % microbatches:
        valid = [m for m in range(1, batch_size + 1) if batch_size % m == 0]
        raise ConfigurationError(
            f"The batch of {batch_size} samples does not split into {microbatches} equal microbatches. "
            f"Choose microbatches among {valid} or a batch size divisible by {microbatches}."
        )


def even_stage_split(
    layers: Sequence[str], num_stages: int, *, first: Sequence[str] = (), last: Sequence[str] = ()
) -> list[list[str]]:
    """Module names per stage: ``layers`` in equal consecutive runs, ``first`` prepended, ``last`` appended."""
    if num_stages < 1 or len(layers) % num_stages:
        valid = [s for s in range(1, len(layers) + 1) if len(layers) % s == 0]
        raise ConfigurationError(
            f"{len(layers)} layers do not divide into {num_stages} pipeline stages (pp x stages_per_rank). "
            f"Valid stage counts: {valid}."
        )
    per = len(layers) // num_stages
    stages = [list(layers[i * per : (i + 1) * per]) for i in range(num_stages)]
    stages[0] = [*first, *stages[0]]
    stages[-1] = [*stages[-1], *last]
    return stages


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, *, v_shape: bool) -> list[int]:
    """Stage indices of a rank: looped (rank, rank + pp, ...) or V-shaped (rank, 2 pp - 1 - rank) for zbv."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def prune_to(model: nn.Module, keep: Sequence[str], all_names: Sequence[str]) -> nn.Module:
    """A shallow copy of ``model`` without the modules of ``all_names`` that are not in ``keep``; shares the rest."""
    keep_set = set(keep)
    root = _shell(model)
    for name in all_names:
        if name in keep_set:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = _shell_path(root, parent_name) if parent_name else root
        if isinstance(parent, nn.ModuleDict):
            del parent[child]
        else:
            setattr(parent, child, None)
    return root


def _shell(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s children and tensors but with its own child and hook tables, so
    hooks that FSDP or a PipelineStage put on one stage's root never fire on another's."""
    shell = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):  # _modules, _parameters, _forward_hooks, ...
            shell.__dict__[key] = copy.copy(value)
    return shell


def _shell_path(root: nn.Module, path: str) -> nn.Module:
    """Replace every module along ``path`` by a shell (so deleting below it leaves the original intact)."""
    parent = root
    for atom in path.split("."):
        child = _shell(parent._modules[atom])
        parent._modules[atom] = child
        parent = child
    return parent


def stage_ids_owner(stage: int, pp: int, *, v_shape: bool) -> int:
    """The pipeline rank that holds ``stage``."""
    if v_shape:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp
