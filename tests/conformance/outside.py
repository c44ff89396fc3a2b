"""Loads the matrix's checkpoints the way a user's notebook or serving process does, in a fresh Python; prints one
JSON line: ``{"<name>/<model>": {"load": "ok" | error, "validate": "ok" | error}}``.

    python outside.py lightscale MANIFEST   # `import lightscale`, then Model.load_from_checkpoint(dir) and plain
                                            # lightning.Trainer(devices=1).validate(model, ckpt_path=dir)
    python -I outside.py plain MANIFEST     # lightscale not importable: the consolidated files, load_from_checkpoint

MANIFEST is a JSON list of ``{"cell", "model", "checkpoint", "expected"}``; ``expected`` a ``torch.save``d dict of
the trained model's tensors (its ``state_dict`` keys).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

MODE = sys.argv[1]
if MODE == "plain":  # an editable install of lightscale must not be reachable either
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "") + repr(f)]
    sys.path[:] = [p for p in sys.path if "__editable__" not in p and "lightscale" not in p]
    assert importlib.util.find_spec("lightscale") is None, "lightscale is importable"
sys.path.insert(0, str(Path(__file__).parent))  # the zoo (it imports no lightscale)

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from zoo import GLOBAL_BATCH, ZOO, ZooModule, batch  # noqa: E402

if MODE == "lightscale":
    import lightscale  # noqa: F401  - all a user does before loading


def _trained(model: str, expected: dict[str, torch.Tensor]) -> ZooModule:
    module = ZOO[model]()
    module.configure_model()
    module.load_state_dict(expected)
    return module


def _load(model: str, checkpoint: str, expected: dict[str, torch.Tensor]) -> str:
    state = ZOO[model].load_from_checkpoint(checkpoint).state_dict()
    if sorted(state) != sorted(expected):
        return f"keys differ: {sorted(set(state) ^ set(expected))}"
    different = [key for key, value in expected.items() if not torch.equal(state[key], value)]
    return f"not the trained tensors: {different}" if different else "ok"


def _validate(model: str, checkpoint: str, expected: dict[str, torch.Tensor]) -> str:
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, **quiet)
    data = DataLoader(TensorDataset(*batch(ZOO[model])), batch_size=GLOBAL_BATCH)
    got = trainer.validate(ZOO[model](), data, ckpt_path=checkpoint, verbose=False)[0]["val_loss"]
    with torch.no_grad():
        want = _trained(model, expected).compute_loss(batch(ZOO[model])).item()
    return "ok" if abs(got - want) <= 1e-6 * abs(want) else f"val_loss {got} != {want} of the trained model"


def _attempt(check: object, *args: object) -> str:
    try:
        return check(*args)  # type: ignore[operator]
    except Exception as error:
        return f"{type(error).__name__}: {str(error)[:400]}"


def main() -> None:
    report = {}
    for entry in json.loads(Path(sys.argv[2]).read_text()):
        expected = torch.load(entry["expected"], weights_only=True)
        args = (entry["model"], entry["checkpoint"], expected)
        report[entry["cell"]] = {"load": _attempt(_load, *args)}
        if MODE == "lightscale":
            report[entry["cell"]]["validate"] = _attempt(_validate, *args)
    report["lightscale imported"] = "lightscale" in sys.modules
    print(json.dumps(report))


if __name__ == "__main__":
    main()
