"""A single-file Lightning checkpoint read as the portable layout, so every strategy resumes one at any world size.

``checkpoint_format="file"`` (bucketed_ddp, DiLoCo's global model) writes Lightning's own format: ``state_dict``
(whole tensors), ``optimizer_states`` (torch's ``Optimizer.state_dict()``: state by parameter *position*) and the
rest, plus a ``lightscale`` entry that names the parameters of every optimizer group (lightning_format.py's
``describe_optimizers``). With those names the file is the layout's flat entries::

    model.<fqn>                          state_dict[fqn]
    optimizer.state.<fqn>.<key>          optimizer_states[i]["state"][position of fqn][key]
    optimizer.param_groups.<fqn>.<key>   optimizer_states[i]["param_groups"][group of fqn][key]

and :func:`fill` writes them into the same templates DCP fills (plain tensors whole, DTensors this rank's shard,
cut locally: every rank has read the whole file), so layout.py's ``read_checkpoint`` and every loader built on it
(FSDP2, parallel_3d, ZeRO's batched load) read a file as they read a directory. A file without the names (Lightning's
own strategies wrote it) gives its weights; its optimizer state loads only where positions mean the same
(bucketed_ddp, through Lightning's own restore). Read weights-only; the last file read is kept for the next reads of
one load (ZeRO reads a batch of parameters at a time) and dropped when the load ends (:func:`forget_file_layout`).

Example:
    >>> layout = read_file_layout(Path("last.ckpt"))
    >>> layout.fill({"model": module.state_dict()})
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from lightscale.checkpoint.averaged import AVERAGED_META, from_lightning_convention, without_lightning_entries
from lightscale.errors import ConfigurationError
from lightscale.storage.safe_io import load_weights_only
from lightscale.storage.urls import Location, RemotePath

_LIGHTNING_TENSORS = ("state_dict", "optimizer_states")


@dataclass
class FileLayout:
    path: Location
    flat: dict[str, Any]  # the layout's flat keys (module docstring)
    rest: dict[str, Any]  # the rest of Lightning's checkpoint: what trainer_state.pt holds in a directory

    def metadata(self) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
        """What a DCP ``.metadata`` would say about each entry (global shape and dtype of tensors)."""
        return {
            key: TensorStorageMetadata(TensorProperties(dtype=value.dtype), value.shape, [])
            if isinstance(value, Tensor)
            else BytesStorageMetadata()
            for key, value in self.flat.items()
        }

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        return {key[len("model.") :]: tuple(v.shape) for key, v in self.flat.items() if key.startswith("model.")}

    def fill(self, state: dict[str, Any]) -> None:
        """Fill the template ``state`` (layout.py's nested layout) in place, as ``dcp.load`` would."""
        missing: list[str] = []
        _fill(state, "", self.flat, missing)
        if missing:
            optimizer = [key for key in missing if key.startswith("optimizer.")]
            hint = (
                " It holds no optimizer state by parameter name (a file Lightning's own strategies wrote, or one "
                "saved without optimizers): resume it under bucketed_ddp, which restores Lightning's optimizer "
                "state by position, or load only its weights (validate/test, InitWeights)."
                if optimizer
                else ""
            )
            raise ConfigurationError(f"{self.path} has no entry {missing[:3]} (and {len(missing)} in all).{hint}")


def _fill(template: dict[str, Any], prefix: str, flat: dict[str, Any], missing: list[str]) -> None:
    for name, slot in template.items():
        key = prefix + name
        if isinstance(slot, dict):
            _fill(slot, key + ".", flat, missing)
        elif key not in flat:
            missing.append(key)
        elif isinstance(slot, DTensor):  # this rank's shard, cut from the whole tensor without communication
            whole = flat[key].to(slot.dtype)
            shard = distribute_tensor(whole, slot.device_mesh, slot.placements, src_data_rank=None).to_local()
            slot.to_local().copy_(shard)
        elif isinstance(slot, Tensor):
            slot.copy_(flat[key])
        else:
            template[name] = copy.deepcopy(flat[key])


_last: tuple[tuple[str, str, int], FileLayout] | None = None


def read_file_layout(path: Location) -> FileLayout:
    """The single-file checkpoint ``path`` as the layout (weights-only; the last file read is reused)."""
    global _last
    identity = _identity(path)
    if _last is not None and _last[0] == identity:
        return _last[1]
    loaded = _load(path)
    raw, averaged, counter = from_lightning_convention(loaded)  # Lightning's WeightAveraging: average as state_dict
    flat = {f"model.{name}": value for name, value in raw.items()}
    flat |= {f"averaged.{name}": value for name, value in (averaged or {}).items()}
    described = loaded.get("lightscale", {}).get("optimizers")
    if described is not None and loaded.get("optimizer_states"):
        flat |= _flat_optimizers(loaded["optimizer_states"], described)
    rest = {key: value for key, value in without_lightning_entries(loaded).items() if key not in _LIGHTNING_TENSORS}
    if counter is not None:
        rest[AVERAGED_META] = counter
    layout = FileLayout(path, flat, rest)
    _last = (identity, layout)
    return layout


def _identity(path: Location) -> tuple[str, str, int]:
    """Name, version and size of a file: a changed file is read again."""
    if isinstance(path, RemotePath):
        info = path.fs.info(path.key)
        version = info.get("ETag") or info.get("LastModified") or info.get("mtime") or info.get("created")
        return str(path), str(version), int(info["size"])
    stat = path.stat()
    return str(path.resolve()), str(stat.st_mtime_ns), stat.st_size


def forget_file_layout() -> None:
    """Drop the kept file (every rank holds a whole copy): a strategy calls this when its load has finished."""
    global _last
    _last = None


def _load(path: Location) -> dict[str, Any]:
    loaded = load_weights_only(path)
    if not isinstance(loaded, dict) or not isinstance(loaded.get("state_dict"), dict):
        raise ConfigurationError(
            f"{path} is a file but not a Lightning checkpoint (no 'state_dict'); a lightscale strategy resumes a "
            "checkpoint directory it wrote or a Lightning single-file checkpoint."
        )
    return loaded


def _flat_optimizers(states: list[dict[str, Any]], described: list[dict[str, Any]]) -> dict[str, Any]:
    """torch's position-keyed optimizer states as the layout's name-keyed entries."""
    flat: dict[str, Any] = {}
    for state, optimizer in zip(states, described, strict=True):
        names = [name for group in optimizer["groups"] for name in group]
        for position, entries in state["state"].items():
            flat |= {f"optimizer.state.{names[position]}.{key}": value for key, value in entries.items()}
        for group, group_names in zip(state["param_groups"], optimizer["groups"], strict=True):
            settings = {key: value for key, value in group.items() if key != "params"}
            flat |= {f"optimizer.param_groups.{name}.{k}": v for name in group_names for k, v in settings.items()}
    return flat
