"""Memory before a run is answered from the strategy classes: ``estimate_memory`` by name (what ``lightscale plan``
asks) builds no strategy, so no constructor installs Lightning patches or needs an engine."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json

    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    import lightscale.strategies.base as base
    from lightscale.estimate import estimate_memory
    from lightscale.recipes.gpt.model import GPTConfig
    from lightscale.recipes.gpt.module import GPTModule
    from lightscale.strategies.registry import REGISTERED

    built, patched = [], []


    def refuse_instance(cls, *args, **kwargs):
        built.append(cls.__name__)
        raise AssertionError(f"{cls.__name__} built")


    base.LightscaleStrategy.__new__ = refuse_instance
    base.patch_lightning = lambda: patched.append(True)
    checked = _AcceleratorConnector._check_config_and_set_final_flags
    model = GPTModule(GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_embd=64))
    answered, refused = [], []
    for cls in list(REGISTERED):
        for name in cls.__dict__["aliases"]:
            try:
                estimate_memory(model, name, world_size=8, micro_batch=2)
                answered.append(name)
            except Exception as error:  # a refusal (fit_memory chooses at fit) is an answer too, an instance is not
                refused.append(f"{name}: {type(error).__name__}")
    untouched = _AcceleratorConnector._check_config_and_set_final_flags is checked
    print(json.dumps({"built": built, "patched": len(patched), "untouched": untouched,
                      "answered": answered, "refused": refused}))
    """
)


def test_estimate_memory_of_every_name_builds_no_strategy_and_installs_no_patch() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["built"] == [] and out["patched"] == 0 and out["untouched"], out
    assert out["refused"] == ["fit_memory: ConfigurationError"], out  # it chooses at fit; every other name answers
    assert len(out["answered"]) > 10, out
