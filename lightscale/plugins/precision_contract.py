"""The precision contract: what each precision name means under every strategy family, as data.

One table answers, for ``32-true``, ``bf16-mixed``, ``16-mixed`` and ``bf16-true`` under ``bucketed_ddp``, the ZeRO
names, the FSDP2 names and ``parallel_3d``: the dtype parameters are stored in, the dtype matmuls compute in, the
dtype handed to the data-parallel gradient collective, whether a separate fp32 master copy exists, the optimizer
state's dtype and whether a dynamic loss scaler runs. The mixed modes reduce gradients in fp32 everywhere; the
one strategy argument ``compression="bf16"`` (or ``"fp16"``) asks for low-precision reduction under every family.
Where an engine forces another meaning the row says so in ``difference``, and the strategy warns at start-up;
combinations an engine cannot run are refused before any work (:func:`enforce_contract`).
docs/plugins/precision.md is generated from :func:`render_table`; tests/distributed/test_precision_contract.py
observes every dtype in real steps and compares it with this table.

Example:
    >>> meaning("zero", "bf16-true").master
    'fp32'
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightscale.errors import ConfigurationError

log = logging.getLogger(__name__)

Family = Literal["bucketed_ddp", "zero", "fsdp2", "parallel_3d"]
Compression = Literal["none", "bf16", "fp16", "powersgd"]
FAMILIES: tuple[Family, ...] = ("bucketed_ddp", "zero", "fsdp2", "parallel_3d")
# The one list of precision names lightscale gives a meaning to (Lightning's "32" is normalised to "32-true").
# The float8 names are torchao's recipes on top of bf16-mixed (lightscale/layers/float8.py).
FLOAT8 = {"float8": "tensorwise", "float8-rowwise": "rowwise"}
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", *FLOAT8)
COMPRESSIONS = ("none", "bf16", "fp16")
# Compressions only some families implement: low-rank PowerSGD needs a reducer that sees whole gradient matrices.
_ONLY_UNDER: dict[str, tuple[Family, ...]] = {"powersgd": ("bucketed_ddp",)}
# PowerSGD's error feedback would keep a skipped step's inf (loss scaling), and QR needs fp32 gradients.
_POWERSGD_PRECISIONS = ("32-true", "bf16-mixed")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Meaning:
    """What one precision name does under one strategy family (dtype names: ``fp32``, ``bf16``, ``fp16``)."""

    params: str  # dtype of the parameters the module (or its shards) stores between steps
    compute: str  # dtype of a Linear layer's output in forward
    reduce: str  # dtype handed to the data-parallel gradient collective
    master: str  # a separate fp32 copy the optimizer steps ("fp32"), or "none" (it steps the parameters)
    optimizer_state: str  # dtype of optimizer state (momentum, Adam moments)
    loss_scaling: bool  # a dynamic loss scaler runs, with one skip-or-step decision on all ranks
    how: str  # the mechanism, for the reader
    difference: str = ""  # where the engine forces another meaning than the standard one: warned at start-up
    same_values: bool = False  # the difference costs memory only: logged at debug level and in the run summary


STANDARD = {
    "32-true": Meaning("fp32", "fp32", "fp32", "none", "fp32", False, "plain fp32"),
    "bf16-mixed": Meaning("fp32", "bf16", "fp32", "none", "fp32", False, "bf16 autocast"),
    "16-mixed": Meaning("fp32", "fp16", "fp32", "none", "fp32", True, "fp16 autocast + GradScaler"),
    "bf16-true": Meaning("bf16", "bf16", "bf16", "none", "bf16", False, "module converted to bf16"),
    "float8": Meaning(
        "fp32",
        "bf16",
        "fp32",
        "none",
        "fp32",
        False,
        "as bf16-mixed, and eligible Linear layers are torchao Float8Linear (float8 matmuls, one scale per tensor; "
        "FSDP all-gathers their weights in float8)",
    ),
    "float8-rowwise": Meaning(
        "fp32",
        "bf16",
        "fp32",
        "none",
        "fp32",
        False,
        "as bf16-mixed, and eligible Linear layers are torchao Float8Linear (float8 matmuls, one power-of-2 scale per "
        "row; weights all-gathered in bf16)",
    ),
}

_FSDP_HOW = {
    "bf16-mixed": "FSDP MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
    "16-mixed": "FSDP MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=fp32) + ShardedGradScaler",
}
_P3D_HOW = {
    "bf16-mixed": "as fsdp2 when FSDP shards the whole module (dp or ep > 1, no pipeline); else bf16 autocast",
    "16-mixed": "as fsdp2 when FSDP shards the whole module; else fp16 autocast + ShardedGradScaler (all ranks; "
    "under a pipeline each microbatch loss is scaled inside the schedule)",
}
_DS_BF16 = (
    "DeepSpeed's bf16 engine: the module's parameters are bf16 (every op computes in bf16, no autocast) and the "
    "optimizer steps an fp32 master copy with fp32 state"
)
_DS_FP16 = "DeepSpeed's fp16 engine: fp16 parameters, an fp32 master copy and DeepSpeed's dynamic loss scaler"
_DIFFERENT = {
    ("zero", "32-true"): Meaning(
        "fp32",
        "fp32",
        "fp32",
        "fp32",
        "fp32",
        False,
        "plain fp32",
        "DeepSpeed's optimizer steps its own fp32 copy of each rank's partition (4 more bytes per parameter / N); "
        "the values are the same",
        same_values=True,
    ),
    ("zero", "bf16-mixed"): Meaning(
        "bf16", "bf16", "fp32", "fp32", "fp32", False, "DeepSpeed bf16 + communication_data_type=fp32", _DS_BF16
    ),
    ("zero", "16-mixed"): Meaning(
        "fp16",
        "fp16",
        "fp32",
        "fp32",
        "fp32",
        True,
        "DeepSpeed fp16 + communication_data_type=fp32 (CUDA only: not observed by the CPU test)",
        _DS_FP16,
    ),
    ("zero", "bf16-true"): Meaning(
        "bf16", "bf16", "bf16", "fp32", "fp32", False, "DeepSpeed bf16", _DS_BF16 + " (it has no pure-bf16 optimizer)"
    ),
}
# (family, precision, device type) -> why the engine cannot run it there.
_REFUSED = {
    ("zero", "16-mixed", "cpu"): "DeepSpeed's CPU accelerator has no fp16 support (its fp16 engine needs CUDA)",
}
_FLOAT8_ELSEWHERE = {
    "zero": "DeepSpeed partitions its own flat bf16/fp16 buffers and has no float8 Linear; use fsdp2 or parallel_3d",
    "bucketed_ddp": "float8 is applied on the one parallelize path of fsdp2 and parallel_3d (fsdp2 also runs on one "
    "device)",
}
_FLOAT8_CPU = (
    "float8 matmuls need a CUDA GPU with float8 tensor cores (compute capability >= 8.9); on CPU only torchao's "
    "emulation runs: plugins=[lightscale.Float8Precision('float8', emulate=True)] instead of precision='float8'"
)
for _name in FLOAT8:
    for _device in ("cpu", "cuda"):
        _REFUSED |= {(family, _name, _device): why for family, why in _FLOAT8_ELSEWHERE.items()}
    _REFUSED |= {(family, _name, "cpu"): _FLOAT8_CPU for family in ("fsdp2", "parallel_3d")}


def normalize_precision(precision: str | int) -> str:
    """The contract's name for a Trainer ``precision``: Lightning's ``32`` / ``"32"`` is ``32-true``."""
    name = str(precision)
    return "32-true" if name == "32" else name


def meaning(family: Family, precision: str, *, compression: str = "none") -> Meaning:
    """The contract row for ``precision`` under ``family``; ``compression`` lowers the reduction dtype."""
    check_family(family)
    check_contract_precision(precision)
    check_compression(compression, family)
    row = _DIFFERENT.get((family, precision)) or _standard(family, precision)
    if compression in ("none", "powersgd") or row.reduce == compression:  # PowerSGD reduces its factors in fp32
        return row
    return replace(row, reduce=compression)


def _standard(family: Family, precision: str) -> Meaning:
    row = STANDARD[precision]
    how = {"fsdp2": _FSDP_HOW, "parallel_3d": _P3D_HOW}.get(family, {}).get(precision)
    return replace(row, how=how) if how else row


def refusal(family: Family, precision: str, device_type: str, *, emulate: bool = False) -> str | None:
    """Why ``family`` cannot run ``precision`` on ``device_type``, or None. ``emulate``: float8 by torchao's
    emulation, which runs wherever the family runs float8 at all."""
    if emulate and precision in FLOAT8:
        return _REFUSED.get((family, precision, "cuda"))
    return _REFUSED.get((family, precision, device_type))


def valid_precisions(family: Family, device_type: str) -> list[str]:
    return [p for p in PRECISIONS if refusal(family, p, device_type) is None]


def enforce_contract(
    family: Family, precision: str, *, device_type: str, compression: str = "none", emulate: bool = False
) -> Meaning:
    """Refuse what the engine cannot run (before any work) and warn once where it changes the meaning."""
    row = meaning(family, precision, compression=compression)
    refuse_impossible(family, precision, device_type=device_type, compression=compression, emulate=emulate)
    if row.difference:
        message = f"lightscale: precision={precision!r} under {family}: {row.difference} (docs/plugins/precision.md)."
        if row.same_values:  # nothing for the user to act on: kept for the curious and in RunSummary's table
            log.debug(message)
        else:
            rank_zero_warn(message, category=UserWarning)
    return row


def refuse_impossible(
    family: Family, precision: str, *, device_type: str, compression: str = "none", emulate: bool = False
) -> None:
    """Raise a ConfigurationError naming strategy, precision and the valid precisions if the engine cannot run it."""
    check_compression(compression, family)
    reason = refusal(family, precision, device_type, emulate=emulate)
    if reason is not None:
        raise ConfigurationError(
            f"precision={precision!r} cannot run under the {family} strategies on {device_type}: {reason}. Valid "
            f"precisions there: {', '.join(valid_precisions(family, device_type))}."
        )
    if precision == "bf16-true" and compression == "fp16":
        raise ConfigurationError(
            "compression='fp16' with precision='bf16-true' would send bf16 gradients as fp16 (same size, smaller "
            "range); use compression='none' or 'bf16'."
        )
    if compression == "powersgd" and precision not in _POWERSGD_PRECISIONS:
        raise ConfigurationError(
            f"compression='powersgd' with precision={precision!r} is not supported: PowerSGD needs fp32 gradients "
            "(QR in fp32) and no loss scaler (a skipped step's inf would stay in its error feedback). Use precision "
            f"{' or '.join(map(repr, _POWERSGD_PRECISIONS))}, or compression='bf16'."
        )


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ConfigurationError(f"Unknown strategy family {family!r}; choose one of {', '.join(FAMILIES)}.")


def check_contract_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigurationError(f"precision={precision!r} has no contract row; choose one of {', '.join(PRECISIONS)}.")


def valid_compressions(family: Family) -> tuple[str, ...]:
    return COMPRESSIONS + tuple(name for name, families in _ONLY_UNDER.items() if family in families)


def check_compression(compression: str, family: Family) -> None:
    """The one gradient-compression option every data-parallel strategy takes; some values only under ``family``."""
    valid = valid_compressions(family)
    if compression in valid:
        return
    if compression in _ONLY_UNDER:
        raise ConfigurationError(
            f"compression={compression!r} is valid only under the {', '.join(_ONLY_UNDER[compression])} strategies "
            f"(e.g. strategy='bucketed_ddp_powersgd'), not under {family}; valid here: {', '.join(map(repr, valid))}."
        )
    raise ConfigurationError(f"compression={compression!r} is not valid; choose one of {', '.join(map(repr, valid))}.")


def render_table(members: Mapping[str, Sequence[str]]) -> str:
    """The markdown tables of docs/plugins/precision.md (a test keeps the page equal to it): which strategy names
    belong to each family (``members``: ``lightscale.strategies.registry.family_members()``), then the contract."""
    lines = ["| family | strategy names |", "|---|---|"]
    lines += [f"| {family} | {', '.join(f'`{name}`' for name in members.get(family, ()))} |" for family in FAMILIES]
    lines += [
        "",
        "| family | precision | parameters | compute | gradient reduce | fp32 master | optimizer state | "
        "loss scaling | how | engine difference (warned at start-up where values change) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        for precision in PRECISIONS:
            row = meaning(family, precision)
            refused = refusal(family, precision, "cpu")
            diff = row.difference + (f"; refused on CPU: {refused}" if refused else "")
            lines.append(
                f"| {family} | `{precision}` | {row.params} | {row.compute} | {row.reduce} | {row.master} | "
                f"{row.optimizer_state} | {'dynamic' if row.loss_scaling else 'no'} | {row.how} | {diff or '-'} |"
            )
    return "\n".join(lines) + "\n"
