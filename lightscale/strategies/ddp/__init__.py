"""bucketed_ddp: lightscale's own data parallelism on ``torch.distributed`` collectives (strategy.py), with the
bucketed reducer and PowerSGD of lightscale/parallel/ as its engine and per-step fault tolerance from
lightscale/fault_tolerance/."""

from lightscale.strategies.ddp.strategy import BucketedDDPStrategy

__all__ = ["BucketedDDPStrategy"]
