"""The ZeRO family on DeepSpeed's engine (zero1 ... zero_infinity): every line of lightscale that knows DeepSpeed,
but the patch module and the offline reader of its directories (lightscale/checkpoint/deepspeed_dir.py).

    strategy.py        the Trainer face (``ZeroStrategy``)
    config.py          the DeepSpeed config built from the strategy's few settings
    build.py engine.py the engine built around the user's model and optimizer, and what is asked of it
    partition*.py optimizer_tensors.py shards.py   ZeRO's flat partitions and what a strategy answers about them
    precision.py       DeepSpeed's meaning of each precision name
    checkpoint.py portable_save.py load_portable.py   checkpoints: DeepSpeed's directory and the portable layout
    ops.py             DeepSpeed's CPU ops, built once (``python -m lightscale.strategies.deepspeed.ops``)

DeepSpeed itself is imported lazily (the ``[deepspeed]`` extra)."""

from lightscale.strategies.deepspeed.strategy import ZeroStrategy

__all__ = ["ZeroStrategy"]
