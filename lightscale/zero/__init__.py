"""Old home of the ZeRO family's engine, now lightscale/strategies/deepspeed/ (and the offline reader of DeepSpeed's
directories, lightscale/checkpoint/deepspeed_dir.py). Kept for a release for the two paths the docs showed:
``python -m lightscale.zero.ops`` and ``from lightscale.zero.checkpoint_dir import consolidate_zero_checkpoint``."""
