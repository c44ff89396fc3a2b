"""Pictures of pipeline schedules: ranks x time, forward / backward / weight-gradient / idle, from torch's orders.

Each rank's actions come from :func:`~lightscale.parallel.pipeline.pipeline_order` (torch's action lists); the
timing is simulated with unit costs (forward 1, full backward 2, input- and weight-backward 1 each) and the real
dependencies (a stage's forward waits for the previous stage's, its backward for the next stage's), so the picture
shows the schedule's bubble.

Example:
    >>> draw_schedule("1f1b", pp=4, microbatches=8, path="1f1b.png")
    $ lightscale schedule 1f1b --pp 4 --microbatches 8 --out 1f1b.png
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch.distributed.pipelining.schedules import _Action, _ComputationType

from lightscale.errors import ConfigurationError
from lightscale.parallel.pipeline import default_stages_per_rank, is_single_stage, pipeline_order, stage_ids_owner

F, B, I, W = (  # noqa: E741 - torch's own letters for the four kinds of work
    _ComputationType.FORWARD,
    _ComputationType.FULL_BACKWARD,
    _ComputationType.BACKWARD_INPUT,
    _ComputationType.BACKWARD_WEIGHT,
)
COST = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}
COLOR = {F: "#4878d0", B: "#ee854a", I: "#d65f5f", W: "#6acc64"}
LABEL = {F: "forward", B: "backward", I: "backward (input)", W: "backward (weights)"}


@dataclass(frozen=True)
class Slot:
    rank: int
    start: float
    end: float
    action: _Action


def simulate(order: list[list[_Action]], *, num_stages: int) -> list[Slot]:
    """Start and end time of every action, each rank running its list in order as soon as inputs are ready."""
    done: dict[tuple, float] = {}
    clock = [0.0] * len(order)
    cursor = [0] * len(order)
    slots: list[Slot] = []
    while any(cursor[r] < len(order[r]) for r in range(len(order))):
        progressed = False
        for rank, actions in enumerate(order):
            if cursor[rank] == len(actions):
                continue
            action = actions[cursor[rank]]
            ready = [done.get(dep) for dep in _dependencies(action, num_stages)]
            if any(t is None for t in ready):
                continue
            start = max([clock[rank], *ready])
            end = start + COST[action.computation_type]
            done[(action.stage_index, action.computation_type, action.microbatch_index)] = end
            slots.append(Slot(rank, start, end, action))
            clock[rank], cursor[rank], progressed = end, cursor[rank] + 1, True
        if not progressed:
            raise RuntimeError("the schedule's order deadlocks under the simulated dependencies")
    return slots


def _dependencies(action: _Action, num_stages: int) -> list[tuple]:
    stage, kind, mb = action.stage_index, action.computation_type, action.microbatch_index
    if kind == F:
        return [(stage - 1, F, mb)] if stage > 0 else []
    if kind == W:
        return [(stage, I, mb)]
    deps = [(stage, F, mb)]
    if stage < num_stages - 1:  # the gradient comes from the next stage's (full or input) backward
        deps.append((stage + 1, B, mb) if kind == B else (stage + 1, I, mb))
    return deps


def idle_fractions(slots: list[Slot], ranks: int) -> list[float]:
    """Per rank, the share of the step (first start to last end over all ranks) spent idle."""
    makespan = max(s.end for s in slots) - min(s.start for s in slots)
    return [1.0 - sum(s.end - s.start for s in slots if s.rank == r) / makespan for r in range(ranks)]


def theoretical_bubble(pp: int, microbatches: int) -> float:
    """GPipe's and 1F1B's bubble fraction: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (microbatches + pp - 1)


def schedule_slots(name: str, *, pp: int, microbatches: int, stages_per_rank: int | None = None) -> list[Slot]:
    per_rank = stages_per_rank or default_stages_per_rank(name)
    order = pipeline_order(name, pp=pp, microbatches=microbatches, stages_per_rank=per_rank)
    if name == "zbv":  # torch lists V-placed actions by stage; keep them on their owning rank
        assert all(stage_ids_owner(a.stage_index, pp, v_shape=True) == r for r, acts in enumerate(order) for a in acts)
    return simulate(order, num_stages=pp * per_rank)


def draw_schedule(
    name: str, *, pp: int, microbatches: int, path: str | Path, stages_per_rank: int | None = None
) -> Path:
    """Write a PNG of schedule ``name`` (ranks x time) to ``path``; return the path."""
    try:
        import matplotlib
    except ImportError as error:
        raise ConfigurationError("Drawing schedules needs matplotlib: pip install 'lightscale[plot]'.") from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slots = schedule_slots(name, pp=pp, microbatches=microbatches, stages_per_rank=stages_per_rank)
    idle = idle_fractions(slots, pp)
    single = is_single_stage(name)
    makespan = max(s.end for s in slots)
    fig, ax = plt.subplots(figsize=(max(6.0, makespan * 0.28), 0.55 * pp + 1.3))
    for slot in slots:
        kind = slot.action.computation_type
        ax.barh(slot.rank, slot.end - slot.start, left=slot.start, color=COLOR[kind], edgecolor="white", height=0.8)
        label = f"{slot.action.microbatch_index}" + ("" if single else f"\ns{slot.action.stage_index}")
        ax.text((slot.start + slot.end) / 2, slot.rank, label, ha="center", va="center", fontsize=7, color="white")
    kinds = sorted({s.action.computation_type for s in slots}, key=list(COST).index)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOR[k]) for k in kinds]
    names = [*(LABEL[k] for k in kinds), "idle"]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#eeeeee"))
    ax.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(names), fontsize=8)
    ax.set_facecolor("#eeeeee")
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time (forward = 1)")
    ax.set_title(f"{name}: pp={pp}, {microbatches} microbatches, idle {sum(idle) / pp:.0%} (mean per rank)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
