"""Tied weights: one parameter registered under several names (e.g. an output head sharing the token embedding).

Steps that replace a module's parameters one module at a time (moving off the meta device, tensor-parallel styles)
give each name its own new tensor and so untie them; these two functions record the ties first and restore them.
"""

from __future__ import annotations

from torch import nn


def tied_parameters(model: nn.Module) -> list[tuple[str, str]]:
    """(alias, first name) of every parameter registered under two names (e.g. a head tied to the embedding)."""
    first: dict[int, str] = {}
    ties = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if id(param) in first and first[id(param)] != full:
                ties.append((full, first[id(param)]))
            first.setdefault(id(param), full)
    return ties


def retie(model: nn.Module, ties: list[tuple[str, str]]) -> None:
    """Point every alias of ``ties`` at the parameter its original name holds now."""
    for alias, original in ties:
        owner, _, name = alias.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, name, model.get_parameter(original))
