"""The FSDP2 family on ``fully_shard``: fsdp2, fsdp2_grad_op, hsdp, fsdp2_offload, fsdp2_zeropp (strategy.py); its
engine is the one parallelize path (lightscale/parallel/parallelize.py, fsdp.py, fsdp_wires.py for ZeRO++'s wires)."""

from lightscale.strategies.fsdp2.strategy import FSDP2Strategy

__all__ = ["FSDP2Strategy"]
