"""The precision contract: what each precision name means under every strategy family, as data.

One table answers, for ``32-true``, ``bf16-mixed``, ``16-mixed`` and ``bf16-true`` under every family (the class
of a strategy and its subclasses): the dtype parameters are stored in, the dtype matmuls compute in, the dtype
handed to the data-parallel gradient collective, whether a separate fp32 master copy exists, the optimizer state's
dtype and whether a dynamic loss scaler runs. The mixed modes reduce gradients in fp32 everywhere; the one strategy
argument ``compression="bf16"`` (or ``"fp16"``) asks for low-precision reduction under every family.

This module holds the shared vocabulary (:data:`PRECISIONS`, :class:`Meaning`, the :data:`STANDARD` rows) and the
mechanism; each strategy class declares its own rules as class data (``precision_rules``, a :class:`PrecisionRules`
built in the class's module): how each precision is realised under it, where its engine forces another meaning (the
row's ``difference``, warned at start-up), what it refuses and why (before any work, :func:`enforce_contract`) and
which compressions only it implements. The functions below are asked with those rules, never with a family's name.
docs/plugins/precision.md is generated from :func:`render_table`; tests/distributed/test_precision_contract.py
observes every dtype in real steps and compares it with this table.

Example:
    >>> meaning(ZeroStrategy.precision_rules, "bf16-true").master
    'fp32'
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightscale.errors import ConfigurationError

log = logging.getLogger(__name__)

Compression = Literal["none", "bf16", "fp16", "powersgd"]
# The one list of precision names lightscale gives a meaning to (Lightning's "32" is normalised to "32-true").
# The float8 names are torchao's recipes on top of bf16-mixed (lightscale/layers/float8.py).
FLOAT8 = {"float8": "tensorwise", "float8-rowwise": "rowwise"}
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", *FLOAT8)
COMPRESSIONS = ("none", "bf16", "fp16")  # every family; a family adds its own (PrecisionRules.compressions)
DEVICE_TYPES = ("cpu", "cuda")
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
# Why a family that runs float8 refuses it on CPU (torchao's emulation runs there instead).
FLOAT8_CPU = (
    "float8 matmuls need a CUDA GPU with float8 tensor cores (compute capability >= 8.9); on CPU only torchao's "
    "emulation runs: plugins=[lightscale.Float8Precision('float8', emulate=True)] instead of precision='float8'"
)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per family, shared by subclasses
class PrecisionRules:
    """A strategy family's part of the contract, declared by its class (``precision_rules``) and read from there.

    Example:
        >>> PrecisionRules("fsdp2", how={"bf16-mixed": "FSDP MixedPrecisionPolicy(...)"}, refused=float8_refused(
        ...     FLOAT8_CPU, devices=("cpu",)))
    """

    family: str  # the name docs and messages give the family ("the fsdp2 strategies")
    how: Mapping[str, str] = field(default_factory=dict)  # precision -> its mechanism here, same meaning
    meanings: Mapping[str, Meaning] = field(default_factory=dict)  # precision -> the engine's own row (a difference)
    refused: Mapping[tuple[str, str], str] = field(default_factory=dict)  # (precision, device type) -> why
    # Compressions beyond COMPRESSIONS that only this family implements -> a strategy name that runs it (for errors).
    compressions: Mapping[str, str] = field(default_factory=dict)


def float8_refused(why: str, *, devices: Sequence[str] = DEVICE_TYPES) -> dict[tuple[str, str], str]:
    """``refused`` entries for every float8 name on ``devices``, for one reason."""
    return {(name, device): why for name in FLOAT8 for device in devices}


# Every family a registered strategy class declares, in registration order (LightscaleStrategy.__init_subclass__):
# check_compression names the families that implement a compression the asked one lacks.
_DECLARED: list[PrecisionRules] = []


def declare_family(rules: object) -> None:
    """Know ``rules`` (a strategy class's ``precision_rules``); refuse anything that is not a PrecisionRules."""
    if not isinstance(rules, PrecisionRules):
        raise ConfigurationError(
            f"precision_rules={rules!r} is not a lightscale.plugins.precision_contract.PrecisionRules; declare one "
            "on the strategy class (or inherit its parent's)."
        )
    if rules not in _DECLARED:
        _DECLARED.append(rules)


def normalize_precision(precision: str | int) -> str:
    """The contract's name for a Trainer ``precision``: Lightning's ``32`` / ``"32"`` is ``32-true``."""
    name = str(precision)
    return "32-true" if name == "32" else name


def meaning(rules: PrecisionRules, precision: str, *, compression: str = "none") -> Meaning:
    """The contract row for ``precision`` under the family of ``rules``; ``compression`` lowers the reduction dtype."""
    check_contract_precision(precision)
    check_compression(compression, rules)
    row = rules.meanings.get(precision) or _standard(rules, precision)
    if compression in ("none", "powersgd") or row.reduce == compression:  # PowerSGD reduces its factors in fp32
        return row
    return replace(row, reduce=compression)


def _standard(rules: PrecisionRules, precision: str) -> Meaning:
    row = STANDARD[precision]
    how = rules.how.get(precision)
    return replace(row, how=how) if how else row


def refusal(rules: PrecisionRules, precision: str, device_type: str, *, emulate: bool = False) -> str | None:
    """Why the family of ``rules`` cannot run ``precision`` on ``device_type``, or None. ``emulate``: float8 by
    torchao's emulation, which runs wherever the family runs float8 at all."""
    if emulate and precision in FLOAT8:
        return rules.refused.get((precision, "cuda"))
    return rules.refused.get((precision, device_type))


def valid_precisions(rules: PrecisionRules, device_type: str) -> list[str]:
    return [p for p in PRECISIONS if refusal(rules, p, device_type) is None]


def enforce_contract(
    rules: PrecisionRules, precision: str, *, device_type: str, compression: str = "none", emulate: bool = False
) -> Meaning:
    """Refuse what the engine cannot run (before any work) and warn once where it changes the meaning."""
    row = meaning(rules, precision, compression=compression)
    refuse_impossible(rules, precision, device_type=device_type, compression=compression, emulate=emulate)
    if row.difference:
        message = (
            f"lightscale: precision={precision!r} under {rules.family}: {row.difference} (docs/plugins/precision.md)."
        )
        if row.same_values:  # nothing for the user to act on: kept for the curious and in RunSummary's table
            log.debug(message)
        else:
            rank_zero_warn(message, category=UserWarning)
    return row


def refuse_impossible(
    rules: PrecisionRules, precision: str, *, device_type: str, compression: str = "none", emulate: bool = False
) -> None:
    """Raise a ConfigurationError naming strategy, precision and the valid precisions if the engine cannot run it."""
    check_compression(compression, rules)
    reason = refusal(rules, precision, device_type, emulate=emulate)
    if reason is not None:
        raise ConfigurationError(
            f"precision={precision!r} cannot run under the {rules.family} strategies on {device_type}: {reason}. "
            f"Valid precisions there: {', '.join(valid_precisions(rules, device_type))}."
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


def check_contract_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigurationError(f"precision={precision!r} has no contract row; choose one of {', '.join(PRECISIONS)}.")


def valid_compressions(rules: PrecisionRules) -> tuple[str, ...]:
    return COMPRESSIONS + tuple(rules.compressions)


def check_compression(compression: str, rules: PrecisionRules) -> None:
    """The one gradient-compression option every data-parallel strategy takes; some values only under some
    families (those that declare them)."""
    valid = valid_compressions(rules)
    if compression in valid:
        return
    elsewhere = [other for other in _DECLARED if compression in other.compressions]
    if elsewhere:
        raise ConfigurationError(
            f"compression={compression!r} is valid only under the {', '.join(o.family for o in elsewhere)} "
            f"strategies (e.g. strategy={elsewhere[0].compressions[compression]!r}), not under {rules.family}; "
            f"valid here: {', '.join(map(repr, valid))}."
        )
    raise ConfigurationError(f"compression={compression!r} is not valid; choose one of {', '.join(map(repr, valid))}.")


def render_table(members: Mapping[PrecisionRules, Sequence[str]]) -> str:
    """The markdown tables of docs/plugins/precision.md (a test keeps the page equal to it): which strategy names
    belong to each family (``members``: ``lightscale.strategies.registry.family_members()``, in registration
    order), then the contract."""
    lines = ["| family | strategy names |", "|---|---|"]
    lines += [f"| {rules.family} | {', '.join(f'`{name}`' for name in names)} |" for rules, names in members.items()]
    lines += [
        "",
        "| family | precision | parameters | compute | gradient reduce | fp32 master | optimizer state | "
        "loss scaling | how | engine difference (warned at start-up where values change) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rules in members:
        for precision in PRECISIONS:
            row = meaning(rules, precision)
            refused = refusal(rules, precision, "cpu")
            diff = row.difference + (f"; refused on CPU: {refused}" if refused else "")
            lines.append(
                f"| {rules.family} | `{precision}` | {row.params} | {row.compute} | {row.reduce} | {row.master} | "
                f"{row.optimizer_state} | {'dynamic' if row.loss_scaling else 'no'} | {row.how} | {diff or '-'} |"
            )
    return "\n".join(lines) + "\n"
